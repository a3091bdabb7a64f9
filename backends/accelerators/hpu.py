"""The HPU accelerator: Intel Gaudi, through Habana's PyTorch bridge.

``habana_frameworks`` ships with Intel Gaudi's software stack (not with torch), and is
imported only in ``availability()`` and the methods. The calls used are the ones Habana
documents in ``habana_frameworks.torch.hpu``: ``is_available``, ``device_count``,
``synchronize``, ``Stream`` / ``stream`` / ``Event`` / ``current_stream`` and the memory
API (``memory_allocated``, ``max_memory_allocated``, ``reset_peak_memory_stats``,
``memory_stats`` whose ``"Limit"`` is the device memory). Not run on Gaudi yet: covered by
selection and contract tests only (docs/hardware.md, "What runs where").
"""
from __future__ import annotations

import contextlib
import os

import torch

from zero_core.interfaces.accelerator import Accelerator, module_present


INSTALL_HINT = ("habana_frameworks is not installed: it comes with Intel Gaudi's software "
                "stack (use Intel's Gaudi PyTorch container, or install the habana-torch-plugin "
                "wheels per Intel Gaudi's installation guide)")


def _hthpu():
    """``habana_frameworks.torch.hpu``, after loading the bridge (``...torch.core``)."""
    import habana_frameworks.torch.core  # noqa: F401  registers the "hpu" device with torch
    import habana_frameworks.torch.hpu as hthpu
    return hthpu


class HpuAccelerator(Accelerator):
    """One Gaudi card per rank. Default communicator: HCCL through torch.distributed."""

    name = "hpu"
    priority = 30
    default_comm = "hccl"
    kernel_set = "hpu"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if not module_present("habana_frameworks"):
            return False, INSTALL_HINT
        try:
            hthpu = _hthpu()
        except Exception as exc:  # a bridge built for another torch fails here
            return False, (f"habana_frameworks is installed but its PyTorch bridge failed to "
                           f"load ({type(exc).__name__}: {exc}); its version must match torch "
                           f"{torch.__version__}")
        if not hthpu.is_available() or hthpu.device_count() == 0:
            visible = os.environ.get("HABANA_VISIBLE_MODULES")
            hint = f"HABANA_VISIBLE_MODULES={visible!r} may hide them; " if visible else ""
            return False, (f"habana_frameworks is installed but no Gaudi device is visible: "
                           f"{hint}check the cards with hl-smi")
        return True, ""

    def device_type(self) -> str:
        return "hpu"

    def device_count(self) -> int:
        return _hthpu().device_count()

    def device(self, local_rank: int = 0) -> torch.device:
        # Habana's bridge gives each process one card (the module it acquired, or the one
        # HABANA_VISIBLE_MODULES leaves): the process addresses it as plain "hpu".
        return torch.device("hpu")

    def synchronize(self) -> None:
        _hthpu().synchronize()

    # ---- streams and events -------------------------------------------------------------
    def new_stream(self):
        return _hthpu().Stream()

    def stream(self, stream):
        return contextlib.nullcontext() if stream is None else _hthpu().stream(stream)

    def record_event(self):
        event = _hthpu().Event()
        event.record()
        return event

    def wait_event(self, event) -> None:
        if event is not None:
            _hthpu().current_stream().wait_event(event)

    # ---- memory -------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        return _hthpu().memory_allocated()

    def max_memory_allocated(self) -> int:
        return _hthpu().max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        _hthpu().reset_peak_memory_stats()

    def memory_stats(self) -> dict:
        stats = _hthpu().memory_stats()
        return {"allocated": stats.get("InUse", self.memory_allocated()),
                "peak": stats.get("MaxInUse", self.max_memory_allocated()),
                "total": stats.get("Limit", 0), "num_allocs": stats.get("NumAllocs", 0)}

    def total_memory(self) -> int:
        return int(_hthpu().memory_stats().get("Limit", 0))

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked host copy for faster host<->HPU transfers."""
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    # ---- capabilities -------------------------------------------------------------------
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        # bf16 is Gaudi's native reduced precision; fp16 is left out until tested on a card
        return (torch.float32, torch.bfloat16)

    def manual_seed(self, seed: int) -> None:
        # the bridge's own seeding where it has one; torch.manual_seed seeds every device
        # generator torch knows of otherwise
        getattr(_hthpu(), "manual_seed", torch.manual_seed)(seed)
