"""Reusable communication buffers of one constant size (ZeRO-R's constant buffers).

Collectives in flight need somewhere to put their output (or their input, for the
all-gather of updated parameters). Instead of allocating per bucket, buffers of the
largest bucket's size are recycled; the pool only grows when every buffer is busy and
the caller has nothing in flight it could wait for.
"""
from __future__ import annotations

from typing import Callable

import torch


class BufferPool:
    """Flat buffers of *numel* elements of *dtype*; ``take(n)`` gives an *n*-element view."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device,
                 on_allocate: Callable[[torch.Tensor], None] | None = None):
        self.numel, self.dtype, self.device = numel, dtype, device
        self._free: list[torch.Tensor] = []
        self._owner: dict[int, torch.Tensor] = {}   # id(view) -> base buffer
        self._on_allocate = on_allocate
        self.allocated = 0

    def take(self, n: int, make_room: Callable[[], bool] | None = None) -> torch.Tensor:
        """A view of *n* elements. If none is free, *make_room()* is called (it should
        finish one in-flight operation and return True, or return False if nothing is in
        flight) before a new buffer is allocated."""
        if n > self.numel:
            raise ValueError(f"buffer of {n} elements asked from a pool of {self.numel}")
        while not self._free and make_room is not None and make_room():
            pass
        if self._free:
            base = self._free.pop()
        else:
            base = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.allocated += 1
            if self._on_allocate is not None:
                self._on_allocate(base)
        view = base.narrow(0, 0, n)
        self._owner[id(view)] = base
        return view

    def release(self, view: torch.Tensor) -> None:
        """Give back a view obtained from :meth:`take`."""
        self._free.append(self._owner.pop(id(view)))
