"""All-gather and release of fetch units.

``start(unit)`` launches the unit's all-gather asynchronously into a freshly allocated
flat buffer; ``wait(unit)`` completes it and points every parameter of the unit at its
view of that buffer; ``release(unit)`` points them back at an empty tensor.

Gathered buffers are never recycled by the engine: autograd may still hold views of a
released unit's buffer (a view such as ``weight.t()`` saved for backward keeps its own
reference), and overwriting it would change those saved values. A buffer is freed when
the last reference goes — for parameters saved directly by autograd (``F.linear`` saves
the weight itself) that is at release.

Live accounting: ``live_numel`` counts the elements of non-persistent units that are
gathered or in flight (the window bounded by ``stage3_max_live_parameters``); persistent
units are counted separately (``persistent_numel``).
"""
from __future__ import annotations

import torch

from ..communicator import Communicator
from . import partitioned_params as pp
from .units import FetchUnit


class UnitGatherer:
    """Gathers and releases fetch units over *comm* (world group)."""

    def __init__(self, comm: Communicator, compute_dtype: torch.dtype, device: torch.device):
        self.comm, self.dtype, self.device = comm, compute_dtype, device
        self.live_numel = 0
        self.peak_live_numel = 0
        self.persistent_numel = 0
        self.gathers = 0

    def _count(self, u: FetchUnit, sign: int) -> None:
        if u.persistent:
            self.persistent_numel += sign * u.padded_numel
        else:
            self.live_numel += sign * u.padded_numel
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def start(self, u: FetchUnit) -> None:
        """Launch *u*'s all-gather if it is released (no-op otherwise)."""
        if u.state != "released":
            return
        full = torch.empty(u.padded_numel, dtype=u.part.dtype, device=u.part.device)
        if self.comm.world_size == 1:
            full.copy_(u.part)
            u.handle = None
        else:
            u.handle = self.comm.all_gather_into(full, u.part, async_op=True)
        u.full = full
        u.state = "inflight"
        self.gathers += 1
        self._count(u, +1)

    def wait(self, u: FetchUnit) -> None:
        """Make *u*'s parameters available (starting its gather if needed)."""
        if u.state == "gathered":
            return
        if u.state == "released":
            self.start(u)
        if u.handle is not None:
            u.handle.wait()
            u.handle = None
        full = u.full
        for p, off in zip(u.params, u.offsets):
            meta = pp.meta_of(p)
            pp.attach(p, full.narrow(0, off, meta.numel))
        u.state = "gathered"

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
        if u.state == "released":
            return
        if u.handle is not None:
            u.handle.wait()
            u.handle = None
        for p in u.params:
            pp.release(p)
        u.full = None
        u.state = "released"
        self._count(u, -1)

    def write_back(self, u: FetchUnit) -> None:
        """After the gathered values of *u* were modified (identically on every rank):
        copy this rank's slice into the partition, and into the fp32 master slice."""
        shard = u.padded_numel // self.comm.world_size
        mine = u.full.narrow(0, self.comm.rank * shard, shard)
        u.part.copy_(mine)
        if u.master_part is not None:
            u.master_part.copy_(mine)
