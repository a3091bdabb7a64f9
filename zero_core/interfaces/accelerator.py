"""The Accelerator interface: the ~20 things the engine needs from a device.

Implementations live in ``zero_core.backends.accelerators`` (cpu, cuda, hpu, xpu) or in
third-party plugins. Stream and event helpers are no-ops on synchronous devices.
"""
from __future__ import annotations

import contextlib
import importlib.util
from abc import ABC, abstractmethod
from typing import ClassVar

import torch


def module_present(name: str) -> bool:
    """True if module *name* can be imported here, found without importing it: what an
    ``availability()`` (and ``zero-core report``) asks before touching a vendor library."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


class Accelerator(ABC):
    """One kind of device. Instances are cheap; the registry makes one per process."""

    #: name used in config ``"accelerator"`` and ``ZERO_CORE_ACCELERATOR``
    name: ClassVar[str] = ""
    #: auto-detection order: higher first (cuda 40, hpu 30, xpu 20, cpu 0)
    priority: ClassVar[int] = 0
    #: the communicator used when none is configured
    default_comm: ClassVar[str] = "gloo"
    #: name of the kernel set this accelerator uses (resolved by the registry)
    kernel_set: ClassVar[str] = "reference"

    @classmethod
    @abstractmethod
    def availability(cls) -> tuple[bool, str]:
        """(True, "") if usable here, else (False, a reason a user can act on)."""

    # ---- devices ------------------------------------------------------------------
    @abstractmethod
    def device_type(self) -> str:
        """torch device type string, e.g. "cpu", "cuda", "hpu", "xpu"."""

    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""

    def device(self, local_rank: int = 0) -> torch.device:
        """The device a process with *local_rank* should use."""
        count = max(self.device_count(), 1)
        return torch.device(self.device_type(), local_rank % count) if self.device_count() else torch.device(self.device_type())

    def set_device(self, local_rank: int) -> None:
        """Make the device of *local_rank* the current one."""

    def default_comm_for(self, launch) -> str:
        """The communicator to use when none is configured, given how we were launched."""
        return self.default_comm

    def synchronize(self) -> None:
        """Block until all queued work on the current device is done."""

    # ---- streams and events (no-ops where the device is synchronous) ----------------
    def new_stream(self):
        """A side stream for overlapping communication, or None if the device has none."""
        return None

    def stream(self, stream):
        """Context manager that runs work on *stream* (a null context for None)."""
        return contextlib.nullcontext()

    def record_event(self):
        """An event recorded on the current stream, or None on synchronous devices."""
        return None

    def wait_event(self, event) -> None:
        """Make the current stream wait for *event* (None: nothing to wait for)."""

    # ---- memory ---------------------------------------------------------------------
    @abstractmethod
    def memory_allocated(self) -> int:
        """Bytes currently allocated on the device (CPU: resident set size)."""

    @abstractmethod
    def max_memory_allocated(self) -> int:
        """Peak bytes since the last reset (CPU: peak resident set size)."""

    @abstractmethod
    def reset_peak_memory_stats(self) -> None:
        """Start a new peak measurement."""

    def memory_stats(self) -> dict:
        """Device-specific counters, in bytes."""
        return {"allocated": self.memory_allocated(), "peak": self.max_memory_allocated()}

    def total_memory(self) -> int:
        """Bytes of memory of one device (CPU: physical RAM)."""
        return 0

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked host copy of *tensor* where the device benefits from one."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    # ---- capabilities ---------------------------------------------------------------
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Floating-point dtypes the device computes in."""
        return (torch.float32, torch.bfloat16, torch.float16)

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in self.supported_dtypes()

    def manual_seed(self, seed: int) -> None:
        """Seed the device's random number generator (the CPU generator is seeded by torch)."""

    def describe(self) -> dict:
        """Facts for ``zero-core report``."""
        return {"device_type": self.device_type(), "device_count": self.device_count(),
                "default_comm": self.default_comm, "kernel_set": self.kernel_set}
