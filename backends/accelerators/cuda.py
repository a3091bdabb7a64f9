"""The CUDA accelerator (NVIDIA GPUs; AMD GPUs through a ROCm build of torch).

Nothing here initializes CUDA at import: ``torch.cuda`` is only queried in
``availability()`` and the methods, which run once a job has chosen this accelerator.
Run on one GPU at world size 1 by the GPU kit (``bash ci/gpu_check.sh``), and by selection
and contract tests in CI (docs/hardware.md, "What runs where").
"""
from __future__ import annotations

import os

import torch

from zero_core.interfaces.accelerator import Accelerator

from . import torch_build


class CudaAccelerator(Accelerator):
    """One CUDA device per rank (``local_rank % device_count``), with real streams."""

    name = "cuda"
    priority = 40
    default_comm = "nccl"   # RCCL answers to the same name on ROCm builds
    kernel_set = "cuda"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return False, (f"torch was built without CUDA ({torch_build()}); install a CUDA "
                           f"build of torch (pytorch.org, 'Get started') to use GPUs")
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = (f"CUDA_VISIBLE_DEVICES={visible!r} hides them; " if visible is not None
                    else "")
            return False, (f"{torch_build()} supports CUDA {torch.version.cuda or torch.version.hip} "
                           f"but sees no GPU: {hint}check the driver with nvidia-smi "
                           f"(rocm-smi on AMD)")
        return True, ""

    def device_type(self) -> str:
        return "cuda"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank % max(self.device_count(), 1))

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    # ---- streams and events -------------------------------------------------------------
    def new_stream(self):
        return torch.cuda.Stream()

    def stream(self, stream):
        # torch.cuda.stream(None) is a no-op context, as the interface asks
        return torch.cuda.stream(stream)

    def record_event(self):
        event = torch.cuda.Event()
        event.record()
        return event

    def wait_event(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    # ---- memory -------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        """Bytes held by tensors on the current device (the caching allocator's count)."""
        return torch.cuda.memory_allocated()

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def memory_stats(self) -> dict:
        stats = torch.cuda.memory_stats()
        return {"allocated": self.memory_allocated(), "peak": self.max_memory_allocated(),
                "reserved": torch.cuda.memory_reserved(),
                "peak_reserved": torch.cuda.max_memory_reserved(),
                "num_alloc_retries": stats.get("num_alloc_retries", 0),
                "total": self.total_memory()}

    def total_memory(self) -> int:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked copy, so host<->device copies can run asynchronously."""
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    # ---- capabilities -------------------------------------------------------------------
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if torch.cuda.is_bf16_supported():
            return (torch.float32, torch.bfloat16, torch.float16)
        return (torch.float32, torch.float16)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def describe(self) -> dict:
        facts = super().describe()
        if self.availability()[0]:
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            facts.update(device_name=props.name, total_memory=props.total_memory,
                         capability=f"{props.major}.{props.minor}")
        return facts
