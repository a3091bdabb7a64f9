"""hpZ: a secondary partition of every fetch unit inside each group of H ranks (normally
the ranks of one node), so that re-gathers after the first one in a step stay in the node.

Rank *r* (index ``i`` in its hpZ group of H consecutive ranks) keeps, for each
non-persistent unit of padded size P, the elements ``[i·P/H, (i+1)·P/H)`` — its 1/H share
of the whole unit, where its primary partition is only 1/N. The copy is taken from the
first gather of the unit after the partitions changed (the forward's world-wide gather, qwZ
quantized or not) and is valid until the next optimizer step or checkpoint restore
(``invalidate_all``) or a GatheredParameters write-back of that unit (``refresh``). While
valid, a gather of the unit — the backward's, a recompute's, a later micro-batch's — is an
``all_gather_into`` of the secondary shards over the hpZ group, in the compute dtype.

Cost: one extra partition per rank, P/H elements of the compute dtype per unit, in one
flat buffer (``nbytes``); persistent units have none (they stay gathered for the step).

Every rank sees the same sequence of gathers and invalidations (same program), so all
ranks agree on which units are valid and issue the same collectives.
"""
from __future__ import annotations

import logging

import torch

from zero_core.interfaces.communicator import Communicator, Group

log = logging.getLogger("zero_core.zeropp")


def hpz_group(comm: Communicator, size: int) -> Group:
    """Collective: the group of *size* consecutive ranks holding this rank's secondary
    partition — the intra-node group when *size* is the ranks per node."""
    topo = comm.topology
    if size == topo.ranks_per_node:
        return comm.intra_node_group()
    blocks = [list(range(s, s + size)) for s in range(0, comm.world_size, size)]
    group = comm.split(blocks, f"hpz{size}")
    if group.spans_nodes:
        log.warning("hpZ: zero_hpz_partition_size=%d is larger than the %d ranks per node, so "
                    "its groups span nodes and backward gathers still cross the network; set "
                    "it to the ranks per node", size, topo.ranks_per_node)
    return group


class SecondaryPartitions:
    """The secondary shards of *units* (non-persistent ones) for this rank's hpZ *group*."""

    def __init__(self, comm: Communicator, group: Group, units, dtype: torch.dtype,
                 device: torch.device):
        self.comm, self.group = comm, group
        self.size, self.index = group.size, group.rank
        self._offset: dict[int, int] = {}
        total = 0
        for u in units:
            if u.persistent:
                continue
            self._offset[u.index] = total
            total += u.padded_numel // self.size
        self.buffer = torch.empty(total, dtype=dtype, device=device)
        self._valid: set[int] = set()
        self._lossy: set[int] = set()
        self.epoch = 0   # bumped by invalidate_all: a refresh started before is dropped
        self.gathers = 0
        self.refreshes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the secondary partitions of this rank."""
        return self.buffer.numel() * self.buffer.element_size()

    def holds(self, u) -> bool:
        return u.index in self._offset

    def shard(self, u) -> torch.Tensor:
        n = u.padded_numel // self.size
        return self.buffer.narrow(0, self._offset[u.index], n)

    def valid(self, u) -> bool:
        return u.index in self._valid

    def lossy(self, u) -> bool:
        """True when the valid secondary copy holds qwZ-dequantized (not exact) values."""
        return u.index in self._lossy

    def refresh(self, u, full: torch.Tensor, lossy: bool, epoch: int | None = None) -> None:
        """Take this rank's secondary shard from the gathered *full* unit — unless *epoch*
        (when the gather started) is older than the last invalidation (a gather still in
        flight across an optimizer step carries the old values)."""
        if epoch is not None and epoch != self.epoch:
            return
        n = u.padded_numel // self.size
        self.shard(u).copy_(full.narrow(0, self.index * n, n))
        self._valid.add(u.index)
        (self._lossy.add if lossy else self._lossy.discard)(u.index)
        self.refreshes += 1

    def gather(self, u, full: torch.Tensor):
        """Start the node-local all-gather of *u* from the secondary shards into *full*."""
        self.gathers += 1
        return self.comm.all_gather_into(full, self.shard(u), group=self.group, async_op=True)

    def invalidate(self, u) -> None:
        """*u*'s partition changed (a write-back whose values are not all in hand exactly)."""
        self._valid.discard(u.index)
        self._lossy.discard(u.index)

    def invalidate_all(self) -> None:
        """The partitions changed (optimizer step, checkpoint restore)."""
        self.epoch += 1
        self._valid.clear()
        self._lossy.clear()
