"""``zero_optimization.zenflow``: DeepSpeed's ZenFlow keys, names and defaults as in
DeepSpeed 0.19.8 (deepspeed/runtime/zenflow/zenflow_config.py, the checks of
runtime/zenflow/engine.py), parsed into :class:`~zero_core.config.schema.ZenFlowConfig`.
What ZenFlow does is zero_core/offload/zenflow.py's docstring. parser.py calls
:func:`parse_zenflow` with its ``zero_optimization`` section.

Stage 3 (with or without ``offload_param``) is offload/zenflow_stage3.py.
Refused here, each by name: ZenFlow without
``offload_optimizer.device: "cpu"`` (DeepSpeed: "Zenflow must be used with cpu offload"), or
with partial offload (``ratio`` < 1) or ``super_offload``.

``update_interval: "auto"`` (DeepSpeed's default) with ``auto_ratio`` (0..1, default 0.99):
the host update is due when the unselected columns' accumulated gradient mass has caught
up with the selected columns' per-step mass in at least int(``auto_ratio`` × N) of the N
2-D weights; the rule is offload/zenflow_auto.py's docstring. ``auto_ratio`` is accepted
with an integer ``update_interval`` too (as by DeepSpeed) and acts only with "auto".

Decision: DeepSpeed's arithmetic, fired as it is meant to be, not as DeepSpeed 0.19.8 runs.
Its own ZenFlow in auto mode, run on this machine (ZeRO-2, cpu offload, 1 and 2 ranks over
gloo; ci/tools/make_zenflow_auto_fixture.py), shows two faults: (1) the engine sets
``gradient_accumulation_steps`` to the auto interval's placeholder 0 and divides every
loss gradient by it, so all gradients are inf/NaN from the first step; (2) with that
bypassed from outside, the two-slot "needs update" flag is raised on nearly every step, but
the next ``backward_prologue`` clears that slot before the boundary test reads it: the
host update fires after the warm-up only at reselection boundaries (with no loader: never;
the unselected columns are then never updated). Matching that would make "auto" mean
"never", so zero-core keeps what the code and DeepSpeed's docs ("Threshold used in the
'auto' strategy to determine update_interval") intend: the rule's per-step decisions equal
the ones DeepSpeed's own run computes on the same sums (tests/test_zenflow.py, fixture
tests/fixtures/deepspeed_zenflow_auto.json), and a due decision fires the host update at
the step whose gradients made it due. DeepSpeed with only the slot cleared correctly (the
fixture's "repaired" runs) fires one step later (it must fix the boundary before the
backward that computes the sums), and so fires again on the step after, on sums its reset
has not reached yet: updates in pairs; zero-core's windows are not paired.
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


def parse_zenflow(zero, offload) -> ZenFlowConfig | None:
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
        auto_ratio=s.get("auto_ratio", 0.99, _as_float, 0.0, 1.0),
        overlap_step=s.get("overlap_step", False, _as_bool),
        offload=s.get("offload", False, _as_bool),
        full_warm_up_rounds=s.get("full_warm_up_rounds", 0, _as_int, 0),
        pt_reserved_cores_perc=s.get("pt_reserved_cores_perc", 0.5, _as_float, 0.0, 1.0))
    if cfg.update_interval != "auto" and cfg.update_interval < 1:
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
            and cfg.update_interval != "auto" and cfg.select_interval < cfg.update_interval):
        raise _fail(f"{PATH}.select_interval", cfg.select_interval,
                    f"must be >= update_interval ({cfg.update_interval}): the accumulated "
                    f"gradients are applied before the columns are selected again")
    if offload.device != "cpu":
        raise _fail(PATH, raw, "ZenFlow steps the unselected columns on the host: it needs "
                               "zero_optimization.offload_optimizer.device \"cpu\", as in "
                               "DeepSpeed")
    for key, off in (("ratio", 1.0), ("super_offload", False)):
        if getattr(offload, key, off) != off:
            raise _fail(f"zero_optimization.offload_optimizer.{key}", getattr(offload, key),
                        f"not together with ZenFlow (it steps every unselected element on the "
                        f"host); keep {str(off).lower()} or remove the zenflow section")
    if cfg.offload and not overlap_comm:
        raise _fail(f"{PATH}.offload", True, "needs zero_optimization.overlap_comm true, as "
                                             "in DeepSpeed")
    return cfg
