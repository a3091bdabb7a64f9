"""zero-core-vdev: ``vdev``, an out-of-tree PyTorch device (PrivateUse1) with memory of its own.

``import zero_core_vdev`` registers the device (``torch.device("vdev", i)``, ``torch.vdev``),
as ``import torch_npu`` does for Ascend. zero-core's plugin for it is the separate package
``zero_core_vdev_plugin`` (found through the ``zero_core`` entry point), which imports this
one only when a job selects vdev. See README.md beside the sources.
"""
from .runtime import NAME, VdevNotBuiltError, load

load()

__all__ = ["NAME", "VdevNotBuiltError", "load"]
