"""The flat partitions of one parameter group at stage 3.

Per group (Ψ_g elements, N ranks, compute dtype c), everything is a partition:

======================  =====================================================
``param_buf`` (c)        this rank's slice of every fetch unit (the parameters)
``master`` (m)           the same slices in fp32, or bf16 with
                         ``bf16.bf16_master_weights_and_grads`` (m: ``master_dtype``;
                         mixed precision only: in fp32 training ``param_buf`` is
                         stepped in place)
``grad_part`` (a)        reduced-gradient accumulator for the same slices (a: the
                         ``grad_dtype``, c unless data_types.grad_accum_dtype is fp32)
======================  =====================================================

The layout is :func:`~zero_core.stage3.units.unit_layout` (bucket k = unit k), and the
class answers the same questions as stage 1-2's GroupBuffers (``master_bucket``,
``reduced_grad_bucket``, ...), so :class:`~zero_core.optim.partitioned.PartitionedOptimizer`
steps stage-3 partitions with the same kernels and loss-scale/clipping factor.

:class:`OffloadedStage3GroupBuffers` is the same group with its parameter partitions in
a parameter store (``offload_param``: host memory or swap files, zero_core/offload/params.py),
met through :class:`~zero_core.interfaces.engine_parts.ParamStoreProtocol` — this module
imports nothing of offload/.
"""
from __future__ import annotations

from typing import Callable

import torch

from zero_core.interfaces.engine_parts import ParamStoreProtocol, UnitBuffersProtocol
from zero_core.config.precision import master_dtype_for
from zero_core.partitioning.flat_buffer import FlatBuffer, check_master_handover
from zero_core.memory import MemoryLedger
from zero_core.partitioning.layout import alignment_for
from zero_core.stage3.units import FetchUnit, unit_layout


class Stage3GroupBuffers(UnitBuffersProtocol):
    """Flat partitions of the fetch units *units* of one group. *full_values(unit)*
    returns the unit's padded flat values in fp32 (on every rank), one unit at a time, so
    that building never holds more than one unit in full.

    Building goes in this order, each step a method a subclass may replace: the
    parameter partitions (:meth:`_place_parameters`), the master in ``master_dtype``
    (:meth:`_place_master`, mixed precision), the gradient accumulator
    (:meth:`_place_gradients`; after the units when ``GRADIENTS_AFTER_VALUES``), then
    every unit's values (:meth:`_store_initial`)."""

    #: this rank updates its partition of every unit, in place: nothing is gathered after
    #: the step (the next use gathers the new values)
    state_kind = "partition"
    gathers_after_step = False
    #: allocate the gradient accumulator only once every unit's values are stored
    GRADIENTS_AFTER_VALUES = False

    def __init__(self, units: list[FetchUnit], trainable: bool, compute_dtype: torch.dtype,
                 device: torch.device, rank: int, world_size: int, ledger: MemoryLedger,
                 full_values: Callable[[FetchUnit], torch.Tensor],
                 grad_dtype: torch.dtype | None = None,
                 master_dtype: torch.dtype = torch.float32):
        self.units = units
        #: fp32, or bf16 (bf16.bf16_master_weights_and_grads; checked as at stages 1-2)
        self.master_dtype = master_dtype_for(3, compute_dtype, master_dtype)
        self.grad_dtype = grad_dtype or compute_dtype   # the gradient accumulator's
        self.trainable = trainable
        self.mixed = trainable and compute_dtype != torch.float32
        self.rank, self.world_size = rank, world_size
        elem = torch.empty((), dtype=compute_dtype).element_size()
        self.layout = unit_layout(units, world_size, alignment_for(elem))
        self.params = [p for u in units for p in u.params]
        self.master = self.grad_part = None
        parts = self._place_parameters(compute_dtype, device, ledger)
        if self._keeps_master():
            self.master = self._place_master(device, ledger)
        if trainable and not self.GRADIENTS_AFTER_VALUES:
            self._place_gradients(compute_dtype, device, ledger)
        for k, u in enumerate(units):
            u.part = parts[k]
            u.master_part = self.master.bucket(k) if self.master is not None else None
            full = full_values(u)
            shard = u.padded_numel // world_size
            mine = full.narrow(0, rank * shard, shard)
            self._store_initial(u, mine)
            if u.master_part is not None:
                u.master_part.copy_(mine)
            del full, mine
        if trainable and self.GRADIENTS_AFTER_VALUES:
            self._place_gradients(compute_dtype, device, ledger)
        for k, u in enumerate(units):
            u.grad_part = self.grad_part.bucket(k) if trainable else None

    # ---- where the partitions live (OffloadedStage3GroupBuffers replaces these) -----------
    def _keeps_master(self) -> bool:
        """Whether the group keeps a master apart from ``param_buf`` (mixed precision)."""
        return self.mixed

    def _place_parameters(self, compute_dtype, device, ledger) -> list[torch.Tensor]:
        """Allocate ``param_buf``; returns each unit's ``part``."""
        self.param_buf = FlatBuffer(self.layout, "partition", compute_dtype, device, self.rank)
        ledger.track("parameters" if self.trainable else "frozen_parameters", self.param_buf.data)
        return [self.param_buf.bucket(k) for k in range(self.layout.num_buckets)]

    def _place_master(self, device, ledger) -> FlatBuffer:
        master = FlatBuffer(self.layout, "partition", self.master_dtype, device, self.rank)
        ledger.track("master_weights", master.data)
        return master

    def _place_gradients(self, compute_dtype, device, ledger) -> None:
        self.grad_part = FlatBuffer(self.layout, "partition", self.grad_dtype, device, self.rank)
        ledger.track("gradients", self.grad_part.data)

    def _store_initial(self, u: FetchUnit, values: torch.Tensor) -> None:
        """Unit *u*'s first partition values."""
        u.part.copy_(values)

    # ---- what PartitionedOptimizer and the engine ask ------------------------------------
    @property
    def num_buckets(self) -> int:
        return self.layout.num_buckets

    def master_bucket(self, k: int) -> torch.Tensor:
        """The master values (fp32, or a bf16 master) this rank updates for unit *k*."""
        return self.master.bucket(k) if self.master is not None else self.param_buf.bucket(k)

    def reduced_grad_bucket(self, k: int) -> torch.Tensor:
        """This rank's reduced gradient of unit *k* (``grad_dtype``)."""
        return self.grad_part.bucket(k)

    def reduced_grad_tensors(self) -> list[torch.Tensor]:
        return [self.grad_part.data]

    def zero_grads(self) -> None:
        """Nothing to clear: the next reduction overwrites the accumulator (the reducer's
        ``mark_fresh``), as at stage 2."""

    def replace_master(self, master: FlatBuffer, unit_master) -> None:
        """The offloaded optimizer keeps the fp32 master in its store from now on; unit
        *k*'s ``master_part`` (where GatheredParameters writes back) becomes
        ``unit_master(k)``. A bf16 master is refused (the store keeps fp32)."""
        check_master_handover(self.master, master)
        self.master = master
        for k, u in enumerate(self.units):
            u.master_part = unit_master(k)


class OffloadedStage3GroupBuffers(Stage3GroupBuffers):
    """Stage3GroupBuffers whose parameter partitions are held by *store* (the engine's
    ``ParamOffload``): built one unit at a time, so that a rank never holds its whole
    partition in memory. Only the gradient accumulator is on the device, allocated after
    the units (the model's own copy is released unit by unit).

    The fp32 master at build (mixed precision): when the model's values carry more
    precision than the compute dtype, a host fp32 master keeps them until the offloaded
    optimizer took it (``replace_master``) — Ψ/N × 4 bytes per rank for a moment. When
    they are already in the compute dtype (*values_in_compute_dtype*: a model built in
    bf16, as DeepSpeed's zero.Init casts it), the store's partitions hold them exactly, so
    no host master is made and the optimizer reads its fp32 master from the store unit by
    unit: building then never holds a whole partition, which is what lets a model larger
    than host memory (ZeRO-Infinity) be built at all.

    *master_on_device* (``offload_param`` without ``offload_optimizer``, as DeepSpeed runs
    it): the optimizer steps on the device, so every trainable group keeps its master there
    (``master_dtype``; in fp32 training too, since the parameters are host memory or a file
    that no device kernel updates in place) and the updated values are written back into
    the store after each bucket's update (offload/params.py, ``DeviceStepOptimizer``)."""

    GRADIENTS_AFTER_VALUES = True

    def __init__(self, units, trainable, compute_dtype, device, rank, world_size, ledger,
                 full_values, store: ParamStoreProtocol, grad_dtype: torch.dtype | None = None,
                 master_dtype: torch.dtype = torch.float32,
                 values_in_compute_dtype: bool = False, master_on_device: bool = False):
        self.store = store
        self.master_on_device = master_on_device and trainable
        self._master_from_store = values_in_compute_dtype and not self.master_on_device
        super().__init__(units, trainable, compute_dtype, device, rank, world_size, ledger,
                         full_values, grad_dtype, master_dtype=master_dtype)

    def _keeps_master(self) -> bool:
        return self.mixed or self.master_on_device

    def _place_parameters(self, compute_dtype, device, ledger) -> list[torch.Tensor]:
        self.param_buf, parts = self.store.place_group(self.layout, self.units)
        return parts

    def _place_master(self, device, ledger) -> FlatBuffer | None:
        if self.master_on_device:
            return super()._place_master(device, ledger)
        if self._master_from_store:
            return None   # the optimizer reads the exact values from the store
        # handed to the offloaded optimizer's store, then dropped (engine order)
        return FlatBuffer(self.layout, "partition", self.master_dtype, torch.device("cpu"),
                          self.rank)

    def _store_initial(self, u: FetchUnit, values: torch.Tensor) -> None:
        self.store.write_initial(u, values)
