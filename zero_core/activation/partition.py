"""The model-parallel group that checkpointed activations are partitioned across (ZeRO-R).

With ``partition_activations``, the inputs a checkpoint saves are identical on every rank
of a model-parallel group (Megatron-style tensor parallelism: the activation entering a
transformer layer is replicated across the group). Each rank then keeps 1/mp of the bytes
and backward rebuilds the whole by an all-gather through zero-core's
:class:`~zero_core.interfaces.communicator.Communicator` (so the ledger counts it).

What is accepted as the "mpu" (DeepSpeed's name for the model-parallel unit):

* an object with ``get_model_parallel_group()`` returning a zero-core
  :class:`~zero_core.interfaces.communicator.Group` (made with ``comm.new_group(ranks)`` on every rank);
  if it also has ``get_model_parallel_rank()`` / ``get_model_parallel_world_size()``, they
  must agree with the group;
* a :class:`~zero_core.interfaces.communicator.Group` itself.

A ``torch.distributed`` process group (Megatron's mpu) is refused with a message saying how
to make the zero-core group: zero-core's collectives never go around its Communicator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_core.interfaces.communicator import Communicator, Group
from zero_core.errors import ConfigError


@dataclass(frozen=True)
class ModelParallel:
    """A resolved model-parallel group and the communicator that carries it."""

    comm: Communicator
    group: Group

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's contiguous 1-D *local* (same numel on all), stacked as a
        ``(size, numel)`` tensor in group order."""
        out = torch.empty(self.size * local.numel(), dtype=local.dtype, device=local.device)
        self.comm.all_gather_into(out, local, group=self.group)
        return out.view(self.size, local.numel())


_HOW_TO_MAKE_A_GROUP = ("make the group with zero_core.get_runtime().comm.new_group(ranks) (every "
                        "rank calls it, with the same ranks lists in the same order) and return "
                        "it from get_model_parallel_group(), or pass the Group itself as mpu_")


def resolve_model_parallel(mpu, comm_provider) -> ModelParallel:
    """Check *mpu* (see the module docstring) and return its :class:`ModelParallel`.

    *comm_provider()* returns the process's communicator; it is called only once the group
    has been found (so a bad mpu is reported without initializing anything).
    Raises ConfigError saying what was wrong and how to fix it.
    """
    if isinstance(mpu, Group):
        group = mpu
    else:
        getter = getattr(mpu, "get_model_parallel_group", None)
        if not callable(getter):
            raise ConfigError(f"activation checkpointing: mpu_ of type {type(mpu).__name__} has "
                              f"no get_model_parallel_group() method; {_HOW_TO_MAKE_A_GROUP}")
        group = getter()
    if not isinstance(group, Group):
        raise ConfigError(f"activation checkpointing: the mpu's get_model_parallel_group() "
                          f"returned a {type(group).__module__}.{type(group).__name__}, not a zero-core "
                          f"Group; zero-core partitions activations through its own "
                          f"Communicator: {_HOW_TO_MAKE_A_GROUP}")
    if not group.is_member:
        raise ConfigError(f"activation checkpointing: this rank is not a member of the "
                          f"model-parallel group '{group.name}' (ranks {list(group.ranks)}); each "
                          f"rank must pass the group it belongs to")
    if not isinstance(mpu, Group):
        for method, expected in (("get_model_parallel_world_size", group.size),
                                 ("get_model_parallel_rank", group.rank)):
            fn = getattr(mpu, method, None)
            value = fn() if callable(fn) else expected
            if value != expected:
                raise ConfigError(f"activation checkpointing: mpu.{method}() = {value} but the "
                                  f"group '{group.name}' it returns has {method.split('_')[-1]} "
                                  f"{expected} (ranks {list(group.ranks)}, this rank at index "
                                  f"{group.rank}); make the mpu report its own group")
    return ModelParallel(comm_provider(), group)
