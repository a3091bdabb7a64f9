"""Partial optimizer offload (DeepSpeed's ZeRO-Offload++ "twin-flow",
``zero_optimization.offload_optimizer.ratio`` < 1).

Which sub-groups stay on the device: DeepSpeed 0.19.8 (``stage3.py``,
``_create_fp32_partitions``) numbers this rank's sub-groups over all parameter groups in
order, n of them, and keeps sub-group i on the accelerator when
``i < int((1 - ratio) * n)``: the first ``1 - ratio`` of them, by count, step on the device
and the rest on the host. The same rule runs here on zero-core's sub-groups (subgroups.py:
cuts of ``sub_group_size`` elements, so with the default ``sub_group_size`` (1e9) a small
model has one sub-group per group, and ``ratio`` changes nothing until there are several —
as in DeepSpeed, whose sub-groups are likewise ``sub_group_size`` cuts).

A device sub-group keeps its fp32 master and states in device memory and is stepped by the
accelerator's own kernel set on the reduced gradient where it lies (copied into an fp32
device scratch and multiplied by ``grad_factor``, the same operations the host path makes);
its new values are written to the parameters (stage 3) or the all-gather send buffers
(stages 1-2) exactly as a host sub-group's. Nothing of it crosses the bus.

What differs from DeepSpeed, and why:

* DeepSpeed 0.19.8 takes ``ratio`` < 1 at stage 3 only (it refuses it at stages 1-2 when the
  config is checked). Here the offloaded optimizer is one class for stages 1-3, so the split
  applies at every offload stage (tests/test_offload_partial_deepspeed.py compares all three
  with DeepSpeed's own runs).
* DeepSpeed's device sub-groups are stepped by ``torch.optim.AdamW`` whatever the configured
  optimizer; here by the configured rule (Adam, AdamW or SGD), so the numbers do not depend
  on ``ratio``: the split changes where each element is stepped, never how.
* The host store keeps its buffers for the whole partition (the device sub-groups' part is
  a mirror): checkpoints, the group buffers and stage-3 write-backs keep reading and writing
  one flat buffer per state. The device copy is the live one between steps; the mirror is
  brought up to date whenever anything outside the step touches a buffer (``_Mirrored``:
  a checkpoint, ``hand_back_model``, a report), and anything written there reaches the
  device before the next step. Host memory is therefore that of ``ratio`` 1; the device
  holds ``(1 - ratio)`` of master and states in addition.
* ``device: nvme``: the host part is the swap files, streamed as plain NVMe offload
  streams them (nvme.py), the device sub-groups left out of the stream; the files keep the
  whole partition, the device sub-groups' regions being the mirror (read and written only
  when the mirror is synchronized, as above). Host memory is that of plain NVMe offload.
"""
from __future__ import annotations

import torch

from zero_core.offload.host import MASTER
from zero_core.partitioning.flat_buffer import FlatBuffer


def device_subgroup_count(n: int, ratio: float) -> int:
    """How many of *n* sub-groups (the first ones) DeepSpeed's rule keeps on the device."""
    return min(n, max(0, int((1 - ratio) * n)))


class _Mirrored(FlatBuffer):
    """A host store buffer as the rest of the engine sees it: reading ``data`` (or any view,
    ``bucket``) first brings the device sub-groups' values into it and marks the host copy
    as the one the next step starts from."""

    def __init__(self, inner: FlatBuffer, owner: "PartialOffload"):
        self.layout, self.kind, self.rank = inner.layout, inner.kind, inner.rank
        self._inner, self._owner = inner, owner

    @property
    def data(self) -> torch.Tensor:
        self._owner.host_view()
        return self._inner.data

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self._owner.host_view()
        self._inner.data = value

    @property
    def dtype(self) -> torch.dtype:   # asking the dtype or size reads no values
        return self._inner.dtype

    @property
    def nbytes(self) -> int:
        return self._inner.nbytes


class _UnitMasterWrite:
    """Stage 3's ``master_part`` of a unit: a write-back (GatheredParameters with a
    modifier) goes into the host mirror and into the device sub-groups that hold some of
    the unit (which ones is known only after the store is built, so every unit gets one).
    Read by a torch function (ZeRO++'s write-back: ``torch.where(changed, new, master)``),
    it is the host mirror, brought up to date first."""

    def __init__(self, owner: "PartialOffload", group: int, lo: int, numel: int,
                 view: torch.Tensor):
        self.owner, self.group, self.lo, self.numel, self.view = owner, group, lo, numel, view

    def copy_(self, values: torch.Tensor):
        self.owner.before_unit_write()
        values = values.reshape(-1)
        self.view.copy_(values)
        self.owner.write_device_range(self.group, self.lo, values)
        return self

    def __getattr__(self, name):
        return getattr(self.view, name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def current(a):
            if isinstance(a, _UnitMasterWrite):
                a.owner.host_view()
                return a.view
            return a
        return func(*[current(a) for a in args], **{k: current(v) for k, v in
                                                      (kwargs or {}).items()})


class PartialOffload:
    """What :class:`~zero_core.offload.optimizer.OffloadedOptimizer` becomes with the first
    ``1 - ratio`` of its sub-groups stepped on the device (module docstring); a mixin, so
    that this module does not import the optimizer's (optimizer.py composes the class)."""

    def __init__(self, *args, ratio: float, device: torch.device, device_kernels, **kwargs):
        self._device_keys: set = set()
        self._device_newer = False
        self._host_newer = False
        self._dev: dict = {}
        self.device = device
        super().__init__(*args, **kwargs)
        self.ratio = ratio
        self.device_kernels = device_kernels
        n_dev = device_subgroup_count(len(self.subgroups), ratio)
        largest = 0
        for sg in self.subgroups[:n_dev]:
            key = (sg.group, sg.index)
            self._device_keys.add(key)
            host = self.store.acquire(sg)
            self._dev[key] = {}
            for name, t in host.items():
                d = torch.empty(sg.numel, dtype=torch.float32, device=device)
                d.copy_(t)
                self.ledger.track("master_weights" if name == MASTER else "optimizer_states", d)
                self._dev[key][name] = d
            self._release(sg, write=False)
            largest = max(largest, sg.numel)
        self._dev_grad = torch.empty(largest, dtype=torch.float32, device=device)
        if largest:
            self.ledger.track("communication_buffers", self._dev_grad)

    # ---- what the engine sees of the store -----------------------------------------------
    def _published(self, flat):
        return _Mirrored(flat, self)

    def _unit_master(self, j: int, master):
        lay = master.layout
        inner = super()._unit_master(j, master._inner)   # NVMe: a MasterWriteThrough

        def unit_master(k):
            lo, n = lay.partition_start(k), lay.shard_size(k)
            # built before the split is known: which device sub-groups overlap is asked
            # at each write
            return _UnitMasterWrite(self, j, lo, n, master._inner.data.narrow(0, lo, n)
                                    if self.store.kind == "cpu" else inner(k))
        return unit_master

    def _streamed(self) -> list:
        return [sg for sg in self.subgroups if (sg.group, sg.index) not in self._device_keys]

    def _release(self, sg, write: bool = True) -> None:
        """Done with *sg*'s store tensors; *write* false: only read (NVMe skips the write)."""
        if self.store.kind == "nvme":
            self.store.release(sg, write=write)
        else:
            self.store.release(sg)

    def before_unit_write(self) -> None:
        """A stage-3 write-back is about to change the master (speculative.py's hook)."""

    def device_subgroups(self) -> list:
        return [sg for sg in self.subgroups if (sg.group, sg.index) in self._device_keys]

    @torch.no_grad()
    def host_view(self) -> None:
        """Bring the device sub-groups' values into the host mirror (if the device has newer
        ones); whoever asked may write there, so the next step starts from the host."""
        if self._device_newer:
            for sg in self.device_subgroups():
                host = self.store.acquire(sg)
                for name, d in self._dev[(sg.group, sg.index)].items():
                    host[name].copy_(d)
                self._release(sg)
            self._device_newer = False
        self._host_newer = True

    @torch.no_grad()
    def _push(self) -> None:
        if self._host_newer:
            for sg in self.device_subgroups():
                host = self.store.acquire(sg)
                for name, d in self._dev[(sg.group, sg.index)].items():
                    d.copy_(host[name])
                self._release(sg, write=False)
            self._host_newer = False

    @torch.no_grad()
    def write_device_range(self, group: int, lo: int, values: torch.Tensor) -> None:
        """Partition elements ``[lo, lo + len(values))`` of *group*'s master, into the
        device sub-groups that hold some of them."""
        hi = lo + values.numel()
        for sg in self.device_subgroups():
            if sg.group != group or sg.hi <= lo or hi <= sg.lo:
                continue
            a, b = max(lo, sg.lo), min(hi, sg.hi)
            self._dev[(sg.group, sg.index)][MASTER].narrow(0, a - sg.lo, b - a).copy_(
                values.narrow(0, a - lo, b - a))

    # ---- the step -------------------------------------------------------------------------
    def step(self, closure=None):
        self._push()
        super().step(closure)
        self._device_newer = bool(self._device_keys)

    def _step_subgroup(self, sg, sends: dict, inflight) -> None:
        key = (sg.group, sg.index)
        if key not in self._device_keys:
            super()._step_subgroup(sg, sends, inflight)
            return
        gb = self.buffers[sg.group]
        states = self._dev[key]
        grad = self._dev_grad.narrow(0, 0, sg.numel)
        self._gather_grad(gb, sg, grad)
        self._kernel_subgroup(sg.group, states, grad, kernels=self.device_kernels)
        self._write_parameters(gb, sg, states[MASTER], sends, inflight)

    def offload_report(self) -> dict:
        rep = super().offload_report()
        dev = sum(t.numel() * 4 for d in self._dev.values() for t in d.values())
        rep.update(ratio=self.ratio, device_subgroups=len(self._device_keys),
                   device_state_bytes=dev)
        return rep
