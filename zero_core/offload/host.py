"""Optimizer states in host memory (``offload_optimizer.device: cpu``).

Per parameter group, one flat fp32 partition buffer per state name (``"master"`` and the
rule's states, e.g. ``exp_avg``/``exp_avg_sq``) in host memory, page-locked when
``pin_memory`` is set and the accelerator pins (so device<->host copies can run
asynchronously). The store has the interface the offloaded optimizer steps through, which
the NVMe store (nvme.py) shares: ``acquire(sub-group)`` → the sub-group's tensors,
``release(sub-group)``, ``finish()`` at the end of a step, ``flat(group, name)`` for
checkpoints. Here acquire is a view and release does nothing: on the CPU accelerator,
offloading to the host is a change of layout only (the master copy becomes separate from
the parameters the model computes with).
"""
from __future__ import annotations

import torch

from zero_core.partitioning.flat_buffer import FlatBuffer
from zero_core.partitioning.layout import GroupLayout
from zero_core.offload.subgroups import SubGroup

#: the state name of the fp32 master weights in every store
MASTER = "master"


class HostStateStore:
    """Flat fp32 buffers of *names* for every group of *layouts* (None: no group)."""

    #: its tensors are host memory by design (zero_core.testing.device_audit)
    TENSOR_HOME = "host"

    kind = "cpu"

    def __init__(self, layouts: list[GroupLayout | None], names: tuple[str, ...], rank: int,
                 max_subgroup: int, accelerator=None, pin: bool = False):
        self.names = names
        self.pinned = False
        self._flat: list[dict[str, FlatBuffer] | None] = []
        for lay in layouts:
            if lay is None:
                self._flat.append(None)
                continue
            group = {}
            for name in names:
                fb = FlatBuffer(lay, "partition", torch.float32, torch.device("cpu"), rank)
                if pin and accelerator is not None:
                    pinned = accelerator.pin_memory(fb.data)
                    self.pinned = self.pinned or pinned.data_ptr() != fb.data.data_ptr()
                    fb.data = pinned
                group[name] = fb
            self._flat.append(group)
        self._grad = torch.empty(max(max_subgroup, 1), dtype=torch.float32)
        if pin and accelerator is not None:
            self._grad = accelerator.pin_memory(self._grad)

    def acquire(self, sg: SubGroup) -> dict[str, torch.Tensor]:
        """The sub-group's tensors (views into the flat buffers), by state name."""
        return {name: fb.data.narrow(0, sg.lo, sg.numel)
                for name, fb in self._flat[sg.group].items()}

    def release(self, sg: SubGroup) -> None:
        """Done with the sub-group (nothing to write back in host memory)."""

    def begin(self, order: list[SubGroup]) -> None:
        """A pass over *order* starts (nothing to prefetch in host memory)."""

    def finish(self) -> None:
        """End of a pass (nothing in flight)."""

    def grad_buffer(self, n: int) -> torch.Tensor:
        """A host fp32 scratch tensor of *n* elements for one sub-group's gradient."""
        return self._grad.narrow(0, 0, n)

    def flat(self, group: int, name: str) -> FlatBuffer:
        """The partition buffer of state *name* of *group* (live: checkpoints read and
        write it directly)."""
        return self._flat[group][name]

    @property
    def host_bytes(self) -> int:
        """Host memory this store holds, in bytes."""
        total = self._grad.numel() * 4
        for group in self._flat:
            for fb in (group or {}).values():
                total += fb.nbytes
        return total

    def report(self) -> dict:
        return {"device": "cpu", "host_bytes": self.host_bytes, "pinned": self.pinned,
                "bytes_read": 0, "bytes_written": 0}

    def close(self) -> None:
        """Nothing to release beyond the buffers themselves."""
