"""zero-core-vdev: an out-of-tree PyTorch device, ``vdev``, and its zero-core plugin.

``import zero_core_vdev`` registers the device (``torch.device("vdev", i)``); the plugin
(``zero_core_vdev.plugin``, found through the ``zero_core`` entry point) contributes the
``vdev`` accelerator and kernel set to zero-core. See README.md beside this package.
"""
from .runtime import NAME, VdevNotBuiltError, load

load()

__all__ = ["NAME", "VdevNotBuiltError", "load"]
