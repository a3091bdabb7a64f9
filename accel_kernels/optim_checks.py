"""Argument checks shared by every optimizer kernel (reference, CPU, device targets).

The kernels update flat buffers in place, so a wrong shape or dtype would either raise
deep inside torch with a message about broadcasting, or silently write through a
temporary copy. These checks fail first, with a message that names the argument and
says what to pass instead. Only torch is imported: this package knows nothing of ZeRO.
"""
from __future__ import annotations

import math

import torch

#: dtypes accepted for the optional low-precision copy of the parameters
LOWP_DTYPES = (torch.bfloat16, torch.float16)


def check_flat_fp32(name: str, t, ref: torch.Tensor | None = None) -> None:
    """Require *t* to be a 1-D contiguous float32 tensor (same size/device as *ref*)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}; "
                        "pass the flat fp32 buffer itself")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} has dtype {t.dtype}, the optimizer kernels need float32; "
                        f"keep master weights and optimizer states in fp32 "
                        f"(e.g. {name}.float() before building the buffer)")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be flat and contiguous (1-D), got shape "
                         f"{tuple(t.shape)} contiguous={t.is_contiguous()}; "
                         f"pass {name}.view(-1) of a contiguous buffer")
    if ref is not None:
        if t.numel() != ref.numel():
            raise ValueError(f"{name} has {t.numel()} elements but param has {ref.numel()}; "
                             "every buffer of one step must cover the same partition")
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but param is on {ref.device}; "
                             "move every buffer of one step to the same device")


def check_lowp(param_lowp, param: torch.Tensor) -> None:
    """Require the optional low-precision copy to be a flat bf16/fp16 twin of *param*."""
    if param_lowp is None:
        return
    if not isinstance(param_lowp, torch.Tensor):
        raise TypeError(f"param_lowp must be a torch.Tensor or None, got "
                        f"{type(param_lowp).__name__}")
    if param_lowp.dtype not in LOWP_DTYPES:
        raise TypeError(f"param_lowp has dtype {param_lowp.dtype}; it must be torch.bfloat16 "
                        "or torch.float16 (pass None to skip the low-precision copy)")
    if param_lowp.dim() != 1 or not param_lowp.is_contiguous():
        raise ValueError(f"param_lowp must be flat and contiguous (1-D), got shape "
                         f"{tuple(param_lowp.shape)}")
    if param_lowp.numel() != param.numel():
        raise ValueError(f"param_lowp has {param_lowp.numel()} elements but param has "
                         f"{param.numel()}; it must mirror the same partition")
    if param_lowp.device != param.device:
        raise ValueError(f"param_lowp is on {param_lowp.device} but param is on "
                         f"{param.device}; keep both on the same device")


def check_adam_args(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps,
                    weight_decay, step, param_lowp) -> None:
    """Validate every argument of ``adam_step`` (see zero_core/kernels.py)."""
    check_flat_fp32("param", param)
    check_flat_fp32("grad", grad, param)
    check_flat_fp32("exp_avg", exp_avg, param)
    check_flat_fp32("exp_avg_sq", exp_avg_sq, param)
    check_lowp(param_lowp, param)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be the 1-based int step count after this update "
                         f"(1 on the first step), got {step!r}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= float(value) < 1.0:
            raise ValueError(f"{name}={value!r} is outside [0, 1); Adam's betas are decay "
                             "rates such as 0.9 and 0.999")
    if not float(eps) > 0.0:
        raise ValueError(f"eps={eps!r} must be > 0 (e.g. 1e-8): it keeps the update finite "
                         "where exp_avg_sq is zero")
    _check_finite_nonneg("lr", lr)
    _check_finite_nonneg("weight_decay", weight_decay)


def check_sgd_args(param, grad, momentum_buffer, *, lr, momentum, dampening,
                   weight_decay, nesterov, param_lowp) -> None:
    """Validate every argument of ``sgd_step`` (torch.optim.SGD's rules)."""
    check_flat_fp32("param", param)
    check_flat_fp32("grad", grad, param)
    check_lowp(param_lowp, param)
    _check_finite_nonneg("lr", lr)
    _check_finite_nonneg("momentum", momentum)
    _check_finite_nonneg("weight_decay", weight_decay)
    if not math.isfinite(float(dampening)):
        raise ValueError(f"dampening={dampening!r} must be a finite number (usually 0)")
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError(f"momentum={momentum} needs a momentum_buffer (a flat fp32 "
                             "tensor the size of param); pass one, or set momentum=0")
        check_flat_fp32("momentum_buffer", momentum_buffer, param)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"nesterov=True needs momentum > 0 and dampening == 0 (as in "
                         f"torch.optim.SGD), got momentum={momentum}, dampening={dampening}")


def _check_finite_nonneg(name: str, value) -> None:
    v = float(value)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name}={value!r} must be a finite number >= 0")
