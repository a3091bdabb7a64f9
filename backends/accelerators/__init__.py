"""Built-in accelerators: cpu, cuda, hpu (Intel Gaudi) and xpu (Intel GPUs).

Each lives in its own module and imports its vendor library (``torch.cuda`` runtime,
``habana_frameworks``, ``intel_extension_for_pytorch``) only inside ``availability()`` and
its methods, so that importing the built-in plugin costs nothing on machines without
that hardware. The helper here is shared by those modules; whether a vendor module is
installed they ask ``zero_core.interfaces.accelerator.module_present``.
"""
from __future__ import annotations

import torch


def torch_build() -> str:
    """The torch version and what it was built for, e.g. "torch 2.13.0+cpu"."""
    return f"torch {torch.__version__}"
