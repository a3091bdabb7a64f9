"""The hook implementations zero-core calls (see zero_core.interfaces.hookspecs).

Each hook returns a list of what this plugin contributes. Import your backends inside
the hook functions, not at the top: a missing vendor library then shows up as "this
backend is unavailable because ..." instead of breaking every zero-core start.
"""
from zero_core.interfaces.hookspecs import hookimpl


@hookimpl
def zero_core_accelerators():
    from .accelerator import ExampleCpuAccelerator
    return [ExampleCpuAccelerator]


@hookimpl
def zero_core_communicators():
    from .communicator import ExampleGlooCommunicator
    return [ExampleGlooCommunicator]


# A plugin may also contribute kernel sets (fused optimizer kernels for its device):
#
# @hookimpl
# def zero_core_kernel_sets():
#     from zero_core.interfaces.kernels import KernelSet
#     from . import kernels
#     return [KernelSet("example", kernels.adam_step, kernels.sgd_step,
#                       info={"implementation": "what backs these kernels"})]
#
# This example's accelerator uses zero-core's "reference" kernel set instead.
