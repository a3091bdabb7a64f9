"""zero-core's entry point into the vdev package (``[project.entry-points.zero_core]``).

Nothing heavy happens at import: the device runtime is loaded when zero-core asks the
accelerator whether it is available, i.e. only by jobs that consider vdev.
"""
from zero_core.interfaces.hookspecs import hookimpl


@hookimpl
def zero_core_accelerators():
    from .accelerator import VdevAccelerator
    return [VdevAccelerator]


@hookimpl
def zero_core_communicators():
    from .communicator import VdevGlooCommunicator
    return [VdevGlooCommunicator]


@hookimpl
def zero_core_kernel_sets():
    from .kernels import kernel_set
    return [kernel_set()]
