"""``flops_profiler``: DeepSpeed's keys and defaults as in DeepSpeed 0.19.8
(deepspeed/profiling/constants.py), parsed into
:class:`~zero_core.config.schema.FlopsProfilerConfig`, plus zero-core's own
``peak_tflops``. What the profiler does is zero_core/engine/flops.py's docstring.

DeepSpeed reads the section key by key without checking values; zero-core checks each:
``profile_step`` an integer >= 0 (the optimizer steps done before the profiled one),
``module_depth`` >= -1 (-1: every depth), ``top_modules`` >= 1, ``recompute_fwd_factor``
>= 0, ``output_file`` null or a non-empty path, ``peak_tflops`` null or > 0.
"""
from __future__ import annotations

from typing import Any

from zero_core.config.checks import _as_bool, _as_float, _as_int, _fail, _optional, _Section
from zero_core.config.schema import FlopsProfilerConfig

PATH = "flops_profiler"


def _path(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, value, "expected null (print to stdout) or a non-empty file path")
    return value


def parse_flops_profiler(raw: Any) -> FlopsProfilerConfig:
    """The section (absent or null: the profiler off)."""
    s = _Section(raw, PATH, PATH)
    return FlopsProfilerConfig(
        enabled=s.get("enabled", False, _as_bool),
        recompute_fwd_factor=s.get("recompute_fwd_factor", 0.0, _as_float, 0.0),
        profile_step=s.get("profile_step", 1, _as_int, 0),
        module_depth=s.get("module_depth", -1, _as_int, -1),
        top_modules=s.get("top_modules", 1, _as_int, 1),
        detailed=s.get("detailed", True, _as_bool),
        output_file=s.get("output_file", None, _optional(_path)),
        peak_tflops=s.get("peak_tflops", None, _optional(_as_float), lo=0.0, lo_open=True))
