"""The XPU accelerator: Intel GPUs through ``torch.xpu`` (torch >= 2.4 XPU builds).

``intel_extension_for_pytorch`` (IPEX) is imported when it is installed and built for this
torch (``ipex.py`` checks that first), because older torch releases get their XPU device
from it and newer ones still get its optimized ops.
The default communicator is torch's own ``xccl`` when this torch has it, otherwise
``ccl`` (oneCCL bindings for PyTorch). Nothing vendor-specific is imported at module
import. Not run on an Intel GPU yet: covered by selection and contract tests only.
"""
from __future__ import annotations

import os

import torch

from zero_core.interfaces.accelerator import Accelerator

from . import ipex, torch_build

IPEX = ipex.MODULE


def _load_ipex() -> str | None:
    """Import IPEX if installed and built for this torch; None when fine or absent, else why
    not (an IPEX built for another torch is refused unimported: ipex.py)."""
    return ipex.load(for_xpu=True)


def xccl_available() -> bool:
    """Whether this torch has the XCCL process-group backend (torch >= 2.8 XPU builds)."""
    import torch.distributed as dist
    probe = getattr(dist, "is_xccl_available", None)
    return bool(probe and probe())


class XpuAccelerator(Accelerator):
    """One Intel GPU (tile) per rank (``local_rank % device_count``)."""

    name = "xpu"
    priority = 20
    default_comm = "xccl"   # "ccl" when this torch lacks XCCL: see default_comm_for
    kernel_set = "xpu"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        ipex_problem = _load_ipex()
        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return False, (f"{torch_build()} has no torch.xpu module; install torch >= 2.4 "
                           f"built for XPU (or {IPEX} for older torch)")
        if not xpu.is_available() or xpu.device_count() == 0:
            compiled = getattr(xpu, "_is_compiled", lambda: True)()
            if not compiled and (ipex.state()[0] != "ok" or not ipex.xpu_build()):
                why = (f"torch was built without XPU support ({torch_build()}); install "
                       f"torch's XPU build (pytorch.org, 'Get started', compute platform XPU)")
            else:
                mask = os.environ.get("ZE_AFFINITY_MASK")
                hint = f"ZE_AFFINITY_MASK={mask!r} may hide them; " if mask else ""
                why = (f"{torch_build()} supports XPU but sees no Intel GPU: {hint}check the "
                       f"GPU driver (Level Zero) with xpu-smi or sycl-ls")
            if ipex_problem:
                why += f"; also: {ipex_problem}"
            return False, why
        return True, ""

    def device_type(self) -> str:
        return "xpu"

    def device_count(self) -> int:
        return torch.xpu.device_count()

    def set_device(self, local_rank: int) -> None:
        torch.xpu.set_device(local_rank % max(self.device_count(), 1))

    def default_comm_for(self, launch) -> str:
        return "xccl" if xccl_available() else "ccl"

    def synchronize(self) -> None:
        torch.xpu.synchronize()

    # ---- streams and events -------------------------------------------------------------
    def new_stream(self):
        return torch.xpu.Stream()

    def stream(self, stream):
        return torch.xpu.stream(stream)  # a no-op context for None

    def record_event(self):
        event = torch.xpu.Event()
        event.record()
        return event

    def wait_event(self, event) -> None:
        if event is not None:
            torch.xpu.current_stream().wait_event(event)

    # ---- memory -------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        return torch.xpu.memory_allocated()

    def max_memory_allocated(self) -> int:
        return torch.xpu.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        torch.xpu.reset_peak_memory_stats()

    def memory_stats(self) -> dict:
        return {"allocated": self.memory_allocated(), "peak": self.max_memory_allocated(),
                "reserved": torch.xpu.memory_reserved(),
                "peak_reserved": torch.xpu.max_memory_reserved(),
                "total": self.total_memory()}

    def total_memory(self) -> int:
        return torch.xpu.get_device_properties(torch.xpu.current_device()).total_memory

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    # ---- capabilities -------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.xpu.manual_seed_all(seed)

    def describe(self) -> dict:
        facts = super().describe()
        facts["default_comm"] = self.default_comm_for(None)
        facts["ipex"] = ipex.state()[1]
        if self.availability()[0]:
            props = torch.xpu.get_device_properties(torch.xpu.current_device())
            facts.update(device_name=props.name, total_memory=props.total_memory)
        return facts
