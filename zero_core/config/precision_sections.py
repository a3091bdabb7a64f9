"""Parsing of the config sections that decide dtypes: ``fp16``, ``bf16``, ``torch_autocast``,
``data_types`` and the gradient-communication keys (``communication_data_type``,
``prescale_gradients``, ``gradient_predivide_factor``), with DeepSpeed's meanings and its
rules for which combinations are valid (read from DeepSpeed 0.19.8's config and engine).
:func:`zero_core.config.parser.parse_config` calls :func:`parse_precision` once.
"""
from __future__ import annotations

from typing import Any

from zero_core.config.checks import (_as_bool, _as_float, _as_int, _as_name, _fail, _optional,
                                     _Section, _suggest)
from zero_core.config.precision import DTYPE_NAMES
from zero_core.config.schema import BF16Config, FP16Config, TorchAutocastConfig
from zero_core.errors import ConfigError

__all__ = ["parse_precision"]


def _dtype_name(path: str, value: Any) -> str:
    """One of DeepSpeed's dtype spellings ("fp32", "float32", "bf16", "bfloat16", ...) as
    "fp32" / "fp16" / "bf16"."""
    name = _as_name(path, value)
    short = DTYPE_NAMES.get(name.lower())
    if short is None:
        raise _fail(path, value, f"expected one of \"fp32\", \"fp16\", \"bf16\" (or DeepSpeed's "
                                 f"long spellings){_suggest(name, DTYPE_NAMES)}")
    return short


def _parse_fp16(raw: Any) -> FP16Config:
    s = _Section(raw, "fp16", "fp16")
    cfg = FP16Config(
        enabled=s.get("enabled", False, _as_bool),
        loss_scale=s.get("loss_scale", 0.0, _as_float, lo=0.0),
        initial_scale_power=s.get("initial_scale_power", 16, _as_int, 0, 64),
        loss_scale_window=s.get("loss_scale_window", 1000, _as_int, 1),
        hysteresis=s.get("hysteresis", 2, _as_int, 1),
        min_loss_scale=s.get("min_loss_scale", 1.0, _as_float, lo=0.0, lo_open=True),
        consecutive_hysteresis=s.get("consecutive_hysteresis", False, _as_bool),
        auto_cast=s.get("auto_cast", False, _as_bool),
    )
    if cfg.enabled and cfg.dynamic and cfg.initial_scale < cfg.min_loss_scale:
        raise _fail("fp16.initial_scale_power", cfg.initial_scale_power,
                    f"the initial loss scale 2**{cfg.initial_scale_power} = {cfg.initial_scale:g} "
                    f"is below fp16.min_loss_scale = {cfg.min_loss_scale:g}; raise "
                    f"initial_scale_power or lower min_loss_scale")
    return cfg


def _parse_bf16(raw: Any, path: str) -> BF16Config:
    s = _Section(raw, path, "bf16")
    cfg = BF16Config(
        enabled=s.get("enabled", False, _as_bool),
        bf16_master_weights_and_grads=s.get("bf16_master_weights_and_grads", False, _as_bool),
        bf16_optimizer_states=s.get("bf16_optimizer_states", False, _as_bool),
        check_grad_overflow=s.get("check_grad_overflow", True, _as_bool),
    )
    if cfg.bf16_optimizer_states and not cfg.bf16_master_weights_and_grads:
        # DeepSpeed's rule: bf16 states only beside bf16 master weights
        raise _fail(f"{path}.bf16_optimizer_states", True,
                    f"needs {path}.bf16_master_weights_and_grads true as well (bf16 optimizer "
                    f"states beside fp32 master weights is not a DeepSpeed mode)")
    if cfg.bf16_master_weights_and_grads and not cfg.enabled:
        raise _fail(f"{path}.bf16_master_weights_and_grads", True,
                    f"only applies to bf16 training; set {path}.enabled true or remove the key")
    return cfg


def _parse_autocast(raw: Any) -> TorchAutocastConfig:
    s = _Section(raw, "torch_autocast", "torch_autocast")
    modules = s.get("lower_precision_safe_modules", None, _optional(_class_paths))
    return TorchAutocastConfig(enabled=s.get("enabled", False, _as_bool),
                               dtype=s.get("dtype", None, _optional(_dtype_name)),
                               lower_precision_safe_modules=modules)


def _class_paths(path: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, str) and "." in v for v in value):
        raise _fail(path, value, "expected a list of class paths such as "
                                 "[\"torch.nn.Linear\", \"my_model.MyLinear\"]")
    return tuple(value)


def parse_precision(top: _Section, world_size: int) -> dict:
    """The dtype-related fields of :class:`~zero_core.config.schema.Config`, from the
    top-level section *top*."""
    if top.has("bf16") and top.has("bfloat16"):
        raise ConfigError("config keys 'bf16' and 'bfloat16' are both given; they are two "
                          "spellings of the same section, keep one ('bf16')")
    fp16 = _parse_fp16(top.raw.get("fp16"))
    bf16_key = "bfloat16" if top.has("bfloat16") else "bf16"
    bf16 = _parse_bf16(top.raw.get(bf16_key), bf16_key)
    if fp16.enabled and bf16.enabled:
        raise _fail(f"{bf16_key}.enabled", True, "fp16 and bf16 cannot both be enabled; pick one "
                                                 "(bf16 needs no loss scaling)")
    precision = "fp16" if fp16.enabled else "bf16" if bf16.enabled else "fp32"
    autocast = _parse_autocast(top.raw.get("torch_autocast"))
    if autocast.enabled and precision == "fp16":
        # DeepSpeed runs this pair with a torch GradScaler beside its own loss scaler at
        # ZeRO stages 1-3; zero-core has no such double scaling
        raise _fail("torch_autocast.enabled", True,
                    "with fp16.enabled is not supported (DeepSpeed would scale the loss with a "
                    "torch GradScaler beside fp16's loss scaler). Use bf16.enabled with "
                    "torch_autocast.dtype \"bf16\", torch_autocast alone, or fp16 alone")
    if autocast.enabled and precision == "bf16" and autocast.dtype not in (None, "bf16"):
        raise _fail("torch_autocast.dtype", autocast.dtype,
                    f"with {bf16_key}.enabled the parameters are bf16; autocasting them to "
                    f"{autocast.dtype} per operation is not a DeepSpeed mode that trains "
                    f"(it would need a GradScaler). Set torch_autocast.dtype to \"bf16\"")
    if fp16.auto_cast and not fp16.enabled:
        raise _fail("fp16.auto_cast", True, "casts inputs to fp16 for fp16 training; set "
                                            "fp16.enabled true or remove auto_cast")

    types = _Section(top.raw.get("data_types"), "data_types", "data_types")
    accum = types.get("grad_accum_dtype", None, _optional(_dtype_name))
    param_dtype = types.get("param_dtype", None, _optional(_dtype_name))
    if param_dtype is not None and param_dtype != precision:
        raise _fail("data_types.param_dtype", param_dtype,
                    f"must match the enabled mode ({precision}: fp16.enabled / bf16.enabled); "
                    f"DeepSpeed requires the same")
    if accum is not None and accum != precision:
        if precision == "fp32" or accum != "fp32":
            raise _fail("data_types.grad_accum_dtype", accum,
                        f"with {precision} training the gradients accumulate in {precision} or "
                        f"(bf16/fp16 only) in fp32; DeepSpeed accepts no other mix either")
    comm = top.get("communication_data_type", None, _optional(_dtype_name))
    predivide = top.get("gradient_predivide_factor", 1.0, _as_float, lo=0.0, lo_open=True)
    return {"fp16": fp16, "bf16": bf16, "torch_autocast": autocast,
            "grad_accum_dtype": accum, "communication_data_type": comm,
            "prescale_gradients": top.get("prescale_gradients", False, _as_bool),
            "gradient_predivide_factor": predivide}
