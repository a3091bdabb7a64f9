"""Which optimizer the engine steps with: the one decision, in one place.

Every choice is a :class:`~zero_core.optim.partitioned.PartitionedOptimizer` or a subclass,
so the engine talks to all of them the same way (ARCHITECTURE §4, "Which optimizer"):

* ``offload_optimizer`` on (master and states in host memory or files): ZenFlow's optimizer
  when ``zero_optimization.zenflow`` is set (offload/zenflow.py; stage 3:
  offload/zenflow_stage3.py), else offload/optimizer.py's
  (plain, partial ``ratio`` < 1, SuperOffload);
* otherwise on the device: the 1-bit optimizers for their ``optimizer.type``
  (optim/onebit.py); over a stage-3 parameter store without ``offload_optimizer``, a
  ``DeviceStepOptimizer`` that writes each updated unit back into the store
  (offload/params.py); else ``PartitionedOptimizer`` itself.

The offload modules are imported only when asked for: they bring threads and file I/O that a
plain run never needs.
"""
from __future__ import annotations

from zero_core.optim.onebit import optimizer_class
from zero_core.optim.partitioned import PartitionedOptimizer
from zero_core.optim.rules import require_offloadable


def build_optimizer(ctx, hyper_groups, rule, parts, zero_grad, comm,
                    state_dtype) -> PartitionedOptimizer:
    """The engine's optimizer over *parts*' group buffers (*ctx*: the engine's
    ``BuildContext``; *comm*: the sharding's communicator)."""
    zc = ctx.config.zero_optimization
    if zc.offload_optimizer.enabled:
        require_offloadable(rule)
        if zc.zenflow is not None and ctx.stage == 3:
            from zero_core.offload.zenflow_stage3 import build_zenflow_stage3
            return build_zenflow_stage3(ctx, hyper_groups, rule, parts, zero_grad)
        if zc.zenflow is not None:
            from zero_core.offload.zenflow import build_zenflow
            return build_zenflow(ctx, hyper_groups, rule, parts.buffers, zero_grad)
        from zero_core.offload.optimizer import build_offloaded_optimizer
        return build_offloaded_optimizer(ctx, hyper_groups, rule, parts.buffers, zero_grad,
                                         param_store=parts.param_store)
    cls = optimizer_class(rule)
    if parts.param_store is not None:
        from zero_core.offload.params import device_step_class
        cls = device_step_class(cls)
    return cls(hyper_groups, rule, parts.buffers, ctx.kernels, comm, ctx.memory_ledger,
               zero_grad, state_dtype=state_dtype)
