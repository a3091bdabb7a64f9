"""The plugin's link to the vdev device package, loaded only by jobs that use vdev.

zero-core asks every installed accelerator whether it is available, in every process; a
CPU job must not load the device runtime (it would take the process's one PrivateUse1 slot).
So availability is decided from files alone, and ``import zero_core_vdev`` (which registers
the device with PyTorch) happens when a job selects vdev.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys

NAME = "vdev"


def why_not_loadable() -> str | None:
    """None if the device can be loaded here, else why not; loads nothing."""
    if "zero_core_vdev" in sys.modules:
        return None
    spec = importlib.util.find_spec("zero_core_vdev")
    if spec is None or not spec.submodule_search_locations:
        return "the zero_core_vdev package is not installed (pip install --no-build-isolation ./examples/vdev)"
    folders = list(spec.submodule_search_locations)
    if not any(glob.glob(os.path.join(f, "_vdev_runtime*.so")) for f in folders):
        return (f"the vdev runtime library was not compiled (no _vdev_runtime*.so in "
                f"{folders[0]}); reinstall with a C++ compiler: pip install --no-build-isolation "
                f"./examples/vdev")
    import torch
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", NAME):
        return (f"this process's PrivateUse1 device is already '{current}' (PyTorch has one "
                f"out-of-tree device slot per process)")
    return None


def load():
    """Register the device with PyTorch (idempotent); returns the torch.vdev module."""
    import torch
    import zero_core_vdev  # noqa: F401 - registers the device on import
    return torch.vdev
