"""``vdev-gloo``: a device-aware transport for vdev, as NCCL is for CUDA.

gloo reads and writes the vdev tensors' memory in place (through host views, no copies),
so this communicator carries *device* tensors and no host tensors (``device_types`` is
``("vdev",)``), exactly the situation of nccl on a GPU. A job that picks it runs the
engine the way a CUDA job over NCCL does: bulk traffic straight from device memory, and
the engine's small host-side collectives staged through device buffers.
"""
from __future__ import annotations

import torch

from zero_core.backends.comm.torch_dist import GlooCommunicator

from . import device
from .device import NAME


def _host(t: torch.Tensor) -> torch.Tensor:
    return torch.vdev.host_view(t)


class VdevGlooCommunicator(GlooCommunicator):
    """gloo on vdev memory, in place."""

    name = f"{NAME}-gloo"
    device_types = (NAME,)

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        why = device.why_not_loadable()  # cheap: loads nothing
        if why is not None:
            return False, f"the vdev runtime cannot load: {why}"
        return super().availability()

    def __init__(self, launch, topology, timeout: float = 300.0):
        device.load()
        super().__init__(launch, topology, timeout)

    def _group_backend(self) -> str:
        return "gloo"  # torch.distributed only ever sees host views

    def _all_gather_into(self, output, input, group):
        return super()._all_gather_into(_host(output), _host(input), group)

    def _reduce_scatter(self, output, input, op, group):
        return super()._reduce_scatter(_host(output), _host(input), op, group)

    def _all_reduce(self, tensor, op, group):
        return super()._all_reduce(_host(tensor), op, group)

    def _all_to_all_single(self, output, input, group):
        return super()._all_to_all_single(_host(output), _host(input), group)

    def _broadcast(self, tensor, src, group):
        return super()._broadcast(_host(tensor), src, group)
