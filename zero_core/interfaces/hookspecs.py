"""Plugin hook specifications (pluggy project ``zero_core``).

A plugin is a module with ``@hookimpl`` functions, registered under the entry-point group
``zero_core`` in its package metadata::

    [project.entry-points.zero_core]
    my_plugin = "my_package.zero_core_plugin"

Each hook returns a list of classes (or KernelSets) that the plugin contributes.
"""
from __future__ import annotations

import pluggy

PROJECT = "zero_core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def zero_core_accelerators():
    """Return a list of :class:`zero_core.interfaces.accelerator.Accelerator` subclasses."""


@hookspec
def zero_core_communicators():
    """Return a list of :class:`zero_core.interfaces.communicator.Communicator` subclasses."""


@hookspec
def zero_core_kernel_sets():
    """Return a list of :class:`zero_core.interfaces.kernels.KernelSet` objects."""
