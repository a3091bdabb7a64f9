"""Staging: collectives on tensors that live where the communicator cannot reach.

Two directions, one mechanism:

* device tensors over a host communicator (MPI without a device-aware transport, gloo, on
  a GPU or vdev job): copy device -> pinned host buffer, run the collective on the host
  buffers, copy back — what a GPU job without GPUDirect does;
* host tensors over a device-only communicator (nccl, hccl, xccl): the engine's small
  control-plane collectives (checkpoint agreement, metadata) run on the host; they are
  copied to device buffers and back.

:class:`Staging` owns the stand-in buffers (pinned host ones reused across calls, since
ZeRO's buckets have a constant size) and counts what the copies cost, so that the ledger
reports it next to the bytes on the wire (``staged_bytes``, ``staging_s``). The
communicator base class stages a tensor whose device type is not in its ``device_types``
when :meth:`Staging.handles` it.
"""
from __future__ import annotations

import threading
import time

import torch


class Staging:
    """Stand-in buffers and copy accounting for one accelerator and one communicator."""

    def __init__(self, accelerator, device, backend_device_types, max_free: int = 8):
        self.accelerator = accelerator
        self.device = torch.device(device)          # the job's device (stand-ins of host data)
        self.device_type = accelerator.device_type()
        #: device tensors go through pinned host buffers
        self.via_host = self.device_type not in backend_device_types and "cpu" in backend_device_types
        #: host tensors go through device buffers
        self.via_device = "cpu" not in backend_device_types and self.device_type in backend_device_types
        self._free: list[torch.Tensor] = []
        self._max_free = max_free
        self._lock = threading.Lock()

    def handles(self, tensor: torch.Tensor) -> bool:
        kind = tensor.device.type
        return (self.via_host and kind == self.device_type) or (self.via_device and kind == "cpu")

    # ---- buffers ---------------------------------------------------------------------
    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(stand-in shaped like *like* on the other side, pinned buffer to give back or
        None). Host stand-ins come from a pool of pinned buffers; device stand-ins are the
        rare small control-plane tensors and are allocated per call."""
        if like.device.type == "cpu":
            return torch.empty_like(like, device=self.device), None
        nbytes = like.numel() * like.element_size()
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if buf is None:
            buf = self.accelerator.pin_memory(torch.empty(max(nbytes, 1), dtype=torch.uint8))
        host = buf[:nbytes].view(like.dtype).view(like.shape)
        return host, buf

    def give_back(self, buf: torch.Tensor | None) -> None:
        if buf is None:
            return
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._max_free:  # keep the largest
                self._free.sort(key=torch.Tensor.numel)
                self._free.pop(0)

    # ---- copies (timed; the device is synchronized so the time is the copy's) -----------
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[int, float]:
        t0 = time.perf_counter()
        dst.copy_(src)
        self.accelerator.synchronize()
        return dst.numel() * dst.element_size(), time.perf_counter() - t0


class StagedCall:
    """One collective's staging: stand-ins for its tensors, filled before the collective
    and copied back after it; ``bytes`` and ``seconds`` accumulate what the copies cost."""

    def __init__(self, staging: Staging):
        self.staging = staging
        self._buffers: list[torch.Tensor] = []
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.bytes = 0
        self.seconds = 0.0

    def stand_in(self, tensor: torch.Tensor, read: bool = True,
                 written: bool = False) -> torch.Tensor:
        """The stand-in of *tensor* where the communicator can reach it: filled from it
        when the collective *read*s it, copied back into it when the collective writes it."""
        other, buf = self.staging.take(tensor)
        self._buffers.append(buf)
        if read:
            self._count(self.staging.copy(other, tensor))
        if written:
            self._copy_back.append((tensor, other))
        return other

    def finish(self) -> None:
        """After the collective: results back to the device, buffers back to the pool."""
        try:
            for tensor, other in self._copy_back:
                self._count(self.staging.copy(tensor, other))
        finally:
            for buf in self._buffers:
                self.staging.give_back(buf)
            self._buffers.clear()
            self._copy_back.clear()

    def _count(self, cost: tuple[int, float]) -> None:
        self.bytes += cost[0]
        self.seconds += cost[1]
