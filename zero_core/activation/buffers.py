"""Contiguous, reused buffers for checkpointed activations (ZeRO-R's defragmentation).

``contiguous_memory_optimization`` keeps the saved (partitioned) inputs of checkpoint *k*
in buffer *k* of ``number_checkpoints`` byte buffers. A buffer is allocated the first time
it is used, sized for that checkpoint's payload, and reused by the same checkpoint in every
later step: the long-lived saved activations stop interleaving with short-lived tensors in
the allocator, so memory does not fragment. A buffer is only reallocated when a later
payload does not fit (counted in :attr:`SlotBuffers.reallocations`).

A checkpoint claims the lowest free buffer in forward and releases it at the end of its
backward. A buffer also becomes free when the autograd graph that claimed it is dropped
without a backward (the claim is held through a weak reference). So in a training step the
k-th checkpointed call gets buffer k, and pipelined schedules that keep several
micro-batches' graphs alive reuse the buffers of finished ones.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from zero_core.errors import ZeroCoreError


@dataclass
class _Slot:
    buffer: torch.Tensor | None = None
    holder: "weakref.ref | None" = None  # the claim's token (see SlotBuffers.claim)
    released: bool = True


class SlotBuffers:
    """*count* reusable uint8 buffers on *device*; *pin* (optional) turns a fresh host
    buffer into a page-locked one."""

    def __init__(self, count: int, device: torch.device,
                 pin: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if count < 1:
            raise ValueError(f"count={count} must be >= 1")
        self.count = count
        self.device = torch.device(device)
        self._pin = pin
        self._slots = [_Slot() for _ in range(count)]
        self._lock = threading.Lock()
        self.allocations = 0     # buffers allocated, first uses included
        self.reallocations = 0   # of those, buffers replaced because a payload outgrew them

    def _is_free(self, slot: _Slot) -> bool:
        return slot.released or slot.holder is None or slot.holder() is None

    def claim(self, nbytes: int, token: object) -> tuple[int, torch.Tensor]:
        """Hold the lowest free buffer for *token* (any weak-referenceable object that lives
        as long as the checkpoint's autograd node); return its index and a view of its
        first *nbytes* bytes. Raises ZeroCoreError when every buffer is held."""
        with self._lock:
            for index, slot in enumerate(self._slots):
                if self._is_free(slot):
                    break
            else:
                raise ZeroCoreError(
                    f"activation checkpointing: all number_checkpoints={self.count} contiguous "
                    f"buffers hold checkpoints whose backward has not run yet, and another "
                    f"checkpointed call needs one. Set activation_checkpointing.number_checkpoints "
                    f"to at least the number of checkpointed calls in one forward pass (times "
                    f"the micro-batches whose backward is pending at once), or call "
                    f"zero_core.checkpointing.reset() after forward passes that are never "
                    f"followed by backward (evaluation with gradients enabled)")
            if slot.buffer is None or slot.buffer.numel() < nbytes:
                if slot.buffer is not None:
                    self.reallocations += 1
                slot.buffer = None  # let the old one go before allocating the new one
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                if self._pin is not None:
                    buffer = self._pin(buffer)
                slot.buffer = buffer
                self.allocations += 1
            slot.holder = weakref.ref(token)
            slot.released = False
            return index, slot.buffer[:nbytes]

    def holds(self, index: int, token: object) -> bool:
        """Whether buffer *index* still holds *token*'s data (not claimed by another since)."""
        slot = self._slots[index]
        return slot.holder is not None and slot.holder() is token

    def release(self, index: int, token: object) -> None:
        """Mark buffer *index* free for the next claim, if *token* still holds it. Its
        bytes stay intact until then (a retained graph can still read them)."""
        with self._lock:
            if self.holds(index, token):
                self._slots[index].released = True

    def release_all(self) -> None:
        """Mark every buffer free (see ``zero_core.checkpointing.reset``)."""
        with self._lock:
            for slot in self._slots:
                slot.released = True

    def describe(self) -> list[dict]:
        """One entry per allocated buffer: index, bytes, data pointer, whether held."""
        return [{"index": i, "nbytes": s.buffer.numel(), "data_ptr": s.buffer.data_ptr(),
                 "held": not self._is_free(s)}
                for i, s in enumerate(self._slots) if s.buffer is not None]

    @property
    def total_bytes(self) -> int:
        """Bytes of all allocated buffers."""
        return sum(s.buffer.numel() for s in self._slots if s.buffer is not None)
