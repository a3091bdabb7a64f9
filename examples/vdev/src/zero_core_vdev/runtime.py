"""Loads the vdev runtime library and makes ``vdev`` a PyTorch device.

After ``import zero_core_vdev``: ``torch.device("vdev", i)`` exists, tensors move with
``.to("vdev")`` / ``.cpu()`` / ``.vdev()``, and ``torch.vdev`` is the device module
(device count, current device, streams, memory and synchronization statistics, the
asynchronous mode), as ``torch.cuda`` is for GPUs.

The library (csrc/vdev.cpp) is compiled when the package is installed. Importing it
twice is harmless; importing it into a process whose PrivateUse1 key already belongs to
another backend is refused with the name of that backend.
"""
from __future__ import annotations

import contextlib
import glob
import os
import threading

import torch

NAME = "vdev"
_lock = threading.Lock()
_loaded = False


class VdevNotBuiltError(ImportError):
    """The compiled runtime is missing from the installed package."""


def _library_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_vdev_runtime*.so")))
    if not found:
        raise VdevNotBuiltError(
            f"the vdev runtime library (_vdev_runtime*.so) is not in {here}: the package was "
            f"installed without compiling csrc/vdev.cpp. Reinstall it with a C++ compiler "
            f"present: pip install --no-build-isolation ./examples/vdev")
    return found[0]


def load() -> None:
    """Load the runtime and register the device once per process."""
    global _loaded
    with _lock:
        if _loaded:
            return
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", NAME):
            raise RuntimeError(
                f"cannot register vdev: this process's PrivateUse1 device is already "
                f"'{current}' (PyTorch has one out-of-tree device slot per process)")
        torch.ops.load_library(_library_path())
        # after every aten op is registered: send ops that have a CPU kernel to it rather
        # than to their composite decomposition (see csrc/vdev.cpp)
        torch.ops.vdev.route_cpu_kernels()
        if current != NAME:
            torch.utils.rename_privateuse1_backend(NAME)
        torch._register_device_module(NAME, _DeviceModule())
        # tensor.vdev(), tensor.is_vdev, module.vdev(), storage.vdev() (serialization uses it)
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
        _loaded = True


def _index(device=None) -> int:
    if device is None:
        return int(torch.ops.vdev.current_device())
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != NAME:
        raise ValueError(f"expected a vdev device, got {device}")
    return int(torch.ops.vdev.current_device()) if device.index is None else device.index


_STAT_NAMES = ("allocated", "peak", "num_allocs", "h2d_bytes", "d2h_bytes", "d2d_bytes",
               "h2d_copies", "d2h_copies", "limit", "pinned_allocated",
               "sync_copies", "sync_reads", "sync_waits", "pending_copies")
#: torch.cuda.set_sync_debug_mode's names for the modes
_SYNC_MODES = {"default": 0, "warn": 1, "error": 2}


class _DeviceModule:
    """``torch.vdev``: what PyTorch and users ask of a device module."""

    # ---- devices ---------------------------------------------------------------------
    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def _lazy_init() -> None:
        pass

    @staticmethod
    def device_count() -> int:
        return int(torch.ops.vdev.device_count())

    @staticmethod
    def current_device() -> int:
        return int(torch.ops.vdev.current_device())

    @staticmethod
    def set_device(device) -> None:
        torch.ops.vdev.set_device(_index(device))

    @staticmethod
    @contextlib.contextmanager
    def device(device):
        """Context manager that makes *device* the current vdev device."""
        previous = int(torch.ops.vdev.current_device())
        torch.ops.vdev.set_device(_index(device))
        try:
            yield
        finally:
            torch.ops.vdev.set_device(previous)

    @staticmethod
    def synchronize(device=None) -> None:
        """Wait for everything issued on the device (counted as a synchronization; in the
        asynchronous mode, pending copies land)."""
        torch.ops.vdev.synchronize(_index(device))

    # ---- streams (torch.Stream / torch.Event work on vdev as on a GPU) -------------------
    @staticmethod
    def current_stream(device=None) -> torch.Stream:
        return torch.accelerator.current_stream(torch.device(NAME, _index(device)))

    @staticmethod
    def Stream(device=None, priority: int = 0) -> torch.Stream:  # noqa: N802 - torch.cuda's name
        return torch.Stream(device=torch.device(NAME, _index(device)), priority=priority)

    @staticmethod
    def Event(enable_timing: bool = False) -> torch.Event:  # noqa: N802 - torch.cuda's name
        return torch.Event(device=NAME, enable_timing=enable_timing)

    @staticmethod
    @contextlib.contextmanager
    def stream(stream):
        """Run the block's device work on *stream* (None: the current one)."""
        if stream is None:
            yield
            return
        previous = torch.accelerator.current_stream(stream.device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    # ---- synchronizations and the asynchronous mode (csrc/streams.h) ------------------------
    @staticmethod
    def set_sync_debug_mode(mode) -> None:
        """As torch.cuda's: "default" (0) counts, "warn" (1) warns at, "error" (2) refuses
        every operation that makes the host wait for the device."""
        value = _SYNC_MODES.get(mode, mode) if isinstance(mode, str) else int(mode)
        if value not in (0, 1, 2):
            raise ValueError(f"sync debug mode is one of {sorted(_SYNC_MODES)} or 0-2, not {mode!r}")
        torch.ops.vdev.set_sync_debug_mode(value)

    @staticmethod
    def get_sync_debug_mode() -> int:
        return int(torch.ops.vdev.get_sync_debug_mode())

    @classmethod
    def sync_stats(cls, device=None) -> dict:
        """Synchronizations since the last reset_transfer_stats(): ``copies`` (blocking
        host<->device copies), ``reads`` (.item() and the like), ``waits`` (stream, event,
        device synchronize) and their ``total``."""
        s = cls.memory_stats(device)
        out = {"copies": s["sync_copies"], "reads": s["sync_reads"], "waits": s["sync_waits"]}
        out["total"] = sum(out.values())
        return out

    @staticmethod
    def set_async(on: bool) -> None:
        """The asynchronous mode (also VDEV_ASYNC=1 at start): non-blocking copies land
        later and streams must be ordered by events (csrc/streams.h). Turning it off
        completes whatever is pending."""
        torch.ops.vdev.set_async(bool(on))

    @staticmethod
    def is_async() -> bool:
        return bool(torch.ops.vdev.is_async())

    # ---- random numbers: vdev draws from the host generator (see csrc/vdev.cpp) ---------
    # torch.manual_seed() / torch.seed() seed the host generator and then call these for
    # every custom device: there is nothing more to seed (calling back would recurse).
    @staticmethod
    def manual_seed(seed: int) -> None:
        pass

    manual_seed_all = manual_seed

    @staticmethod
    def seed() -> None:
        pass

    seed_all = seed

    @staticmethod
    def initial_seed() -> int:
        return torch.initial_seed()

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        # the host generator's state is saved by whoever saves the CPU state
        return torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        pass

    # ---- autocast ------------------------------------------------------------------------
    @staticmethod
    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16]

    # ---- memory --------------------------------------------------------------------------
    @staticmethod
    def memory_stats(device=None) -> dict:
        """Allocator and transfer counters of one device, in bytes and counts."""
        values = torch.ops.vdev.memory_stats(_index(device))
        return dict(zip(_STAT_NAMES, (int(v) for v in values)))

    @classmethod
    def memory_allocated(cls, device=None) -> int:
        return cls.memory_stats(device)["allocated"]

    @classmethod
    def max_memory_allocated(cls, device=None) -> int:
        return cls.memory_stats(device)["peak"]

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        torch.ops.vdev.reset_peak(_index(device))

    @staticmethod
    def reset_transfer_stats(device=None) -> None:
        torch.ops.vdev.reset_transfers(_index(device))

    @staticmethod
    def host_view(tensor: torch.Tensor) -> torch.Tensor:
        """The device memory of *tensor* as a CPU tensor, no copy: for kernels only."""
        return torch.ops.vdev.host_view(tensor)
