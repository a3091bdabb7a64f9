"""Built-in accelerators: cpu, cuda, hpu (Intel Gaudi) and xpu (Intel GPUs).

Each lives in its own module and imports its vendor library (``torch.cuda`` runtime,
``habana_frameworks``, ``intel_extension_for_pytorch``) only inside ``availability()`` and
its methods, so that importing the built-in plugin costs nothing on machines without
that hardware. The helpers here are shared by those modules.
"""
from __future__ import annotations

import importlib.util

import torch


def module_present(name: str) -> bool:
    """True if *name* can be imported here, found without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


def torch_build() -> str:
    """The torch version and what it was built for, e.g. "torch 2.13.0+cpu"."""
    return f"torch {torch.__version__}"
