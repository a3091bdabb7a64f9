"""Kernel protocols: what the engine asks of an accelerator's kernels.

A :class:`KernelSet` bundles the fused kernels of one target. Implementations are plain
functions in ``zero_core.accel_kernels`` (which knows nothing about ZeRO); backends and
plugins wrap them in a KernelSet and contribute it through the ``zero_core_kernel_sets``
hook. Signatures (all tensors flat and contiguous, updated in place, float32 unless said):

``adam_step(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay,
step, adamw, bias_correction=True, param_lowp=None)``
    One Adam (adamw=False: L2 added to the gradient) or AdamW (decoupled decay) step.
    *step* is the 1-based step count after this update. If *param_lowp* (bf16/fp16) is
    given, the updated parameter is also written there, rounded, in the same pass.

``sgd_step(param, grad, momentum_buffer, *, lr, momentum, dampening, weight_decay,
nesterov, first_step, param_lowp=None)``
    SGD with optional momentum, torch.optim.SGD semantics; *momentum_buffer* may be None
    when momentum is 0.

A set whose ``skips_on_device`` is True also takes ``found_inf=`` in both kernels: a 0-dim
float32 tensor on the parameters' device; 1.0 means "this step is skipped": parameters,
states and *param_lowp*'s values stay as they are (torch's fused optimizers' own flag). The
engine then decides to skip a step (non-finite gradients, unequal batches) without the host
reading anything back. A set without it gets no ``found_inf``, and the engine reads its
verdict on the host first: one device synchronization per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class KernelSet:
    """The kernels of one target, looked up by name from the registry."""

    name: str
    adam_step: Callable
    sgd_step: Callable
    #: free-form facts for ``zero-core report`` (e.g. which library backs the kernels)
    info: dict = field(default_factory=dict)
    #: optional kernels added by later capabilities (quantization, ...), by name
    extra: dict = field(default_factory=dict)
    #: the optimizer kernels take ``found_inf=`` (see the module docstring)
    skips_on_device: bool = False
