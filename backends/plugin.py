"""The built-in backends, registered through the ``zero_core`` entry point in
pyproject.toml — the same way a third-party plugin registers (ARCHITECTURE §2).

Importing this module must not import any vendor library (CUDA, habana_frameworks,
intel_extension_for_pytorch, mpi4py): those are imported when a backend is checked for
availability or constructed.
"""
from zero_core.interfaces.hookspecs import hookimpl


@hookimpl
def zero_core_accelerators():
    from .accelerators.cpu import CpuAccelerator
    from .accelerators.cuda import CudaAccelerator
    from .accelerators.hpu import HpuAccelerator
    from .accelerators.xpu import XpuAccelerator
    return [CpuAccelerator, CudaAccelerator, HpuAccelerator, XpuAccelerator]


@hookimpl
def zero_core_communicators():
    from .comm.mpi import MpiCommunicator
    from .comm.oneccl import OneCclCommunicator
    from .comm.torch_dist import (CclCommunicator, GlooCommunicator, HcclCommunicator,
                                  NcclCommunicator, XcclCommunicator)
    return [GlooCommunicator, NcclCommunicator, HcclCommunicator, CclCommunicator,
            XcclCommunicator, MpiCommunicator, OneCclCommunicator]


@hookimpl
def zero_core_kernel_sets():
    from .kernel_sets import builtin_kernel_sets
    return builtin_kernel_sets()
