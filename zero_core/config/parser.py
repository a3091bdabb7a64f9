"""Config parsing: ``parse_config(config, world_size)`` takes a dict, a path to a JSON file,
JSON text, an existing :class:`~zero_core.config.schema.Config` or ``None`` (all defaults) and
returns a frozen ``Config``, reading each section with its ``_parse_*`` function and resolving
the batch-size triple. Every problem is a :class:`~zero_core.errors.ConfigError` that names the
key (dotted path), the value and what would be valid. Nothing is silently defaulted or ignored:
a misspelt key is refused with a "did you mean" suggestion, and another unknown key is refused
too, or ignored with a :class:`~zero_core.errors.ConfigWarning` naming it where DeepSpeed
ignores it (the top level, and the sections DeepSpeed reads key by key: see
:mod:`zero_core.config.checks`); a key that DeepSpeed has but zero-core does not implement yet
is refused *by name* (see ``NOT_YET_IMPLEMENTED``), except for a value that asks for exactly
what zero-core already does, i.e. the feature switched off (``NEUTRAL_VALUES``, e.g.
``"fp16": {"auto_cast": false}``), and in a section switched off with ``"enabled": false``,
whose values are not read; Hugging Face's ``"auto"`` placeholders are refused (the HF Trainer
fills them in before DeepSpeed sees the config; zero-core needs the concrete number).
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from zero_core.config.checks import (_as_bool, _as_float, _as_int, _as_name, _fail, _optional,
                                     _refuse_auto, _require_divisor, _Section, _suggest)
from zero_core.config.keys import (_OPTIMIZERS_NOT_YET, _SCHEDULERS_NOT_YET, MAX_ZERO_STAGE,
                                   OPTIMIZER_TYPES, SCHEDULER_TYPES)
from zero_core.config.elasticity import elastic_batch
from zero_core.config.monitors import parse_monitors
from zero_core.config.onebit_sections import ONEBIT_TYPES, drop_onebit_unused, parse_onebit
from zero_core.config.precision_sections import parse_precision
from zero_core.config.zero_sections import parse_many_nodes, parse_zeropp
from zero_core.config.zenflow_section import parse_zenflow
from zero_core.config.flops_section import parse_flops_profiler
from zero_core.config.schema import (NONFINITE_ACTIONS, ActivationCheckpointingConfig,
                                     BF16Config, CheckpointConfig, Config, GenerationConfig,
                                     HybridEngineConfig, OffloadOptimizerConfig,
                                     OffloadParamConfig, OptimizerConfig, SafetyConfig,
                                     SchedulerConfig, TopologyConfig, ZeroConfig)
from zero_core.errors import ConfigError, ConfigWarning

__all__ = ["parse_config", "parse_activation_checkpointing", "OFFLOAD_DEVICES"]


# ---------------------------------------------------------------------------------------------
# Sections.
# ---------------------------------------------------------------------------------------------

def _canonical_type(path: str, value: Any, valid: tuple[str, ...], pending: tuple[str, ...],
                    what: str, any_case: bool) -> str:
    name = _as_name(path, value)
    for v in valid:
        if v == name or (any_case and v.lower() == name.lower()):
            return v
    for p in pending:
        if p.lower() == name.lower():
            raise ConfigError(f"config key '{path}' = {value!r}: the {p} {what} is not "
                              f"implemented yet in zero-core; use one of {', '.join(valid)}")
    raise _fail(path, value, f"unknown {what}{_suggest(name, valid)} (valid: {', '.join(valid)})")


def _parse_betas(path: str, value: Any) -> tuple[float, float]:
    _refuse_auto(path, value)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _fail(path, value, "expected a list of two numbers [beta1, beta2], each in [0, 1)")
    return (_as_float(f"{path}[0]", value[0], 0.0, 1.0, hi_open=True),
            _as_float(f"{path}[1]", value[1], 0.0, 1.0, hi_open=True))


def _parse_optimizer(raw: Any) -> OptimizerConfig | None:
    if raw is None:
        return None
    s = _Section(raw, "optimizer", "optimizer")
    if not s.has("type"):
        raise ConfigError(f"config key 'optimizer.type' is missing: name the optimizer, one of "
                          f"{', '.join(OPTIMIZER_TYPES)}")
    kind = s.get("type", None, _canonical_type, OPTIMIZER_TYPES, _OPTIMIZERS_NOT_YET, "optimizer",
                 True)
    raw_params = s.raw.get("params")
    if kind in ONEBIT_TYPES:
        raw_params = drop_onebit_unused(raw_params, kind)
    p = _Section(raw_params, "optimizer.params", f"optimizer.params:{kind}")
    lr = p.get("lr", 1e-3, _as_float, lo=0.0)
    weight_decay = p.get("weight_decay", 0.0, _as_float, lo=0.0)
    if kind == "SGD":
        momentum = p.get("momentum", 0.0, _as_float, lo=0.0)
        dampening = p.get("dampening", 0.0, _as_float, lo=0.0)
        nesterov = p.get("nesterov", False, _as_bool)
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise _fail("optimizer.params.nesterov", True,
                        f"Nesterov momentum needs momentum > 0 and dampening = 0 (got momentum="
                        f"{momentum:g}, dampening={dampening:g})")
        return OptimizerConfig(type=kind, lr=lr, weight_decay=weight_decay, adamw_mode=False,
                               momentum=momentum, dampening=dampening, nesterov=nesterov)
    if kind == "Lamb":
        max_coeff = p.get("max_coeff", 10.0, _as_float, lo=0.0, lo_open=True)
        min_coeff = p.get("min_coeff", 0.01, _as_float, lo=0.0)
        if min_coeff > max_coeff:
            raise _fail("optimizer.params.min_coeff", min_coeff,
                        f"must not exceed optimizer.params.max_coeff = {max_coeff:g} (the trust "
                        f"ratio is clamped to [min_coeff, max_coeff])")
        return OptimizerConfig(
            type=kind, lr=lr, weight_decay=weight_decay, adamw_mode=True,
            betas=p.get("betas", (0.9, 0.999), _parse_betas),
            eps=p.get("eps", 1e-8, _as_float, lo=0.0, lo_open=True),
            bias_correction=p.get("bias_correction", True, _as_bool),
            max_coeff=max_coeff, min_coeff=min_coeff)
    if kind in ONEBIT_TYPES:
        return parse_onebit(kind, p, lr, weight_decay, _parse_betas)
    # Adam / AdamW. DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
    adam_w_mode = p.get("adam_w_mode", True, _as_bool)
    if kind == "AdamW" and not adam_w_mode:
        raise _fail("optimizer.params.adam_w_mode", False,
                    "contradicts optimizer.type 'AdamW'; for L2-regularised Adam use type 'Adam' "
                    "with adam_w_mode false")
    return OptimizerConfig(
        type=kind, lr=lr, weight_decay=weight_decay, adamw_mode=adam_w_mode,
        betas=p.get("betas", (0.9, 0.999), _parse_betas),
        eps=p.get("eps", 1e-8, _as_float, lo=0.0, lo_open=True),
        bias_correction=p.get("bias_correction", True, _as_bool),
    )


def _lr_or_list(path: str, value: Any) -> float | tuple[float, ...]:
    """A learning rate (>= 0) or one per parameter group (DeepSpeed allows a list)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise _fail(path, value, "expected a number >= 0 or a non-empty list of them "
                                     "(one per parameter group)")
        return tuple(_as_float(f"{path}[{i}]", v, lo=0.0) for i, v in enumerate(value))
    return _as_float(path, value, lo=0.0)


def _warmup_type(path: str, value: Any) -> str:
    if value not in ("log", "linear"):
        raise _fail(path, value, f"expected \"log\" or \"linear\""
                                 f"{_suggest(str(value), ('log', 'linear'))}")
    return value


def _warmup_steps(path: str, value: Any) -> int:
    # 0 is what the HF Trainer fills in for "no warmup"; DeepSpeed before 0.19.8 took it as
    # its minimum warmup of 2 steps (max(2, n)), as the schedules here do
    return _as_int(path, value, 0)


def _steps_per_print(path: str, value: Any) -> int | None:
    # Accelerate fills in float("inf") for "never"; None here
    if isinstance(value, float) and value == float("inf"):
        return None
    return _as_int(path, value, 1)


def _parse_scheduler(raw: Any) -> SchedulerConfig | None:
    if raw is None:
        return None
    s = _Section(raw, "scheduler", "scheduler")
    if not s.has("type"):
        raise ConfigError(f"config key 'scheduler.type' is missing: name the schedule, one of "
                          f"{', '.join(SCHEDULER_TYPES)}")
    kind = s.get("type", None, _canonical_type, SCHEDULER_TYPES, _SCHEDULERS_NOT_YET,
                 "LR scheduler", False)  # DeepSpeed matches schedule names exactly
    raw_params = s.raw.get("params")
    p = _Section(raw_params, "scheduler.params", f"scheduler.params:{kind}")
    params: dict[str, Any] = {
        "warmup_num_steps": p.get("warmup_num_steps", 1000, _warmup_steps),
        "warmup_type": p.get("warmup_type", "log", _warmup_type),
        "last_batch_iteration": p.get("last_batch_iteration", -1, _as_int, -1),
    }
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        if not p.has("total_num_steps"):
            raise ConfigError(f"config key 'scheduler.params.total_num_steps' is missing: "
                              f"{kind} needs the total number of optimizer steps (an integer >= 1)")
        params["total_num_steps"] = p.get("total_num_steps", None, _as_int, 1)
    if kind in ("WarmupLR", "WarmupDecayLR"):
        params["warmup_min_lr"] = p.get("warmup_min_lr", 0.0, _lr_or_list)
        # DeepSpeed: WarmupLR warms up to the optimizer's lr, WarmupDecayLR to 0.001.
        params["warmup_max_lr"] = p.get("warmup_max_lr", None if kind == "WarmupLR" else 0.001,
                                        _lr_or_list)
        lo, hi = params["warmup_min_lr"], params["warmup_max_lr"]
        if isinstance(lo, tuple) and isinstance(hi, tuple) and len(lo) != len(hi):
            raise _fail("scheduler.params.warmup_max_lr", list(hi),
                        f"has {len(hi)} entries but warmup_min_lr has {len(lo)}; both lists need "
                        f"one entry per parameter group")
    else:
        params["warmup_min_ratio"] = p.get("warmup_min_ratio", 0.0, _as_float, 0.0, 1.0)
        params["cos_min_ratio"] = p.get("cos_min_ratio", 1e-4, _as_float, 0.0, 1.0)
    return SchedulerConfig(type=kind, params=params)


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _offload_device(path: str, value: Any) -> str:
    if value not in OFFLOAD_DEVICES:
        raise _fail(path, value, f"expected one of {', '.join(map(repr, OFFLOAD_DEVICES))}"
                                 f"{_suggest(str(value), OFFLOAD_DEVICES)}")
    return value


def _parse_offload_section(s: "_Section", key: str, stage: int) -> tuple:
    sub = _Section(s.raw.get(key), f"zero_optimization.{key}", f"zero_optimization.{key}")
    device = sub.get("device", "none", _offload_device)
    path = sub.get("nvme_path", None, _optional(_as_name))
    if device == "nvme" and path is None:
        raise _fail(f"zero_optimization.{key}.nvme_path", None,
                    "device 'nvme' needs a directory for the swap files (a fast local disk, "
                    "e.g. \"/local_nvme\"); a subdirectory per rank is created there")
    return sub, device, path


def _parse_offload(s: "_Section", stage: int) -> dict:
    """offload_optimizer / offload_param / sub_group_size (zero_core/offload)."""
    sub, device, path = _parse_offload_section(s, "offload_optimizer", stage)
    if device != "none" and stage < 1:
        raise _fail("zero_optimization.offload_optimizer.device", device,
                    "offloading the optimizer needs ZeRO stage 1, 2 or 3 (it offloads the "
                    "partitioned optimizer states); set zero_optimization.stage >= 1")
    # ratio < 1: offload/partial.py; super_offload: offload/speculative.py (cpu or nvme both)
    ratio, superoff = (sub.get("ratio", 1.0, _as_float, 0.0, 1.0),
                       sub.get("super_offload", False, _as_bool))
    cores = sub.get("cpuadam_cores_perc", 0.8, _as_float, 0.0, 1.0)
    for key, bad, why in (
            ("super_offload", superoff and device == "none",
             "the speculative step is the offloaded optimizer's: set offload_optimizer.device "
             "to 'cpu' or 'nvme', or super_offload to false"),
            ("cpuadam_cores_perc", superoff and cores == 0.0,
             "super_offload's worker thread needs a share of the cores in (0, 1]")):
        if bad:
            raise _fail(f"zero_optimization.offload_optimizer.{key}", sub.raw[key], why)
    opt = OffloadOptimizerConfig(
        device=device, nvme_path=path, pin_memory=sub.get("pin_memory", False, _as_bool),
        buffer_count=sub.get("buffer_count", 4, _as_int, 3),
        ratio=ratio, super_offload=superoff, cpuadam_cores_perc=cores)
    sub, device, path = _parse_offload_section(s, "offload_param", stage)
    if device != "none" and stage != 3:
        # DeepSpeed reads offload_param only at stage 3 and ignores it below: so do we, aloud
        warnings.warn(f"config key 'zero_optimization.offload_param.device' = {device!r} has "
                      f"no effect at ZeRO stage {stage} (parameters are partitioned, and so "
                      f"offloadable, only at stage 3); ignored, as DeepSpeed ignores it",
                      ConfigWarning, stacklevel=4)
        device, path = "none", None
    param = OffloadParamConfig(
        device=device, nvme_path=path, pin_memory=sub.get("pin_memory", False, _as_bool),
        buffer_count=sub.get("buffer_count", 5, _as_int, 2),
        buffer_size=sub.get("buffer_size", 100_000_000, _as_int, 1),
        max_in_cpu=sub.get("max_in_cpu", 1_000_000_000, _as_int, 0))
    return {"offload_optimizer": opt, "offload_param": param,
            # 0 is DeepSpeed's "as small as possible" (a sub-group per parameter there, the
            # smallest aligned sub-group here)
            "sub_group_size": max(1, s.get("sub_group_size", 1_000_000_000, _as_int, 0))}


def _parse_zero(raw: Any, world_size: int = 1) -> ZeroConfig:
    s = _Section(raw, "zero_optimization", "zero_optimization")
    if s.has("stage"):
        stage = s.get("stage", 0, _as_int)
        if not 0 <= stage <= MAX_ZERO_STAGE:
            raise _fail("zero_optimization.stage", stage,
                        f"expected 0, 1, 2 or 3 (0 = DDP, 1 = optimizer states partitioned, "
                        f"2 = + gradients partitioned, 3 = + parameters partitioned)")
    else:
        stage = 0

    def stage3(names, default, conv, *bounds):
        given = [n for n in names if s.has(n)]
        if len(given) > 1:
            raise _fail(f"zero_optimization.{given[1]}", s.raw[given[1]],
                        f"also given as zero_optimization.{given[0]}; keep one spelling")
        return s.get(given[0], default, conv, *bounds) if given else default

    zeropp = parse_zeropp(s, stage, world_size)
    many_nodes = parse_many_nodes(s, stage, world_size, zeropp)
    offload = _parse_offload(s, stage)
    return ZeroConfig(
        stage=stage,
        reduce_bucket_size=s.get("reduce_bucket_size", 5_000_000, _as_int, 1),
        overlap_comm=s.get("overlap_comm", True, _as_bool),
        reduce_scatter=s.get("reduce_scatter", True, _as_bool),
        stage3_prefetch_bucket_size=stage3(
            ("stage3_prefetch_bucket_size", "prefetch_bucket_size"), 50_000_000, _as_int, 0),
        stage3_param_persistence_threshold=stage3(
            ("stage3_param_persistence_threshold", "param_persistence_threshold"), 100_000,
            _as_int, 0),
        stage3_max_live_parameters=stage3(
            ("stage3_max_live_parameters", "max_live_parameters"), 1_000_000_000, _as_int, 0),
        stage3_max_reuse_distance=stage3(
            ("stage3_max_reuse_distance", "max_reuse_distance"), 1_000_000_000, _as_int, 0),
        stage3_gather_16bit_weights_on_model_save=stage3(
            ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
             "stage3_gather_fp16_weights_on_model_save"), False, _as_bool),
        **zeropp,
        **many_nodes,
        **offload,
        zenflow=parse_zenflow(s, offload["offload_optimizer"]),
    )


_TAG_VALIDATION = ("WARN", "IGNORE", "FAIL")


def _tag_validation(path: str, value: Any) -> str:
    mode = _as_name(path, value).upper()  # DeepSpeed upper-cases it too
    if mode not in _TAG_VALIDATION:
        raise _fail(path, value, f"expected \"Warn\", \"Ignore\" or \"Fail\""
                                 f"{_suggest(mode, _TAG_VALIDATION)}")
    return mode


RESUME_MODES = ("auto", "require", "never")
RESUME_BATCH = ("keep_global", "keep_micro")


def _choice(options):
    """A converter of a name that must be one of *options* (any case)."""
    def convert(path: str, value: Any) -> str:
        word = _as_name(path, value).lower()
        if word not in options:
            raise _fail(path, value, f"expected one of {', '.join(map(repr, options))}"
                                     f"{_suggest(word, options)}")
        return word
    return convert


def _parse_checkpoint(raw: Any) -> CheckpointConfig:
    s = _Section(raw, "checkpoint", "checkpoint")
    cfg = CheckpointConfig(
        tag_validation=s.get("tag_validation", "WARN", _tag_validation),
        save_dir=s.get("save_dir", None, _optional(_as_name)),
        save_interval_steps=s.get("save_interval_steps", None, _optional(_as_int), 1),
        save_interval_minutes=s.get("save_interval_minutes", None, _optional(_as_float), 0.0,
                                    None, True),
        async_save=s.get("async_save", False, _as_bool),
        keep_last=s.get("keep_last", None, _optional(_as_int), 1),
        resume=s.get("resume", "auto", _choice(RESUME_MODES)),
        resume_batch=s.get("resume_batch", "keep_global", _choice(RESUME_BATCH)))
    periodic = cfg.save_interval_steps is not None or cfg.save_interval_minutes is not None
    if periodic and cfg.save_dir is None:
        raise _fail("checkpoint.save_dir", None, "save_interval_steps / save_interval_minutes "
                    "save periodically into checkpoint.save_dir: give the directory")
    if cfg.resume == "require" and cfg.save_dir is None:
        raise _fail("checkpoint.save_dir", None, "resume \"require\" resumes from "
                    "checkpoint.save_dir: give the directory")
    return cfg


def _parse_safety(raw: Any, precision: str, bf16: BF16Config) -> SafetyConfig:
    """zero-core's ``safety`` section; its non-finite action must agree with the precision
    sections (fp16's loss scaler owns overflows; bf16 ``check_grad_overflow: false`` is
    DeepSpeed's way of saying "ignore")."""
    s = _Section(raw, "safety", "safety")
    given = "nonfinite_gradients" in s.raw
    action = s.get("nonfinite_gradients", "skip", _choice(NONFINITE_ACTIONS))
    if precision == "bf16" and not bf16.check_grad_overflow:
        if given and action != "ignore":
            raise _fail("safety.nonfinite_gradients", action,
                        "contradicts bf16.check_grad_overflow: false (which applies steps with "
                        "inf/NaN gradients); drop one of the two")
        action = "ignore"
    if precision == "fp16" and given and action != "skip":
        raise _fail("safety.nonfinite_gradients", action,
                    "fp16 training skips overflowing steps through its loss scaler (and "
                    "raises at fp16.min_loss_scale); this key applies to fp32 and bf16 only — "
                    "remove it or use \"skip\"")
    return SafetyConfig(
        nonfinite_gradients=action,
        max_consecutive_skips=s.get("max_consecutive_skips", 10, _as_int, 0),
        check_ranks_agree=s.get("check_ranks_agree", True, _as_bool),
        check_batch_sizes=s.get("check_batch_sizes", True, _as_bool),
        launcher_notice=s.get("launcher_notice", True, _as_bool))


def _parse_topology(raw: Any, world_size: int) -> TopologyConfig:
    s = _Section(raw, "topology", "topology")
    rpn = s.get("ranks_per_node", None, _optional(_as_int), 1)
    if rpn is not None:
        _require_divisor("topology.ranks_per_node", rpn, world_size,
                         ", or null for what the launcher reports")
    return TopologyConfig(ranks_per_node=rpn)


def _parse_generation(raw: Any) -> GenerationConfig:
    s = _Section(raw, "generation", "generation")
    return GenerationConfig(
        max_live_parameters=s.get("max_live_parameters", None, _optional(_as_int), 0))


def _parse_hybrid_engine(raw: Any) -> HybridEngineConfig:
    """DeepSpeed's ``hybrid_engine``: DeepSpeed-Chat writes the whole section with
    ``"enabled": false``, which is accepted whatever the other values (they are not read; the
    key names are checked); enabled, every key is validated and tensor parallelism refused."""
    s = _Section(raw, "hybrid_engine", "hybrid_engine")
    cfg = HybridEngineConfig(
        enabled=s.get("enabled", False, _as_bool),
        max_out_tokens=s.get("max_out_tokens", 512, _as_int, 1),
        inference_tp_size=s.get("inference_tp_size", 1, _as_int, 1),
        release_inference_cache=s.get("release_inference_cache", False, _as_bool),
        pin_parameters=s.get("pin_parameters", True, _as_bool))
    if cfg.enabled and cfg.inference_tp_size > 1:
        raise _fail("hybrid_engine.inference_tp_size", cfg.inference_tp_size,
                    "tensor parallelism for generation is not implemented in zero-core (it is "
                    "data parallel only); set it to 1: generation then runs data parallel on "
                    "the ZeRO-partitioned model")
    return cfg


def parse_activation_checkpointing(raw: Any) -> ActivationCheckpointingConfig:
    """Validate DeepSpeed's ``activation_checkpointing`` section on its own (a dict or
    None); :func:`parse_config` calls it for the whole config."""
    s = _Section(raw, "activation_checkpointing", "activation_checkpointing")
    cfg = ActivationCheckpointingConfig(
        partition_activations=s.get("partition_activations", False, _as_bool),
        cpu_checkpointing=s.get("cpu_checkpointing", False, _as_bool),
        contiguous_memory_optimization=s.get("contiguous_memory_optimization", False, _as_bool),
        number_checkpoints=s.get("number_checkpoints", None, _optional(_as_int), 1),
        synchronize_checkpoint_boundary=s.get("synchronize_checkpoint_boundary", False, _as_bool),
        profile=s.get("profile", False, _as_bool),
    )
    if cfg.contiguous_memory_optimization and cfg.number_checkpoints is None:
        # the buffers are preallocated per checkpoint, so their count must be known
        raise _fail("activation_checkpointing.number_checkpoints", None,
                    "contiguous_memory_optimization needs the number of checkpointed calls per "
                    "forward pass (an integer >= 1, e.g. the number of checkpointed layers)")
    return cfg


def _resolve_batch(s: _Section, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro batch per rank, accumulation steps) from any two of them."""
    tb = s.get("train_batch_size", None, _optional(_as_int), 1)
    mb = s.get("train_micro_batch_size_per_gpu", None, _optional(_as_int), 1)
    ga = s.get("gradient_accumulation_steps", None, _optional(_as_int), 1)
    ws = world_size

    def not_divisible(what_path, what, by_text, by):
        lower, upper = (what // by) * by, (what // by + 1) * by
        options = " or ".join(str(v) for v in (lower, upper) if v > 0)
        return _fail(what_path, what, f"must be divisible by {by_text} = {by} so that "
                                      f"train_batch_size = train_micro_batch_size_per_gpu × "
                                      f"gradient_accumulation_steps × world_size holds; "
                                      f"try {options}")

    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * ws:
            raise _fail("train_batch_size", tb,
                        f"must equal train_micro_batch_size_per_gpu × gradient_accumulation_steps "
                        f"× world_size = {mb} × {ga} × {ws} = {mb * ga * ws}; give only two of "
                        f"the three to have the third derived")
    elif tb is not None and mb is not None:
        if tb % (mb * ws):
            raise not_divisible("train_batch_size", tb,
                                f"train_micro_batch_size_per_gpu × world_size = {mb} × {ws}",
                                mb * ws)
        ga = tb // (mb * ws)
    elif tb is not None:
        ga = 1 if ga is None else ga
        if tb % (ga * ws):
            raise not_divisible("train_batch_size", tb,
                                f"gradient_accumulation_steps × world_size = {ga} × {ws}",
                                ga * ws)
        mb = tb // (ga * ws)
    else:
        mb = 1 if mb is None else mb
        ga = 1 if ga is None else ga
        tb = mb * ga * ws
    return tb, mb, ga


# ---------------------------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------------------------

def read_config(config: Any) -> dict:
    """The raw config as a private dict (a deep copy): *config* is a dict, a path to a JSON
    file, a JSON string or None ({}). What the framework integrations read before folding
    their own settings in; ``parse_config`` validates it."""
    return copy.deepcopy(dict(_load(config)))


def _load(config: Any) -> Mapping:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, os.PathLike)):
        text = os.fspath(config)
        if isinstance(text, str) and text.lstrip().startswith("{") and not os.path.exists(text):
            source, name = text, "<config string>"
        else:
            try:
                with open(text, encoding="utf-8") as f:
                    source, name = f.read(), text
            except OSError as exc:
                raise ConfigError(f"cannot read the config file {text!r}: {exc.strerror}; pass a "
                                  f"path to a JSON file, a dict or None") from None
        try:
            data = json.loads(source)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"the config {name} is not valid JSON: {exc.msg} at line "
                              f"{exc.lineno}, column {exc.colno}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"the config {name} must hold a JSON object at the top level, not "
                              f"{type(data).__name__}")
        return data
    raise ConfigError(f"config must be a dict, a path to a JSON file, a Config or None, not "
                      f"{type(config).__name__}")


def parse_config(config: Any = None, world_size: int = 1) -> Config:
    """Validate *config* once and return a frozen :class:`Config`.

    *config* is a dict, a path (str or PathLike) to a JSON file, JSON text itself (a string
    starting with "{"), an existing Config (returned as is when it was resolved for the same
    world size) or None (all defaults).
    *world_size* is the number of data-parallel ranks the batch sizes are resolved against.
    Raises ConfigError naming the key, the value and what would be valid.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r}: expected an integer >= 1 (the number of "
                          f"data-parallel ranks)")
    if isinstance(config, Config):
        if config.world_size != world_size:
            raise ConfigError(
                f"this Config was resolved for world size {config.world_size} "
                f"(train_batch_size={config.train_batch_size}), not {world_size}; parse the "
                f"original dict or file again for the new world size")
        return config

    top = _Section(_load(config), "", "")
    dtypes = parse_precision(top, world_size)
    # an enabled "elasticity" section computes the triple (one global batch for every valid
    # world size); otherwise it comes from any two of the three keys
    tb, mb, ga = elastic_batch(top, world_size) or _resolve_batch(top, world_size)
    return Config(
        train_batch_size=tb,
        train_micro_batch_size_per_gpu=mb,
        gradient_accumulation_steps=ga,
        gradient_clipping=top.get("gradient_clipping", 1.0, _as_float, lo=0.0),
        optimizer=_parse_optimizer(top.raw.get("optimizer")),
        scheduler=_parse_scheduler(top.raw.get("scheduler")),
        zero_optimization=_parse_zero(top.raw.get("zero_optimization"), world_size),
        steps_per_print=top.get("steps_per_print", 10, _steps_per_print),
        wall_clock_breakdown=top.get("wall_clock_breakdown", False, _as_bool),
        accelerator=top.get("accelerator", None, _optional(_as_name)),
        comm_backend=top.get("comm_backend", None, _optional(_as_name)),
        comm_timeout=top.get("comm_timeout", None, _optional(_as_float), lo=0.0, lo_open=True),
        topology=_parse_topology(top.raw.get("topology"), world_size),
        activation_checkpointing=parse_activation_checkpointing(
            top.raw.get("activation_checkpointing")),
        checkpoint=_parse_checkpoint(top.raw.get("checkpoint")),
        monitor=parse_monitors(top.raw),
        safety=_parse_safety(top.raw.get("safety"),
                             "fp16" if dtypes["fp16"].enabled else
                             "bf16" if dtypes["bf16"].enabled else "fp32", dtypes["bf16"]),
        generation=_parse_generation(top.raw.get("generation")),
        hybrid_engine=_parse_hybrid_engine(top.raw.get("hybrid_engine")),
        flops_profiler=parse_flops_profiler(top.raw.get("flops_profiler")),
        world_size=world_size,
        **dtypes,
    )
