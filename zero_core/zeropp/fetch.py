"""The stage-3 gather strategy with qwZ and hpZ: which collective brings a unit's values.

For each gather the stage-3 ``UnitGatherer`` starts (``launch(u, for_compute)``):

1. hpZ's secondary copy of the unit is valid and good enough → node-local all-gather of
   the secondary shards (hpz.py). "Good enough": exact values, or qwZ-dequantized ones
   when the gather is for forward/backward compute (``for_compute``);
2. otherwise a world-wide gather: qwZ-quantized (qwz.py) when the gather is for compute,
   the unit is not persistent and qwZ covers it (``zero_quantized_weights``: every unit;
   ``zero_quantized_nontrainable_weights``: frozen units), else the plain all-gather;
   hpZ then refreshes its secondary copy from the result.

Exact gathers (GatheredParameters, consolidated state dicts) are never quantized, and
persistent units (small parameters, gathered once per step; their bytes are negligible)
neither, so saved models never carry quantization error.

``write_back(u)`` (after GatheredParameters modified a unit; every rank holds the same
modified values): copies this rank's slice into its partition and fp32 master. If the
unit's gathered copy was quantized, only the elements that differ from what the
quantized gather delivered are taken (elements left alone keep their exact partition
value instead of its rounded copy); a modified value that happens to equal its rounded
copy is indistinguishable from an untouched one and keeps the exact old value, which
is within half a quantization step of it.
"""
from __future__ import annotations

import torch

from zero_core.interfaces.communicator import Communicator
from zero_core.zeropp.handles import Then
from zero_core.zeropp.hpz import SecondaryPartitions
from zero_core.zeropp.qwz import QuantizedGather


class UnitFetch:
    """The gather strategy handed to ``UnitGatherer(strategy=...)`` (see module docstring)."""

    def __init__(self, comm: Communicator, qwz: QuantizedGather | None, quantize_frozen_only: bool,
                 hpz: SecondaryPartitions | None):
        self.comm, self.qwz, self.hpz = comm, qwz, hpz
        self.quantize_frozen_only = quantize_frozen_only
        self._lossy: dict[int, bool] = {}   # unit index -> its gathered copy is quantized
        self.exact_gathers = 0

    def quantizes(self, u) -> bool:
        """Whether compute gathers of *u* are qwZ-quantized."""
        if self.qwz is None or u.persistent:
            return False
        return not u.trainable if self.quantize_frozen_only else True

    def launch(self, u, for_compute: bool):
        """Start gathering *u*; returns ``(full, handle)`` for the stage-3 gatherer."""
        full = torch.empty(u.padded_numel, dtype=u.part.dtype, device=u.part.device)
        if self.comm.world_size == 1:
            full.copy_(u.part)
            self._lossy[u.index] = False
            return full, None
        sec = self.hpz if self.hpz is not None and self.hpz.holds(u) else None
        if sec is not None and sec.valid(u) and (for_compute or not sec.lossy(u)):
            self._lossy[u.index] = sec.lossy(u)
            return full, sec.gather(u, full)
        lossy = for_compute and self.quantizes(u)
        if lossy:
            handle = self.qwz.gather(u.part, full)
        else:
            handle = self.comm.all_gather_into(full, u.part, async_op=True)
            self.exact_gathers += 1
        self._lossy[u.index] = lossy
        if sec is not None and not sec.valid(u):
            epoch = sec.epoch
            handle = Then(handle, lambda: sec.refresh(u, full, lossy, epoch))
        return full, handle

    @torch.no_grad()
    def write_back(self, u) -> None:
        """See the module docstring."""
        shard = u.padded_numel // self.comm.world_size
        mine = u.full.narrow(0, self.comm.rank * shard, shard)
        if self._lossy.get(u.index, False):
            delivered = self.qwz.roundtrip(u.part)
            changed = mine != delivered
            u.part.copy_(torch.where(changed, mine, u.part))
            if u.master_part is not None:
                u.master_part.copy_(torch.where(changed, mine.float(), u.master_part))
        else:
            u.part.copy_(mine)
            if u.master_part is not None:
                u.master_part.copy_(mine)
        if self.hpz is not None and self.hpz.holds(u):
            if self._lossy.get(u.index, False):
                self.hpz.invalidate(u)   # the next compute gather quantizes the new partition
            else:
                self.hpz.refresh(u, u.full, False)
