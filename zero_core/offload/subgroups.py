"""Sub-groups: the slices of a rank's partition that the offloaded optimizer steps at once.

A rank's partition of one parameter group is its slice of every bucket, concatenated
(zero_core/partition.py); positions in it are *partition elements*. The offloaded
optimizer cuts the partition into sub-groups of at most ``sub_group_size`` elements, cut
at multiples of ``QUANTUM`` elements so that every sub-group but the last starts and ends
on a 4 KiB boundary of an fp32 swap file (O_DIRECT transfers). A sub-group can cover
several buckets and a bucket several sub-groups; :func:`pieces` says which part of which
bucket's slice each part of a sub-group is (gradients are read and updated parameters
written bucket by bucket).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from zero_core.partitioning.layout import GroupLayout

#: sub-group boundaries are multiples of this many elements (4 KiB of fp32)
QUANTUM = 1024


@dataclass(frozen=True)
class Piece:
    """Elements ``[sub_offset, sub_offset + numel)`` of a sub-group are elements
    ``[shard_offset, shard_offset + numel)`` of this rank's slice of bucket ``bucket``."""

    bucket: int
    shard_offset: int
    sub_offset: int
    numel: int


@dataclass(frozen=True)
class SubGroup:
    """Partition elements ``[lo, lo + numel)`` of parameter group ``group``."""

    group: int
    index: int
    lo: int
    numel: int
    pieces: tuple

    @property
    def hi(self) -> int:
        return self.lo + self.numel


def subgroup_bounds(partition_numel: int, sub_group_size: int) -> list[tuple[int, int]]:
    """(start, elements) of each sub-group of a partition of *partition_numel* elements:
    at most *sub_group_size* elements each (but at least QUANTUM), cut at multiples of
    QUANTUM."""
    if sub_group_size < 1:
        raise ValueError(f"sub_group_size={sub_group_size} must be >= 1")
    size = max(QUANTUM, sub_group_size // QUANTUM * QUANTUM)
    return [(lo, min(size, partition_numel - lo)) for lo in range(0, partition_numel, size)]


def pieces(layout: GroupLayout, lo: int, numel: int) -> tuple[Piece, ...]:
    """The bucket pieces of partition elements ``[lo, lo + numel)`` of *layout*."""
    starts = [layout.partition_start(k) for k in range(layout.num_buckets)]
    out = []
    pos, hi = lo, lo + numel
    k = bisect.bisect_right(starts, pos) - 1
    while pos < hi:
        while layout.shard_size(k) == 0 or pos >= starts[k] + layout.shard_size(k):
            k += 1
        end = min(hi, starts[k] + layout.shard_size(k))
        out.append(Piece(k, pos - starts[k], pos - lo, end - pos))
        pos = end
    return tuple(out)


def plan_subgroups(layouts: list[GroupLayout | None], sub_group_size: int) -> list[SubGroup]:
    """Every sub-group of every parameter group (None: a group without trainable
    parameters), in stepping order: group by group, partition order within a group."""
    out = []
    for j, lay in enumerate(layouts):
        if lay is None:
            continue
        for i, (lo, n) in enumerate(subgroup_bounds(lay.partition_numel, sub_group_size)):
            out.append(SubGroup(j, i, lo, n, pieces(lay, lo, n)))
    return out
