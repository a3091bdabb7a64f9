"""The local squared gradient norm, without a full-size float32 copy and without float32's
error on long sums.

``torch.linalg.vector_norm(t, dtype=torch.float32)`` casts the whole of a bf16/fp16 *t* to
float32 first: a temporary twice the gradient partition's size, at every step. For a
4 B-parameter model on 2 ranks that is 8 GB per rank on top of the 4 GB partition — the
peak of the whole step (found by ci/bench/infinity.py). And on the CPU its float32
accumulation over a long tensor drifts: 4e-3 relative on 33M elements (measured). So every
tensor is reduced in chunks of ``CHUNK`` elements — each chunk's norm in float32, squared
and summed in float64 — which bounds the temporary to one chunk and the error to about
2e-4 relative (measured on 4M-element chunks; ``x.square().sum()`` would be exact to 1e-8
but 4x slower, and this runs over the whole partition every step).
"""
from __future__ import annotations

import torch

#: elements per chunk (16 MB of float32)
CHUNK = 1 << 22


def squared_norm(tensors) -> torch.Tensor:
    """Σ‖t‖² over *tensors*, as a float64 scalar on their device (float32 accumulation
    within each chunk, float64 across chunks)."""
    parts = []
    staging = None   # one float32 chunk, reused: a cast per chunk left each copy to the
    #                  allocator, which kept them (RSS grew by the whole partition, measured)
    for t in tensors:
        flat = t.reshape(-1)
        for lo in range(0, flat.numel(), CHUNK):
            piece = flat[lo:lo + CHUNK]
            if piece.element_size() < 4:
                if staging is None or staging.device != piece.device:
                    staging = torch.empty(CHUNK, dtype=torch.float32, device=piece.device)
                piece = staging[:piece.numel()].copy_(piece)
            parts.append(torch.linalg.vector_norm(piece, dtype=torch.float32))
    return torch.stack(parts).double().square().sum()
