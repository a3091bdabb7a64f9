"""Byte layout of the inputs an activation checkpoint stores (ZeRO-R).

A checkpoint that partitions, offloads or defragments its saved inputs packs them into one
flat ``uint8`` *payload*. Each tensor is cut into ``parts`` equal byte chunks (``parts`` is
the model-parallel group size, or 1 when not partitioning); a rank stores chunk
``part_index`` of every tensor, one after another, each starting at a multiple of
:data:`ALIGN` bytes so that it can be viewed back as any dtype without a copy.

In backward the payloads of all ``parts`` ranks, stacked as a ``(parts, payload_bytes)``
byte matrix (the all-gather's output), give back every tensor: column range
``[offset, offset + chunk)`` of all rows, concatenated, truncated to the tensor's size.

Only bytes are moved, so any dtype (float, int, bool) goes through the same path and the
collective is one ``uint8`` all-gather per checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

#: every chunk starts at a multiple of this many bytes (covers every dtype's alignment and
#: a cache line, so that chunks can be reinterpreted as float64/int64/complex in place)
ALIGN = 64


@dataclass(frozen=True)
class PieceSpec:
    """Where one saved tensor lives in the payload. Sizes in bytes."""

    shape: torch.Size
    dtype: torch.dtype
    nbytes: int   # bytes of the whole tensor
    chunk: int    # bytes each part stores (aligned; chunk * parts >= nbytes)
    offset: int   # start of this tensor's chunk in every part's payload


def chunk_bytes(nbytes: int, parts: int) -> int:
    """Bytes of one part's chunk of an *nbytes* tensor cut into *parts*: the ceiling
    share, rounded up to :data:`ALIGN` (0 for an empty tensor)."""
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    if nbytes == 0:
        return 0
    share = -(-nbytes // parts)
    return -(-share // ALIGN) * ALIGN


def plan(tensors: Sequence[torch.Tensor], parts: int) -> tuple[list[PieceSpec], int]:
    """The layout of *tensors* cut into *parts*: one spec per tensor and the payload size
    (bytes) every part stores."""
    specs, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        chunk = chunk_bytes(nbytes, parts)
        specs.append(PieceSpec(t.shape, t.dtype, nbytes, chunk, offset))
        offset += chunk
    return specs, offset


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of *t* (made contiguous) as a flat uint8 view."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def write_part(dest: torch.Tensor, tensors: Sequence[torch.Tensor], specs: Sequence[PieceSpec],
               part_index: int) -> None:
    """Copy chunk *part_index* of every tensor into the uint8 buffer *dest* at its offset.

    Padding bytes are left as they are: :func:`read_all` never reads them.
    """
    non_blocking = dest.device.type == "cpu" and dest.is_pinned()
    for t, spec in zip(tensors, specs):
        lo = part_index * spec.chunk
        hi = min(lo + spec.chunk, spec.nbytes)
        if hi > lo:
            dest[spec.offset:spec.offset + hi - lo].copy_(as_bytes(t)[lo:hi],
                                                          non_blocking=non_blocking)


def read_all(parts_matrix: torch.Tensor, specs: Sequence[PieceSpec]) -> list[torch.Tensor]:
    """Rebuild every tensor from a ``(parts, payload_bytes)`` uint8 matrix.

    With one part the results are views of the matrix (no copy); with more, each tensor
    is assembled from its chunks in one copy.
    """
    parts = parts_matrix.shape[0]
    out = []
    for spec in specs:
        if spec.nbytes == 0:
            out.append(torch.empty(spec.shape, dtype=spec.dtype, device=parts_matrix.device))
            continue
        if parts == 1:
            raw = parts_matrix[0, spec.offset:spec.offset + spec.nbytes]
        else:
            raw = parts_matrix[:, spec.offset:spec.offset + spec.chunk].reshape(-1)[:spec.nbytes]
        out.append(raw.view(spec.dtype).view(spec.shape))
    return out
