"""Keep autograd from holding gathered parameters between forward and backward.

Autograd saves what backward needs: for ``F.linear`` on the CPU that is ``weight.t()``,
a *view* of the gathered flat buffer of the weight's fetch unit. A view holds its
storage, so without this module every unit gathered in forward would stay in memory
until its backward, however early the coordinator releases it — the live window would be
the whole model, exactly what stage 3 exists to avoid.

While the root module's forward runs, :class:`SavedViews` is installed as autograd's
saved-tensor hooks. A saved tensor whose storage is the gathered buffer of a unit is
packed as *(unit, offset, size, stride)* — no reference to the buffer — and unpacked in
backward as the same view of the unit's buffer as gathered again for backward (the
module's backward hook gathers it just before; if nothing did, unpacking gathers it
itself, so a missing hook costs time, never correctness). The gathered values are the
same in forward and backward: the same partitions gathered by the same collective.

A graph from before an optimizer step cannot be replayed after it (the partitions
changed): unpacking such a view raises :class:`~zero_core.errors.ZeroCoreError` instead
of silently using the new values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_core.errors import ZeroCoreError
from zero_core.stage3.units import FetchUnit, UnitState


@dataclass(frozen=True)
class _UnitView:
    unit: FetchUnit
    offset: int          # elements from the start of the unit's gathered buffer
    size: tuple
    stride: tuple
    epoch: int           # the coordinator's partition_epoch when it was saved


class SavedViews:
    """Saved-tensor hooks of one stage-3 engine (see the module docstring)."""

    def __init__(self, coordinator):
        self.coord = coordinator
        self.gatherer = coordinator.gatherer
        self._contexts: list = []
        self.packed = 0      # views packed since construction (tests read it)

    # ---- installation around the root forward -------------------------------------------
    def enter(self) -> None:
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._contexts.append(ctx)

    def exit(self) -> None:
        if self._contexts:
            self._contexts.pop().__exit__(None, None, None)

    # ---- the hooks --------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        live = self.gatherer.live_storage
        if not live or t.layout is not torch.strided or t.device.type == "meta":
            return t
        try:
            address = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensor kinds without a plain storage
            return t
        u = live.get(address)
        if u is None or u.full is None or t.dtype != u.full.dtype:
            return t
        self.packed += 1
        return _UnitView(u, t.storage_offset() - u.full.storage_offset(), tuple(t.size()),
                         tuple(t.stride()), self.coord.partition_epoch)

    def _unpack(self, packed):
        if type(packed) is not _UnitView:
            return packed
        u = packed.unit
        if packed.epoch != self.coord.partition_epoch:
            raise ZeroCoreError(
                f"backward through a graph recorded before the last optimizer step: at "
                f"stage 3 the parameters {u.names[:3]} were gathered for that forward and "
                f"have been updated since. Run backward before engine.step(), or run the "
                f"forward again.")
        if u.state is not UnitState.GATHERED:
            with self.gatherer.computing():
                self.gatherer.ensure([u])
        full = u.full
        return full.as_strided(packed.size, packed.stride,
                               full.storage_offset() + packed.offset)
