"""``zero_optimization.zenflow``: DeepSpeed's ZenFlow keys, names and defaults as in
DeepSpeed 0.19.8 (deepspeed/runtime/zenflow/zenflow_config.py, the checks of
runtime/zenflow/engine.py), parsed into :class:`~zero_core.config.schema.ZenFlowConfig`.
What ZenFlow does is zero_core/offload/zenflow.py's docstring. parser.py calls
:func:`parse_zenflow` with its ``zero_optimization`` section.

Refused here, each by name: ``update_interval: "auto"`` (DeepSpeed's default: an interval
that adapts to the unselected gradients' mass, not implemented) and ``auto_ratio`` away from
its default (it acts only there); ZenFlow at stage 3 (DeepSpeed has it; not implemented
here); ZenFlow without ``offload_optimizer.device: "cpu"`` (DeepSpeed: "Zenflow must be used
with cpu offload"), or with partial offload (``ratio`` < 1) or ``super_offload``.

For whoever implements ``"auto"`` (DeepSpeed 0.19.8, read, not run): per micro-step and 2-D
weight, runtime/zenflow/zenflow_stage_1_and_2.py keeps ``avg_critic_sum = (avg × (u-1) +
Σ|selected g|) / u / (topk_ratio × 10)`` and ``non_critic_sum += (Σ|g| - Σ|selected g|) /
((1 - topk_ratio) × 10)`` (u: micro-steps since the last host update; Σ|g| summed in bf16);
a weight "needs an update" when non_critic >= avg_critic, and the host update is due when
at least int(auto_ratio × number of non-1-D weights) do. The flag lives in a two-slot array
indexed by ``zenflow_state``, flipped by engine.py's backward after ``backward_prologue``
cleared one slot; as read, the slot written during the backward is not the one the boundary
test reads: run DeepSpeed's own ZenFlow in auto mode to pin the observable schedule before
writing the float64 reference. Its per-weight sums would join the checkpoint
(offload/zenflow.py's ``checkpoint_extra``).
"""
from __future__ import annotations

from typing import Any

from zero_core.config.checks import _as_bool, _as_float, _as_int, _fail, _Section
from zero_core.config.schema import ZenFlowConfig

PATH = "zero_optimization.zenflow"
STRATEGIES = ("auto", "step", "epoch")


def _interval(path: str, value: Any) -> int | str:
    if value == "auto":
        return "auto"
    return _as_int(path, value, 0)


def _strategy(path: str, value: Any) -> str:
    if value not in STRATEGIES:
        raise _fail(path, value, 'expected "auto", "step" or "epoch"')
    return value


def parse_zenflow(zero, stage: int, offload) -> ZenFlowConfig | None:
    """The section of *zero* (parser.py's ``_Section`` of ``zero_optimization``; *offload*:
    the parsed ``offload_optimizer``), or None when it is absent or null (ZenFlow off)."""
    raw = zero.raw.get("zenflow")
    if raw is None:
        return None
    overlap_comm = zero.get("overlap_comm", True, _as_bool)
    s = _Section(raw, PATH, PATH)
    cfg = ZenFlowConfig(
        topk_ratio=s.get("topk_ratio", 0.1, _as_float, 0.0, 1.0, True, True),
        select_strategy=s.get("select_strategy", "auto", _strategy),
        select_interval=s.get("select_interval", "auto", _interval),
        update_interval=s.get("update_interval", "auto", _interval),
        overlap_step=s.get("overlap_step", False, _as_bool),
        offload=s.get("offload", False, _as_bool),
        full_warm_up_rounds=s.get("full_warm_up_rounds", 0, _as_int, 0),
        pt_reserved_cores_perc=s.get("pt_reserved_cores_perc", 0.5, _as_float, 0.0, 1.0))
    if cfg.update_interval == "auto":
        raise _fail(f"{PATH}.update_interval", "auto",
                    "DeepSpeed's adaptive update interval (its default, driven by auto_ratio) "
                    "is not implemented yet in zero-core; give the interval as an integer "
                    ">= 1 (DeepSpeed's tutorial uses 4)")
    if cfg.update_interval < 1:
        raise _fail(f"{PATH}.update_interval", cfg.update_interval, "expected an integer >= 1")
    if cfg.select_strategy == "auto" and cfg.select_interval != "auto":
        raise _fail(f"{PATH}.select_interval", cfg.select_interval,
                    "select_strategy \"auto\" selects once per epoch and fixes the interval "
                    "(DeepSpeed refuses a number here too); remove select_interval or set "
                    "select_strategy to \"step\" or \"epoch\"")
    if cfg.select_strategy != "auto" and cfg.select_interval == "auto":
        raise _fail(f"{PATH}.select_interval", "auto",
                    f"select_strategy {cfg.select_strategy!r} needs a number of "
                    f"{cfg.select_strategy}s (an integer >= 0; 0: select once)")
    if (cfg.select_strategy == "step" and cfg.select_interval != 0
            and cfg.select_interval < cfg.update_interval):
        raise _fail(f"{PATH}.select_interval", cfg.select_interval,
                    f"must be >= update_interval ({cfg.update_interval}): the accumulated "
                    f"gradients are applied before the columns are selected again")
    if stage == 3:
        raise _fail(PATH, raw, "ZenFlow at ZeRO stage 3 is not implemented yet in zero-core "
                               "(DeepSpeed has it); use stage 1 or 2, or remove the section")
    if offload.device != "cpu":
        raise _fail(PATH, raw, "ZenFlow steps the unselected columns on the host: it needs "
                               "zero_optimization.offload_optimizer.device \"cpu\" (and so "
                               "stage 1 or 2), as in DeepSpeed")
    for key, off in (("ratio", 1.0), ("super_offload", False)):
        if getattr(offload, key, off) != off:
            raise _fail(f"zero_optimization.offload_optimizer.{key}", getattr(offload, key),
                        f"not together with ZenFlow (it steps every unselected element on the "
                        f"host); keep {str(off).lower()} or remove the zenflow section")
    if cfg.offload and not overlap_comm:
        raise _fail(f"{PATH}.offload", True, "needs zero_optimization.overlap_comm true, as "
                                             "in DeepSpeed")
    return cfg
