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


#: low-precision pieces longer than this are widened through one reused float32 buffer;
#: the rest go to one _foreach_norm call (its float32 temporaries stay small)
STAGED = 1 << 16


class PieceNorms:
    """The L2 norm of each of a fixed list of *pieces* (each at most ``CHUNK`` elements), in
    float32: one ``_foreach_norm`` call for most, a reused float32 buffer for long
    low-precision ones (a cast per piece left each copy to the allocator, which kept them:
    RSS grew by the whole partition, measured). Which piece goes which way is decided once."""

    def __init__(self, pieces: list[torch.Tensor]):
        self.pieces = pieces
        self.staged = [i for i, p in enumerate(pieces) if p.element_size() < 4
                       and p.numel() > STAGED]
        staged = set(self.staged)
        self.direct = [i for i in range(len(pieces)) if i not in staged]
        self._staging = None

    def __call__(self) -> torch.Tensor:
        """A float32 vector on the pieces' device (pieces must not be empty)."""
        if not self.staged:
            return torch.stack(torch._foreach_norm(self.pieces, 2, dtype=torch.float32))
        out: list = [None] * len(self.pieces)
        if self.direct:
            for i, n in zip(self.direct, torch._foreach_norm(
                    [self.pieces[i] for i in self.direct], 2, dtype=torch.float32)):
                out[i] = n
        for i in self.staged:
            p = self.pieces[i]
            if self._staging is None or self._staging.device != p.device:
                self._staging = torch.empty(CHUNK, dtype=torch.float32, device=p.device)
            out[i] = torch.linalg.vector_norm(self._staging[:p.numel()].copy_(p))
        return torch.stack(out)


def squared_norm(tensors) -> torch.Tensor:
    """Σ‖t‖² over *tensors*, as a float64 scalar on their device (float32 accumulation
    within each ``CHUNK``, float64 across chunks)."""
    pieces = [flat[lo:lo + CHUNK] for t in tensors for flat in (t.reshape(-1),)
              for lo in range(0, flat.numel(), CHUNK)]
    return PieceNorms(pieces)().double().square().sum()
