"""Fast CPU optimizer kernels that need no compiler at run time.

Both functions have the signatures and semantics of :mod:`.optim_reference` (see
``zero_core/kernels.py``) and call torch's own fused, vectorized, multi-threaded CPU
kernels (``torch._fused_adam_``, ``torch._fused_adamw_``, ``torch._fused_sgd_``), which
read and write every buffer once per step.

Why this and not something else (measured on this project's 2-core AMD EPYC VM, 50M
fp32 elements, quiet machine; see ci/bench_kernels.py for the repeatable run):

* torch's fused Adam moves 7 x 200 MB per step (4 reads, 3 writes) in ~12 ms, i.e. at the
  machine's memory bandwidth (a 200 MB fp32 copy takes ~5.7 ms): no pure-torch
  formulation can beat it, only move fewer bytes. Splitting it into cache-sized chunks
  changed nothing measurable (12.0-12.8 ms for 256K..4M-element chunks), so it is called
  once on the whole buffer.
* With *param_lowp*, calling the fused op chunk by chunk and rounding each chunk into
  the low-precision copy while it is still in cache saves re-reading the fp32 parameter
  from memory: 15.5 ms per step with 1M-element chunks vs 16.7 ms for a fused step
  followed by one full-buffer copy. 1M elements x 4 fp32 buffers = 16 MB, which stays in
  the 32 MB L3; smaller chunks lose to per-call overhead (19.5 ms at 128K).
* The pure-torch reference takes ~330 ms (many passes, temporaries), torch.optim.AdamW
  with foreach ~140 ms.

``bias_correction=False`` is expressed through the fused op's step tensor: with
step = +inf, beta**step is exactly 0 in IEEE arithmetic, so both corrections are exactly
1 and the fused kernel computes the uncorrected update (checked against the reference
in tests/test_optim_kernels.py).
"""
from __future__ import annotations

import math

import torch

from .optim_checks import check_adam_args, check_sgd_args

#: elements per chunk when a low-precision copy is written in the same pass (see above)
LOWP_CHUNK_ELEMENTS = 1 << 20


def _require_cpu(param: torch.Tensor) -> None:
    if param.device.type != "cpu":
        raise ValueError(f"optim_cpu kernels run on CPU tensors, param is on {param.device}; "
                         "use the kernel set of that device's accelerator instead")


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, step: int, adamw: bool,
              bias_correction: bool = True,
              param_lowp: torch.Tensor | None = None) -> None:
    """One Adam (adamw=False, L2) or AdamW (adamw=True, decoupled decay) step, in place.

    Same contract as :func:`zero_core.accel_kernels.optim_reference.adam_step`: flat
    contiguous fp32 CPU tensors of one size, *grad* only read, *step* the 1-based count
    after this update, *lr* in parameter units per step, optional bf16/fp16 *param_lowp*
    written rounded (nearest even) in the same pass.
    """
    check_adam_args(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, weight_decay=weight_decay, step=step, param_lowp=param_lowp)
    _require_cpu(param)
    if param.numel() == 0:
        return
    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    # float64 keeps step counts beyond 2**24 exact; +inf turns bias correction off
    step_t = torch.tensor(float(step) if bias_correction else math.inf, dtype=torch.float64)
    kwargs = dict(lr=float(lr), beta1=float(beta1), beta2=float(beta2),
                  weight_decay=float(weight_decay), eps=float(eps), amsgrad=False,
                  maximize=False)
    if param_lowp is None:
        fused([param], [grad], [exp_avg], [exp_avg_sq], [], [step_t], **kwargs)
        return
    for p, g, m, v, lp in zip(param.split(LOWP_CHUNK_ELEMENTS), grad.split(LOWP_CHUNK_ELEMENTS),
                              exp_avg.split(LOWP_CHUNK_ELEMENTS),
                              exp_avg_sq.split(LOWP_CHUNK_ELEMENTS),
                              param_lowp.split(LOWP_CHUNK_ELEMENTS)):
        fused([p], [g], [m], [v], [], [step_t], **kwargs)
        lp.copy_(p)  # the chunk is still in cache: no second trip to memory for p


def sgd_step(param: torch.Tensor, grad: torch.Tensor,
             momentum_buffer: torch.Tensor | None, *, lr: float, momentum: float,
             dampening: float, weight_decay: float, nesterov: bool, first_step: bool,
             param_lowp: torch.Tensor | None = None) -> None:
    """One SGD step with torch.optim.SGD semantics, in place (torch's fused CPU kernel).

    Same contract as :func:`zero_core.accel_kernels.optim_reference.sgd_step`;
    *momentum_buffer* is ignored (and may be None) when momentum == 0.
    """
    check_sgd_args(param, grad, momentum_buffer, lr=lr, momentum=momentum,
                   dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                   param_lowp=param_lowp)
    _require_cpu(param)
    if param.numel() == 0:
        return
    kwargs = dict(weight_decay=float(weight_decay), momentum=float(momentum), lr=float(lr),
                  dampening=float(dampening), nesterov=bool(nesterov), maximize=False,
                  is_first_step=bool(first_step))
    n_chunks = 1 if param_lowp is None else -(-param.numel() // LOWP_CHUNK_ELEMENTS)
    size = param.numel() if param_lowp is None else LOWP_CHUNK_ELEMENTS
    bufs = [None] * n_chunks if momentum == 0 else list(momentum_buffer.split(size))
    lps = [None] * n_chunks if param_lowp is None else list(param_lowp.split(size))
    for p, g, b, lp in zip(param.split(size), grad.split(size), bufs, lps):
        torch._fused_sgd_([p], [g], [] if b is None else [b], **kwargs)
        if lp is not None:
            lp.copy_(p)
