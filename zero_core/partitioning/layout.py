"""Partition arithmetic: where each parameter, bucket and rank slice sits in a flat buffer.

Plain functions and frozen dataclasses only, so that tests can call them directly.

Layout of one parameter group (all sizes in elements):

- the trainable parameters are packed back to back, in the order given (the engine passes
  reverse registration order, the order backward produces gradients), with no gaps;
- the packed run is cut into buckets of a constant size ``B`` (the configured
  ``reduce_bucket_size`` rounded up to a multiple of ``world_size * alignment``); the last
  bucket is shorter, padded up to the next multiple of ``world_size * alignment``;
- every bucket is split into ``world_size`` equal slices: rank ``r`` owns slice ``r`` of
  every bucket. A rank's *partition* is its slices of all buckets, concatenated.

A parameter may straddle two (or more) buckets; it is then described by one
:class:`Segment` per bucket. Padding exists only at the end of the group: fewer than
``world_size * alignment`` elements per group.
"""
from __future__ import annotations

from dataclasses import dataclass

from zero_core.errors import ConfigError


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of *multiple* that is >= *n* (elements)."""
    return -(-n // multiple) * multiple


def padding_bound(world_size: int, alignment: int) -> int:
    """Most padding elements one group's flat buffer can carry: world_size * alignment - 1."""
    return world_size * alignment - 1


@dataclass(frozen=True)
class Segment:
    """The part ``[param_lo, param_hi)`` of parameter ``param`` (flattened) that lies in
    bucket ``bucket`` at offset ``bucket_lo``."""

    param: int
    bucket: int
    param_lo: int
    param_hi: int
    bucket_lo: int

    @property
    def numel(self) -> int:
        return self.param_hi - self.param_lo


@dataclass(frozen=True)
class GroupLayout:
    """Where everything of one parameter group lives; see the module docstring."""

    numels: tuple[int, ...]          # per parameter, in layout order
    offsets: tuple[int, ...]         # start of each parameter in the full flat buffer
    bucket_starts: tuple[int, ...]   # start of each bucket in the full flat buffer
    bucket_sizes: tuple[int, ...]    # padded sizes, multiples of world_size * alignment
    world_size: int
    alignment: int
    segments: tuple[Segment, ...]    # ordered by bucket, then by offset

    @property
    def numel(self) -> int:
        """Elements of real parameters (no padding)."""
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        """Elements of the full flat buffer, padding included."""
        return sum(self.bucket_sizes)

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    @property
    def partition_numel(self) -> int:
        """Elements one rank owns (its slice of every bucket)."""
        return self.padded_numel // self.world_size

    def shard_size(self, bucket: int) -> int:
        """Elements of one rank's slice of *bucket*."""
        return self.bucket_sizes[bucket] // self.world_size

    def shard_start(self, bucket: int, rank: int) -> int:
        """Start of *rank*'s slice of *bucket* in the full flat buffer."""
        return self.bucket_starts[bucket] + rank * self.shard_size(bucket)

    def partition_start(self, bucket: int) -> int:
        """Start of *bucket*'s slice inside a rank's (concatenated) partition."""
        return self.bucket_starts[bucket] // self.world_size

    def segments_of_param(self, param: int) -> list[Segment]:
        return [s for s in self.segments if s.param == param]

    def segments_of_bucket(self, bucket: int) -> list[Segment]:
        return [s for s in self.segments if s.bucket == bucket]


def bucket_size_for(reduce_bucket_size: int, world_size: int, alignment: int) -> int:
    """The constant bucket size: *reduce_bucket_size* rounded up to a multiple of
    ``world_size * alignment`` (elements)."""
    if reduce_bucket_size < 1:
        raise ConfigError(f"zero_optimization.reduce_bucket_size={reduce_bucket_size} must be a "
                          f"positive number of elements (e.g. 50000000)")
    return round_up(reduce_bucket_size, world_size * alignment)


def plan_group_layout(numels, reduce_bucket_size: int, world_size: int,
                      alignment: int) -> GroupLayout:
    """Lay out parameters of *numels* elements (in that order) into buckets; see module doc."""
    numels = tuple(int(n) for n in numels)
    if world_size < 1 or alignment < 1:
        raise ValueError(f"world_size={world_size} and alignment={alignment} must be >= 1")
    if any(n < 1 for n in numels):
        raise ValueError(f"every parameter needs at least one element, got numels {numels}")
    total = sum(numels)
    quantum = world_size * alignment
    full = bucket_size_for(reduce_bucket_size, world_size, alignment)
    starts, sizes = [], []
    pos = 0
    while pos < total:
        size = min(full, round_up(total - pos, quantum))
        starts.append(pos)
        sizes.append(size)
        pos += size
    offsets, off = [], 0
    for n in numels:
        offsets.append(off)
        off += n
    segments = []
    bucket = 0
    for i, (n, start) in enumerate(zip(numels, offsets)):
        lo = start
        while lo < start + n:
            while lo >= starts[bucket] + sizes[bucket]:
                bucket += 1
            hi = min(start + n, starts[bucket] + sizes[bucket])
            segments.append(Segment(i, bucket, lo - start, hi - start, lo - starts[bucket]))
            lo = hi
    segments.sort(key=lambda s: (s.bucket, s.bucket_lo))
    return GroupLayout(numels, tuple(offsets), tuple(starts), tuple(sizes), world_size,
                       alignment, tuple(segments))


def alignment_for(element_size: int, alignment_bytes: int = 64) -> int:
    """Elements per alignment unit, so that every rank slice starts on *alignment_bytes*."""
    return max(1, alignment_bytes // element_size)
