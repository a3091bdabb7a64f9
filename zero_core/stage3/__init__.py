"""ZeRO stage 3: parameters partitioned too, gathered around each module's use.

Where things are:

- partitioned_params.py — the parameter class and the error for unguarded reads;
- units.py — fetch units (which parameters are gathered together), their layout and state;
- buffers.py — a group's flat partitions (parameters, fp32 master, gradients), also with
  the parameters in the offload store;
- gather.py — all-gather and release of a unit, from a parameter source;
- prefetch.py — execution-order recording; coordinator.py — gather/prefetch/release policy;
- module_hooks.py — forward/backward hooks, register_external_parameter;
- grad_reduce.py — reduce-scatter of unit gradients into the partitions;
- init_context.py — zero_core.Init and zero_core.GatheredParameters;
- state_dict.py — consolidated state dict; parts.py — Stage3Parts, all of the above as the
  engine's StageParts (zero_core/engine/contract.py).
"""
from zero_core.stage3.init_context import GatheredParameters, Init  # noqa: F401
from zero_core.stage3.module_hooks import register_external_parameter, unregister_external_parameter  # noqa: F401
from zero_core.stage3.partitioned_params import ParameterNotGatheredError  # noqa: F401
