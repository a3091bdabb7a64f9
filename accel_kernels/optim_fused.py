"""Torch's own fused optimizer ops with the kernel signatures of :mod:`.optim_reference`.

The one wrapper of ``torch._fused_adam_`` / ``torch._fused_adamw_`` / ``torch._fused_sgd_``
in zero-core: the ``cpu`` kernel set calls it through :mod:`.optim_cpu`, the ``cuda`` and
``xpu`` kernel sets directly. Each op reads and writes every buffer once per step, on any
device that has a kernel for it (CPU, CUDA, XPU).

Step count: the ops read it from a one-element float32 tensor on the parameters' device
(the CUDA kernels reinterpret its memory as ``float``, the CPU kernel reads it with
``item<float>()``), so that is what is passed. It is made with ``torch.full`` (a fill on the device), not
``torch.tensor`` (a host-to-device copy, which on CUDA waits for the stream).

``found_inf`` (a 0-dim float32 tensor on the device, 1.0: skip) goes to the fused op, which
then leaves every tensor as it was: the engine's skip decision never travels to the host.

``bias_correction=False`` is expressed through that step tensor: with step = +inf,
beta**step is exactly 0 in IEEE arithmetic (for 0 <= beta < 1), so both corrections
1 - beta**step are exactly 1 and the fused kernel computes the uncorrected update — the
DeepSpeed meaning of ``bias_correction=False``, checked against the float64 formula in
tests/test_optim_kernels.py for both settings (on CPU tensors; the CUDA kernels compute
the corrections with the same ``1 - pow(beta, step)`` and have not been run here).
"""
from __future__ import annotations

import math

import torch

from .optim_checks import check_adam_args, check_sgd_args


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, step: int, adamw: bool,
              bias_correction: bool = True,
              param_lowp: torch.Tensor | None = None,
              found_inf: torch.Tensor | None = None) -> None:
    """One Adam (adamw=False, L2) or AdamW (adamw=True, decoupled decay) step, in place.

    Same contract as :func:`zero_core.accel_kernels.optim_reference.adam_step`: flat
    contiguous fp32 tensors of one size on one device, *grad* only read, *step* the
    1-based count after this update, *lr* in parameter units per step, optional bf16/fp16
    *param_lowp* written rounded (nearest even) right after the step; *found_inf* 1.0:
    nothing changes (module docstring).
    """
    check_adam_args(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, weight_decay=weight_decay, step=step, param_lowp=param_lowp)
    if param.numel() == 0:
        return
    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    # +inf turns both bias corrections into exactly 1 (module docstring)
    step_t = torch.full((), float(step) if bias_correction else math.inf, dtype=torch.float32,
                        device=param.device)
    fused([param], [grad], [exp_avg], [exp_avg_sq], [], [step_t], lr=float(lr),
          beta1=float(beta1), beta2=float(beta2), weight_decay=float(weight_decay),
          eps=float(eps), amsgrad=False, maximize=False, found_inf=found_inf)
    if param_lowp is not None:
        param_lowp.copy_(param)


def sgd_step(param: torch.Tensor, grad: torch.Tensor,
             momentum_buffer: torch.Tensor | None, *, lr: float, momentum: float,
             dampening: float, weight_decay: float, nesterov: bool, first_step: bool,
             param_lowp: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None) -> None:
    """One SGD step with torch.optim.SGD semantics, in place.

    Same contract as :func:`zero_core.accel_kernels.optim_reference.sgd_step`;
    *momentum_buffer* is ignored (and may be None) when momentum == 0; *found_inf* as in
    :func:`adam_step`.
    """
    check_sgd_args(param, grad, momentum_buffer, lr=lr, momentum=momentum,
                   dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                   param_lowp=param_lowp)
    if param.numel() == 0:
        return
    torch._fused_sgd_([param], [grad], [] if momentum == 0 else [momentum_buffer],
                      weight_decay=float(weight_decay), momentum=float(momentum),
                      lr=float(lr), dampening=float(dampening), nesterov=bool(nesterov),
                      maximize=False, is_first_step=bool(first_step), found_inf=found_inf)
    if param_lowp is not None:
        param_lowp.copy_(param)
