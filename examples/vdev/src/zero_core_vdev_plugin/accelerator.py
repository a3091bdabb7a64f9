"""The ``vdev`` accelerator: zero-core's view of the vdev device.

Streams and events are real (csrc/streams.h): in vdev's asynchronous mode a missing wait
between streams is refused and non-blocking copies land late, as on a GPU; every
synchronization is counted (``memory_stats()["syncs"]``). Memory figures come from vdev's
own allocator; pinned host memory comes from vdev's pinned allocator
(``tensor.pin_memory()``), which is what zero-core's communicators stage device tensors
through.
"""
from __future__ import annotations

import torch

from zero_core.interfaces.accelerator import Accelerator

from . import device
from .device import NAME


class VdevAccelerator(Accelerator):
    """One vdev device per rank (``local_rank % device_count``)."""

    name = NAME
    # below the CPU (0): installing the plugin never changes what auto-detection picks;
    # a job asks for vdev with "accelerator": "vdev" or ZERO_CORE_ACCELERATOR=vdev
    priority = -5
    default_comm = "gloo"
    kernel_set = NAME

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        why = device.why_not_loadable()  # cheap: loads nothing
        return (True, "") if why is None else (False, f"the vdev runtime cannot load: {why}")

    def __init__(self):
        self._mod = device.load()

    def device_type(self) -> str:
        return NAME

    def device_count(self) -> int:
        return self._mod.device_count()

    def set_device(self, local_rank: int) -> None:
        self._mod.set_device(local_rank % self.device_count())

    def default_comm_for(self, launch) -> str:
        # vdev has no transport of its own: the CPU's choice, with device tensors staged
        from zero_core.backends.accelerators.cpu import default_cpu_comm
        return default_cpu_comm(launch)

    def synchronize(self) -> None:
        torch.vdev.synchronize()

    # ---- streams and events -------------------------------------------------------------
    def new_stream(self):
        return torch.vdev.Stream()

    def stream(self, stream):
        return torch.vdev.stream(stream)

    def record_event(self):
        event = torch.vdev.Event()
        event.record()
        return event

    def wait_event(self, event) -> None:
        if event is not None:
            torch.vdev.current_stream().wait_event(event)

    # ---- memory -------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        return self._mod.memory_allocated()

    def max_memory_allocated(self) -> int:
        return self._mod.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        self._mod.reset_peak_memory_stats()

    def memory_stats(self) -> dict:
        stats = self._mod.memory_stats()
        return {"allocated": stats["allocated"], "peak": stats["peak"],
                "total": self.total_memory(), "h2d_bytes": stats["h2d_bytes"],
                "d2h_bytes": stats["d2h_bytes"], "pinned_allocated": stats["pinned_allocated"],
                "syncs": stats["sync_copies"] + stats["sync_reads"] + stats["sync_waits"]}

    def total_memory(self) -> int:
        limit = self._mod.memory_stats()["limit"]
        if limit:
            return limit
        from zero_core.backends.accelerators.cpu import total_memory_bytes
        return total_memory_bytes()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of host *tensor* in vdev's pinned memory (the staging memory)."""
        if tensor.device.type != "cpu":
            raise ValueError(f"pin_memory takes a host tensor; this one is on {tensor.device}")
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def manual_seed(self, seed: int) -> None:
        """vdev draws from the host generator, which torch.manual_seed() seeds."""

    def describe(self) -> dict:
        facts = super().describe()
        stats = self._mod.memory_stats()
        facts.update(memory_limit=stats["limit"] or "none (VDEV_MEMORY_LIMIT unset)",
                     compute="host CPU kernels on device memory (bit-identical to cpu)")
        return facts
