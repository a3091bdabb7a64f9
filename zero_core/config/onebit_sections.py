"""The 1-bit optimizers' ``optimizer.params`` (DeepSpeed's OnebitAdam, ZeroOneAdam and
OnebitLamb: key names and defaults), for parser.py's optimizer section; the optimizers are
zero_core/optim/onebit.py."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from zero_core.config.checks import (_as_bool, _as_float, _as_int, _as_name, _fail, _Section,
                                     _suggest)
from zero_core.config.schema import OptimizerConfig
from zero_core.errors import ConfigWarning


ONEBIT_COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed")
ONEBIT_TYPES = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")


def _onebit_lamb_params(p: _Section) -> dict:
    """OnebitLamb's coefficient keys (DeepSpeed's names and defaults)."""
    out = dict(max_coeff=p.get("max_coeff", 10.0, _as_float, lo=0.0, lo_open=True),
               min_coeff=p.get("min_coeff", 0.01, _as_float, lo=0.0),
               coeff_beta=p.get("coeff_beta", 0.9, _as_float, 0.0, 1.0, hi_open=True),
               factor_max=p.get("factor_max", 4.0, _as_float, lo=0.0, lo_open=True),
               factor_min=p.get("factor_min", 0.5, _as_float, lo=0.0),
               factor_threshold=p.get("factor_threshold", 0.1, _as_float, lo=0.0))
    for low, high in (("min_coeff", "max_coeff"), ("factor_min", "factor_max")):
        if out[low] > out[high]:
            raise _fail(f"optimizer.params.{low}", out[low],
                        f"must not exceed optimizer.params.{high} = {out[high]:g}")
    return out


def drop_onebit_unused(raw: Any, kind: str) -> Any:
    """A 1-bit optimizer's params without ``bias_correction``, which DeepSpeed's OnebitAdam
    and ZeroOneAdam take and never read (their update uses the raw moments): dropped with a
    warning saying so."""
    if not isinstance(raw, Mapping) or "bias_correction" not in raw:
        return raw
    warnings.warn(f"config key 'optimizer.params.bias_correction' is ignored for {kind}, as "
                  f"DeepSpeed's {kind} ignores it (its update uses the raw moments, without "
                  f"bias correction); remove the key", ConfigWarning, stacklevel=3)
    return {k: v for k, v in raw.items() if k != "bias_correction"}


def parse_onebit(kind: str, p: _Section, lr: float, weight_decay: float,
                 parse_betas) -> OptimizerConfig:
    """DeepSpeed's OnebitAdam / ZeroOneAdam / OnebitLamb parameters (optim/onebit.py)."""
    def backend(path, value):
        name = _as_name(path, value)
        if name not in ONEBIT_COMM_BACKENDS:
            raise _fail(path, value, f"expected one of {', '.join(ONEBIT_COMM_BACKENDS)}"
                                     f"{_suggest(name, ONEBIT_COMM_BACKENDS)}")
        return name
    if p.get("cuda_aware", False, _as_bool):
        raise _fail("optimizer.params.cuda_aware", True,
                    "zero-core's communicators decide themselves which memory they reach and "
                    "stage the rest through host buffers (interfaces/staging.py); remove the key "
                    "or set it to false")
    zero_one = {} if kind != "ZeroOneAdam" else dict(
        var_freeze_step=p.get("var_freeze_step", 100000, _as_int, 0),
        var_update_scaler=p.get("var_update_scaler", 16, _as_int, 1),
        local_step_scaler=p.get("local_step_scaler", 32678, _as_int, 1),
        local_step_clipper=p.get("local_step_clipper", 16, _as_int, 1))
    one_bit = {} if kind == "ZeroOneAdam" else dict(
        freeze_step=p.get("freeze_step", 100000, _as_int, 0))
    lamb = {} if kind != "OneBitLamb" else _onebit_lamb_params(p)
    return OptimizerConfig(
        type=kind, lr=lr, weight_decay=weight_decay, adamw_mode=True, **zero_one, **one_bit,
        **lamb,
        betas=p.get("betas", (0.9, 0.999), parse_betas),
        eps=p.get("eps", 1e-8, _as_float, lo=0.0, lo_open=True),
        bias_correction=False,   # the raw moments (drop_onebit_unused)
        comm_backend_name=p.get("comm_backend_name", None, backend))
