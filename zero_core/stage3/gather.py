"""All-gather and release of fetch units.

``start(unit)`` launches the unit's all-gather asynchronously into a freshly allocated
flat buffer; ``wait(unit)`` completes it and points every parameter of the unit at its
view of that buffer; ``release(unit)`` points them back at an empty tensor.

Gathered buffers are never recycled: a buffer is freed when the last reference goes.
Autograd would hold views of it from forward to backward (``F.linear`` saves
``weight.t()``); saved_views.py packs those as references to the unit instead, so that
release frees the buffer. ``live_storage`` maps the storage address of every gathered
buffer to its unit for that purpose.

Parameter source: the partition to all-gather from comes from a
:class:`~zero_core.interfaces.engine_parts.ParamSourceProtocol` — :class:`ResidentPartitions`
(``unit.part`` in device memory) unless ``offload_param`` hands the engine's
``ParamOffload`` (zero_core/offload/params.py), which stages it from host memory or a
swap file; ``fetched(u)`` tells the source when the collective no longer reads it.

Strategy hook: with a *strategy* (ZeRO++, zero_core/zeropp), ``strategy.launch(u,
for_compute)`` returns ``(full, handle)`` instead of the plain all-gather (``for_compute``
is true while the coordinator gathers for forward/backward, when a lossy quantized copy
is acceptable; pins and state dicts gather exactly), and ``strategy.write_back(u)``
replaces :meth:`UnitGatherer.write_back`.

``torch_autocast`` (engine/autocast.py, "Stage-3 gathers"): a gather for compute of a unit
holding parameters of ``lower_precision_safe_modules`` carries those in the autocast dtype
(:class:`~zero_core.engine.autocast.MixedGather`: rounded, widened back) — a persistent
unit only until its first release; other gathers are exact, and a unit still holding a
rounded gather is gathered again exactly for them when no forward runs it.

Live accounting: ``live_numel`` counts the elements of non-persistent units that are
gathered or in flight (the window bounded by ``stage3_max_live_parameters``); persistent
units are counted separately (``persistent_numel``).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from zero_core.engine.autocast import mixed_gather
from zero_core.interfaces.communicator import Communicator
from zero_core.interfaces.engine_parts import ParamSourceProtocol
from zero_core.stage3 import partitioned_params as pp
from zero_core.stage3.units import FetchUnit, UnitState


class ResidentPartitions(ParamSourceProtocol):
    """The parameter source without offload: a unit's partition is ``unit.part``, in the
    device memory of the group buffers (stage3/buffers.py); nothing is staged."""

    def fetch(self, u: FetchUnit) -> torch.Tensor:
        return u.part

    def fetched(self, u: FetchUnit) -> None:
        pass

    def write_unit(self, u: FetchUnit, values: torch.Tensor) -> None:
        u.part.copy_(values)


class UnitGatherer:
    """Gathers and releases fetch units over *comm* (world group), from *part_source*
    (default: :class:`ResidentPartitions`)."""

    def __init__(self, comm: Communicator, compute_dtype: torch.dtype, device: torch.device,
                 strategy=None, part_source: ParamSourceProtocol | None = None):
        self.comm, self.dtype, self.device = comm, compute_dtype, device
        self.strategy = strategy   # see the module docstring; None: plain all-gather
        self.part_source = part_source if part_source is not None else ResidentPartitions()
        self.for_compute = False
        self.live_numel = 0
        self.peak_live_numel = 0
        self.persistent_numel = 0
        self.gathers = 0
        self.live_storage: dict[int, FetchUnit] = {}
        # indices of units released since the coordinator's last prefetch scan
        # (coordinator._prefetch); a set, so it stays bounded when nobody scans
        self.released_since_scan: set[int] = set()
        # torch_autocast: per unit its MixedGather (None: plain), the units whose gathered
        # values are rounded, the persistent units released once (exact from then on)
        self._lower: dict[int, object] = {}
        self._rounded: set[int] = set()
        self._exact_persistent: set[int] = set()

    def _lower_plan(self, u: FetchUnit, part_dtype: torch.dtype):
        """*u*'s MixedGather when this gather carries some parameters in a lower dtype."""
        if (not self.for_compute or self.comm.world_size == 1
                or u.index in self._exact_persistent):
            return None
        if u.index not in self._lower:
            spans = [(off, pp.meta_of(p).numel, p) for p, off in zip(u.params, u.offsets)]
            self._lower[u.index] = mixed_gather(self.comm, spans, u.padded_numel, part_dtype,
                                                self.comm.rank)
        return self._lower[u.index]

    def _count(self, u: FetchUnit, sign: int) -> None:
        if u.persistent:
            self.persistent_numel += sign * u.padded_numel
        else:
            self.live_numel += sign * u.padded_numel
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    @contextmanager
    def computing(self):
        """Gathers started inside are for forward/backward compute (see module docstring)."""
        before, self.for_compute = self.for_compute, True
        try:
            yield
        finally:
            self.for_compute = before

    def start(self, u: FetchUnit) -> None:
        """Launch *u*'s all-gather if it is released (no-op otherwise)."""
        if not u.released:
            return
        if self.strategy is not None:
            full, handle = self.strategy.launch(u, self.for_compute)
        else:
            part = self.part_source.fetch(u)   # on the compute device
            full = torch.empty(u.padded_numel, dtype=part.dtype, device=part.device)
            lower = self._lower_plan(u, part.dtype)
            if self.comm.world_size == 1:
                full.copy_(part)
                handle = None
                self.part_source.fetched(u)
            elif lower is not None:
                handle = lower.launch(self.comm, part, full)
                self._rounded.add(u.index)
            else:
                handle = self.comm.all_gather_into(full, part, async_op=True)
        u.mark_inflight(full, handle)
        self.gathers += 1
        self._count(u, +1)

    def wait(self, u: FetchUnit) -> None:
        """Make *u*'s parameters available (starting its gather if needed)."""
        exact = (not self.for_compute and u.index in self._rounded and not u.active
                 and not u.pinned_for_backward)
        if exact:  # rounded for compute, wanted exact (module docstring)
            self.release(u)
        if u.state is UnitState.GATHERED:
            return
        if u.released:
            self.start(u)
        u.wait_collective()
        self.part_source.fetched(u)
        full = u.full
        for p, off in zip(u.params, u.offsets):
            meta = pp.meta_of(p)
            pp.attach(p, full.narrow(0, off, meta.numel))
        u.mark_gathered()
        if full.numel():
            self.live_storage[full.untyped_storage().data_ptr()] = u

    def ensure(self, units) -> None:
        """Start every released unit of *units*, then wait for all of them (so that the
        gathers of one module's units overlap each other)."""
        for u in units:
            self.start(u)
        for u in units:
            self.wait(u)

    def release(self, u: FetchUnit) -> None:
        """Drop *u*'s gathered values (waits first for a gather still in flight, so that
        the collective completes on every rank)."""
        if u.released:
            return
        u.wait_collective()
        self.part_source.fetched(u)
        for p in u.params:
            pp.release(p)
        if u.full is not None:
            self.live_storage.pop(u.full.untyped_storage().data_ptr(), None)
        u.mark_released()
        self._rounded.discard(u.index)
        if u.persistent:
            self._exact_persistent.add(u.index)
        self._count(u, -1)
        self.released_since_scan.add(u.index)

    def write_back(self, u: FetchUnit) -> None:
        """After the gathered values of *u* were modified (identically on every rank):
        copy this rank's slice into the partition, and into the fp32 master slice."""
        if self.strategy is not None:
            self.strategy.write_back(u)
            return
        shard = u.padded_numel // self.comm.world_size
        mine = u.full.narrow(0, self.comm.rank * shard, shard)
        self.part_source.write_unit(u, mine)
        if u.master_part is not None:
            u.master_part.copy_(mine)
