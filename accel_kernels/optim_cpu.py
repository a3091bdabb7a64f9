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
  once on the whole buffer. (In ci/bench_kernels.py runs with other jobs on the machine
  it takes 23-24 ms, the same as torch.optim.AdamW(fused=True), against 24-29 ms for
  DeepSpeedCPUAdam and ~190 ms for AdamW(foreach=True).)
* With *param_lowp*, the fused step is followed by one rounding copy of the whole
  buffer. Doing both chunk by chunk (1M elements, so the fresh fp32 chunk is rounded
  while still in the L3 cache) saved 7% on a quiet machine (15.5 vs 16.7 ms) but was
  ~3x slower whenever the cores were shared with other processes (272-372 vs 94-108 ms at
  load ~11): every torch op is a parallel region that waits for all of its threads, and
  100 small regions wait 50x as often as 2 large ones. A host running several ranks and
  loader workers is the common case for an offloaded optimizer, so robustness won.
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
    written rounded (nearest even) right after the step.
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
    fused([param], [grad], [exp_avg], [exp_avg_sq], [], [step_t], **kwargs)
    if param_lowp is not None:
        param_lowp.copy_(param)


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
    torch._fused_sgd_([param], [grad], [] if momentum == 0 else [momentum_buffer], **kwargs)
    if param_lowp is not None:
        param_lowp.copy_(param)
