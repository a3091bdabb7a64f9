"""The flat partitions of one parameter group at stage 3.

Per group (Ψ_g elements, N ranks, compute dtype c), everything is a partition:

======================  =====================================================
``param_buf`` (c)        this rank's slice of every fetch unit (the parameters)
``master`` (fp32)        the same slices in fp32 (mixed precision only; in fp32
                         training ``param_buf`` is stepped in place)
``grad_part`` (c)        reduced-gradient accumulator for the same slices
======================  =====================================================

The layout is :func:`~zero_core.stage3.units.unit_layout` (bucket k = unit k), and the
class answers the same questions as stage 1-2's GroupBuffers (``master_bucket``,
``reduced_grad_bucket``, ...), so :class:`~zero_core.optim.partitioned.PartitionedOptimizer`
steps stage-3 partitions with the same kernels and loss-scale/clipping factor.
"""
from __future__ import annotations

from typing import Callable

import torch

from zero_core.interfaces.engine_parts import UnitBuffersProtocol
from zero_core.partitioning.flat_buffer import FlatBuffer
from zero_core.memory import MemoryLedger
from zero_core.partitioning.layout import alignment_for
from zero_core.stage3.units import FetchUnit, unit_layout


class Stage3GroupBuffers(UnitBuffersProtocol):
    """Flat partitions of the fetch units *units* of one group. *full_values(unit)*
    returns the unit's padded flat values in fp32 (on every rank), one unit at a time, so
    that building never holds more than one unit in full."""

    #: this rank updates its partition of every unit, in place: nothing is gathered after
    #: the step (the next use gathers the new values)
    state_kind = "partition"
    gathers_after_step = False

    def __init__(self, units: list[FetchUnit], trainable: bool, compute_dtype: torch.dtype,
                 device: torch.device, rank: int, world_size: int, ledger: MemoryLedger,
                 full_values: Callable[[FetchUnit], torch.Tensor]):
        self.units = units
        self.trainable = trainable
        self.mixed = trainable and compute_dtype != torch.float32
        self.rank, self.world_size = rank, world_size
        elem = torch.empty((), dtype=compute_dtype).element_size()
        self.layout = unit_layout(units, world_size, alignment_for(elem))
        self.params = [p for u in units for p in u.params]
        self.param_buf = FlatBuffer(self.layout, "partition", compute_dtype, device, rank)
        ledger.track("parameters" if trainable else "frozen_parameters", self.param_buf.data)
        self.master = self.grad_part = None
        if self.mixed:
            self.master = FlatBuffer(self.layout, "partition", torch.float32, device, rank)
            ledger.track("master_weights", self.master.data)
        if trainable:
            self.grad_part = FlatBuffer(self.layout, "partition", compute_dtype, device, rank)
            ledger.track("gradients", self.grad_part.data)
        for k, u in enumerate(units):
            u.part = self.param_buf.bucket(k)
            u.grad_part = self.grad_part.bucket(k) if trainable else None
            u.master_part = self.master.bucket(k) if self.master is not None else None
            full = full_values(u)
            shard = u.padded_numel // world_size
            mine = full.narrow(0, rank * shard, shard)
            u.part.copy_(mine)
            if u.master_part is not None:
                u.master_part.copy_(mine)
            del full, mine

    # ---- what PartitionedOptimizer and the engine ask ------------------------------------
    @property
    def num_buckets(self) -> int:
        return self.layout.num_buckets

    def master_bucket(self, k: int) -> torch.Tensor:
        """The fp32 values this rank updates for unit *k*."""
        return self.master.bucket(k) if self.master is not None else self.param_buf.bucket(k)

    def reduced_grad_bucket(self, k: int) -> torch.Tensor:
        """This rank's reduced gradient of unit *k* (compute dtype)."""
        return self.grad_part.bucket(k)

    def reduced_grad_tensors(self) -> list[torch.Tensor]:
        return [self.grad_part.data]

    def zero_grads(self) -> None:
        """Nothing to clear: the next reduction overwrites the accumulator (the reducer's
        ``mark_fresh``), as at stage 2."""

    def replace_master(self, master: FlatBuffer, unit_master) -> None:
        """The offloaded optimizer keeps the fp32 master in its store from now on; unit
        *k*'s ``master_part`` (where GatheredParameters writes back) becomes
        ``unit_master(k)``."""
        self.master = master
        for k, u in enumerate(self.units):
            u.master_part = unit_master(k)
