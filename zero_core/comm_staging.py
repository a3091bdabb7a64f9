"""Host staging: collectives on device tensors over a communicator that carries host memory.

MPI without a device-aware transport, gloo, and any communicator whose ``device_types``
lack the accelerator's device move device tensors the way a GPU job without GPUDirect
does: copy device -> pinned host buffer, run the collective on the host buffers, copy
host -> device. :class:`HostStaging` owns the pinned buffers (reused across calls, since
ZeRO's buckets have a constant size) and counts what the copies cost, so that the
ledger can report it next to the bytes on the wire (``staged_bytes``, ``staging_s``).

The communicator base class decides when to stage: a tensor whose device type is not in
the backend's ``device_types`` but is the staging accelerator's.
"""
from __future__ import annotations

import threading
import time

import torch


class HostStaging:
    """Pinned host buffers and copy accounting for one accelerator."""

    def __init__(self, accelerator, max_free: int = 8):
        self.accelerator = accelerator
        self.device_type = accelerator.device_type()
        self._free: list[torch.Tensor] = []
        self._max_free = max_free
        self._lock = threading.Lock()

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device_type

    # ---- buffers ---------------------------------------------------------------------
    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pinned host tensor shaped like *like*, backing buffer to give back)."""
        nbytes = like.numel() * like.element_size()
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if buf is None:
            buf = self.accelerator.pin_memory(torch.empty(max(nbytes, 1), dtype=torch.uint8))
        host = buf[:nbytes].view(like.dtype).view(like.shape)
        return host, buf

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._max_free:  # keep the largest
                self._free.sort(key=torch.Tensor.numel)
                self._free.pop(0)

    # ---- copies (timed; the device is synchronized so the time is the copy's) -----------
    def to_host(self, host: torch.Tensor, device_tensor: torch.Tensor) -> tuple[int, float]:
        t0 = time.perf_counter()
        host.copy_(device_tensor)
        self.accelerator.synchronize()
        return host.numel() * host.element_size(), time.perf_counter() - t0

    def to_device(self, device_tensor: torch.Tensor, host: torch.Tensor) -> tuple[int, float]:
        t0 = time.perf_counter()
        device_tensor.copy_(host)
        self.accelerator.synchronize()
        return host.numel() * host.element_size(), time.perf_counter() - t0


class StagedCall:
    """One collective's staging: host stand-ins for its device tensors, copied in before
    the collective and out after it; ``cost`` accumulates (bytes, seconds)."""

    def __init__(self, staging: HostStaging):
        self.staging = staging
        self._buffers: list[torch.Tensor] = []
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.bytes = 0
        self.seconds = 0.0

    def host(self, tensor: torch.Tensor, read: bool = True, written: bool = False) -> torch.Tensor:
        """The host stand-in of *tensor*: filled from it when the collective *read*s it,
        copied back into it after the collective when the collective writes it."""
        host, buf = self.staging.take(tensor)
        self._buffers.append(buf)
        if read:
            self._count(self.staging.to_host(host, tensor))
        if written:
            self._copy_back.append((tensor, host))
        return host

    def finish(self) -> None:
        """After the collective: results back to the device, buffers back to the pool."""
        try:
            for device_tensor, host in self._copy_back:
                self._count(self.staging.to_device(device_tensor, host))
        finally:
            for buf in self._buffers:
                self.staging.give_back(buf)
            self._buffers.clear()
            self._copy_back.clear()

    def _count(self, cost: tuple[int, float]) -> None:
        self.bytes += cost[0]
        self.seconds += cost[1]
