"""An accelerator backed by the host CPU, under its own name ("example-cpu").

A real plugin would drive its own device here (a vendor's ``torch.<device>`` module).
What zero-core needs from an accelerator is small: the abstract methods below are
required; streams, events, pinning and seeding have working defaults in the base
class for synchronous devices, so override them only if your device has them.
"""
from __future__ import annotations

import torch

from zero_core.interfaces.accelerator import Accelerator
# zero-core's CPU memory helpers (resident set size from /proc, peak reset through
# /proc/self/clear_refs); a device plugin would call its runtime's memory API instead.
from zero_core.backends.accelerators.cpu import peak_rss_bytes, reset_peak_rss, rss_bytes


class ExampleCpuAccelerator(Accelerator):
    # The name users write in the config ("accelerator": "example-cpu") or in
    # ZERO_CORE_ACCELERATOR. It must not clash with another plugin's: zero-core refuses
    # duplicate names and names both packages.
    name = "example-cpu"
    # Auto-detection picks the available accelerator with the highest priority (cuda 40,
    # hpu 30, xpu 20, cpu 0). Below zero: this one is used only when asked for by name.
    priority = -10
    # The communicator used when the config names none: this plugin's own.
    default_comm = "example-gloo"
    # Optimizer kernels: zero-core's pure-torch "reference" set runs on any torch device.
    kernel_set = "reference"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        # Called often (selection, `zero-core report`): keep it cheap and never raise.
        # When unavailable, return a reason the user can act on, e.g.
        # (False, "vendor_lib is not installed: pip install vendor-lib").
        return True, ""

    def device_type(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def device(self, local_rank: int = 0) -> torch.device:
        # all ranks of a node share the host; tensors there report plain "cpu"
        return torch.device("cpu")

    # Memory, in bytes. zero-core's memory checks and benchmarks read these.
    def memory_allocated(self) -> int:
        return rss_bytes()

    def max_memory_allocated(self) -> int:
        return max(peak_rss_bytes(), rss_bytes())

    def reset_peak_memory_stats(self) -> None:
        reset_peak_rss()  # returns why not where the OS forbids it; the peak then stays
