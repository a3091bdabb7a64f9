"""Pure-torch optimizer kernels: the readable definition every faster target must match.

Both functions update flat, contiguous fp32 buffers in place and follow the signatures
in ``zero_core/kernels.py``. They run on any device torch supports (so they are also the
fallback for targets without a fused kernel), favour clarity over speed, and never
modify *grad*.

Adam (torch.optim.Adam / AdamW semantics, step count t >= 1):

    adamw=False:  g <- g + wd * p                     (L2 folded into the gradient)
    adamw=True:   p <- p * (1 - lr * wd)              (decoupled decay, before the update)
    m <- b1 m + (1 - b1) g
    v <- b2 v + (1 - b2) g^2
    bc1 = 1 - b1^t,  bc2 = 1 - b2^t        (both 1 when bias_correction=False)
    p <- p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

SGD (torch.optim.SGD semantics):

    g <- g + wd * p
    momentum != 0:  buf <- g on the first step, else buf <- mu buf + (1 - dampening) g
                    g <- g + mu buf if nesterov else buf
    p <- p - lr g
"""
from __future__ import annotations

import math

import torch

from .optim_checks import check_adam_args, check_sgd_args


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, step: int, adamw: bool,
              bias_correction: bool = True,
              param_lowp: torch.Tensor | None = None) -> None:
    """One Adam (adamw=False) or AdamW (adamw=True) step, in place.

    All tensors are flat, contiguous float32 of equal size; *grad* is only read.
    *lr* is the learning rate (parameter units per step), *step* the 1-based step count
    after this update. If *param_lowp* (bf16/fp16) is given it receives the updated
    parameter rounded to its dtype (round to nearest even).
    """
    check_adam_args(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, weight_decay=weight_decay, step=step, param_lowp=param_lowp)
    if weight_decay != 0 and not adamw:
        grad = grad.add(param, alpha=weight_decay)  # a new tensor: the caller's grad stays
    if weight_decay != 0 and adamw:
        param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)  # b1 m + (1 - b1) g, as torch.optim.Adam writes it
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    if bias_correction:
        bc1 = 1.0 - beta1 ** step
        bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    else:
        bc1 = bc2_sqrt = 1.0
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if param_lowp is not None:
        param_lowp.copy_(param)


def sgd_step(param: torch.Tensor, grad: torch.Tensor,
             momentum_buffer: torch.Tensor | None, *, lr: float, momentum: float,
             dampening: float, weight_decay: float, nesterov: bool, first_step: bool,
             param_lowp: torch.Tensor | None = None) -> None:
    """One SGD step with torch.optim.SGD semantics, in place.

    *momentum_buffer* may be None when momentum == 0 (it is ignored then). On
    *first_step* the buffer is set to the (decayed) gradient, without dampening, as
    torch does. *grad* is only read; *param_lowp* as in :func:`adam_step`.
    """
    check_sgd_args(param, grad, momentum_buffer, lr=lr, momentum=momentum,
                   dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                   param_lowp=param_lowp)
    d_p = grad
    if weight_decay != 0:
        d_p = d_p.add(param, alpha=weight_decay)
    if momentum != 0:
        if first_step:
            momentum_buffer.copy_(d_p)
        else:
            momentum_buffer.mul_(momentum).add_(d_p, alpha=1.0 - dampening)
        if nesterov:
            d_p = d_p.add(momentum_buffer, alpha=momentum)
        else:
            d_p = momentum_buffer
    param.add_(d_p, alpha=-lr)
    if param_lowp is not None:
        param_lowp.copy_(param)
