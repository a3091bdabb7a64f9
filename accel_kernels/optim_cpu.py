"""Fast CPU optimizer kernels that need no compiler at run time.

Both functions have the signatures and semantics of :mod:`.optim_reference` (see
``zero_core/interfaces/kernels.py``): they refuse tensors that are not on the CPU and
then run torch's own fused, vectorized, multi-threaded CPU kernels through
:mod:`.optim_fused` (the one wrapper of those ops, which also says how
``bias_correction=False`` is carried), reading and writing every buffer once per step.

Why this and not something else (the figures are in docs/design.md and docs/benchmarks.md,
"Kernels"; ci/bench/kernels.py is the repeatable run):

* torch's fused Adam runs at the machine's memory bandwidth: it moves each buffer the
  minimum number of times, so no pure-torch formulation can beat it, only move fewer
  bytes. Splitting it into cache-sized chunks changed nothing measurable, so it is called
  once on the whole buffer. It is as fast as torch.optim.AdamW(fused=True) and
  DeepSpeedCPUAdam, and far faster than AdamW(foreach=True).
* With *param_lowp*, the fused step is followed by one rounding copy of the whole
  buffer. Doing both chunk by chunk (so the fresh fp32 chunk is rounded while still in
  the L3 cache) saved a little on a quiet machine but was several times slower whenever
  the cores were shared with other processes: every torch op is a parallel region that
  waits for all of its threads, and many small regions wait far more often than two
  large ones. A host running several ranks and loader workers is the common case for an
  offloaded optimizer, so robustness won.
* The pure-torch reference is much slower (many passes, temporaries), and so is
  torch.optim.AdamW with foreach.
"""
from __future__ import annotations

import torch

from . import optim_fused


def _require_cpu(param: torch.Tensor) -> None:
    if param.device.type != "cpu":
        raise ValueError(f"optim_cpu kernels run on CPU tensors, param is on {param.device}; "
                         "use the kernel set of that device's accelerator instead")


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, step: int, adamw: bool,
              bias_correction: bool = True,
              param_lowp: torch.Tensor | None = None,
              found_inf: torch.Tensor | None = None) -> None:
    """One Adam (adamw=False, L2) or AdamW (adamw=True, decoupled decay) step, in place.

    Same contract as :func:`zero_core.accel_kernels.optim_reference.adam_step`: flat
    contiguous fp32 CPU tensors of one size, *grad* only read, *step* the 1-based count
    after this update, *lr* in parameter units per step, optional bf16/fp16 *param_lowp*
    written rounded (nearest even) right after the step; *found_inf* 1.0: nothing changes
    (optim_fused).
    """
    _require_cpu(param)
    optim_fused.adam_step(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                          eps=eps, weight_decay=weight_decay, step=step, adamw=adamw,
                          bias_correction=bias_correction, param_lowp=param_lowp,
                          found_inf=found_inf)


def sgd_step(param: torch.Tensor, grad: torch.Tensor,
             momentum_buffer: torch.Tensor | None, *, lr: float, momentum: float,
             dampening: float, weight_decay: float, nesterov: bool, first_step: bool,
             param_lowp: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None) -> None:
    """One SGD step with torch.optim.SGD semantics, in place (torch's fused CPU kernel).

    Same contract as :func:`zero_core.accel_kernels.optim_reference.sgd_step`;
    *momentum_buffer* is ignored (and may be None) when momentum == 0; *found_inf* as in
    :func:`adam_step`.
    """
    _require_cpu(param)
    optim_fused.sgd_step(param, grad, momentum_buffer, lr=lr, momentum=momentum,
                         dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                         first_step=first_step, param_lowp=param_lowp, found_inf=found_inf)
