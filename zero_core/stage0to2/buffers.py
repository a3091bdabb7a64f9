"""The flat buffers of one parameter group and which piece of them each stage works on.

Per group (Ψ_g trainable elements, N ranks, compute dtype c):

==========================  =========================  ==========================
buffer                      stage 0                    stage 1 / stage 2
==========================  =========================  ==========================
``param_buf`` (c, full)     model parameters are views of it
``grad_buf`` (c, full)      ``.grad`` views            stage 1 only
``grad_part`` (c, part.)    —                          stage 2 only: accumulator
``master`` (fp32)           full (mixed precision)     partition (mixed precision)
==========================  =========================  ==========================

In fp32 training there is no separate master: the fp32 parameters are stepped in place
(stage 0: whole buckets; stages 1/2: this rank's slice of each bucket).

The class meets :class:`~zero_core.interfaces.engine_parts.BucketBuffersProtocol`; what
the optimizer must do differently per stage it learns from ``state_kind`` and
``gathers_after_step``, never from the stage number.
"""
from __future__ import annotations

import torch

from zero_core.interfaces.engine_parts import BucketBuffersProtocol
from zero_core.partitioning.flat_buffer import FlatBuffer
from zero_core.memory import MemoryLedger
from zero_core.partitioning.layout import alignment_for, plan_group_layout


class GroupBuffers(BucketBuffersProtocol):
    """Flattens *params* (in the given order) into buckets and makes them views."""

    def __init__(self, params: list[torch.nn.Parameter], stage: int,
                 compute_dtype: torch.dtype, device: torch.device, rank: int,
                 world_size: int, reduce_bucket_size: int, ledger: MemoryLedger,
                 fp32_values: list[torch.Tensor]):
        self.params = params
        self.stage = stage
        self.mixed = compute_dtype != torch.float32
        self.rank, self.world_size = rank, world_size
        elem = torch.empty((), dtype=compute_dtype).element_size()
        self.layout = lay = plan_group_layout([p.numel() for p in params], reduce_bucket_size,
                                              world_size, alignment_for(elem))
        self.param_buf = FlatBuffer(lay, "full", compute_dtype, device, rank)
        ledger.track("parameters", self.param_buf.data)
        for i, value in enumerate(fp32_values):
            self.param_buf.param(i, value.shape).copy_(value)
        self.master = None
        if self.mixed:
            self.master = FlatBuffer(lay, self.state_kind, torch.float32, device, rank)
            ledger.track("master_weights", self.master.data)
            self._fill_master(fp32_values)
        self.grad_buf = self.grad_part = None
        if stage < 2:
            self.grad_buf = FlatBuffer(lay, "full", compute_dtype, device, rank)
            ledger.track("gradients", self.grad_buf.data)
        else:
            self.grad_part = FlatBuffer(lay, "partition", compute_dtype, device, rank)
            ledger.track("gradients", self.grad_part.data)
        for i, p in enumerate(params):
            p.data = self.param_buf.param(i, p.shape)
            p.grad = self.grad_view(i) if self.grad_buf is not None else None

    def _fill_master(self, fp32_values):
        if self.master.kind == "full":
            for i, v in enumerate(fp32_values):
                self.master.param(i, v.shape).copy_(v)
            return
        # the master holds this rank's slice of every bucket: copy segment by segment
        lay = self.layout
        for k in range(lay.num_buckets):
            lo = lay.shard_start(k, self.rank)
            hi = lo + lay.shard_size(k)
            dst = self.master.bucket(k)
            for i, v in enumerate(fp32_values):
                start, end = lay.offsets[i], lay.offsets[i] + lay.numels[i]
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    dst[a - lo:b - lo].copy_(v.reshape(-1)[a - start:b - start])

    # ---- views the engine works on -----------------------------------------------------
    @property
    def num_buckets(self) -> int:
        return self.layout.num_buckets

    @property
    def state_kind(self) -> str:
        """Stage 0: this rank updates whole buckets ("full"); stages 1/2: its slice."""
        return "full" if self.stage == 0 else "partition"

    @property
    def gathers_after_step(self) -> bool:
        """Stages 1/2: the updated slices are all-gathered into ``param_buf``; stage 0
        updates ``param_buf`` in place."""
        return self.stage != 0

    def replace_master(self, master: FlatBuffer, unit_master=None) -> None:
        """The offloaded optimizer keeps the fp32 master in its store from now on."""
        self.master = master

    def grad_view(self, i: int) -> torch.Tensor:
        """The ``.grad`` view of parameter *i* (stages 0 and 1)."""
        return self.grad_buf.param(i, self.params[i].shape)

    def master_bucket(self, k: int) -> torch.Tensor:
        """The fp32 values this rank updates for bucket *k*."""
        if self.master is not None:
            return self.master.bucket(k)
        return self.param_buf.bucket(k) if self.stage == 0 else self.param_buf.shard(k)

    def reduced_grad_bucket(self, k: int) -> torch.Tensor:
        """This rank's reduced gradient for bucket *k* (compute dtype), after reduction."""
        if self.stage == 0:
            return self.grad_buf.bucket(k)
        if self.stage == 1:
            return self.grad_buf.shard(k)
        return self.grad_part.bucket(k)

    def reduced_grad_tensors(self) -> list[torch.Tensor]:
        """Every reduced gradient element this rank owns, as few tensors as possible."""
        if self.stage == 0:
            return [self.grad_buf.data]
        if self.stage == 1:
            return [self.grad_buf.shard(k) for k in range(self.num_buckets)]
        return [self.grad_part.data]

    def zero_grads(self) -> None:
        """Clear accumulated gradients (stage 2's accumulator is overwritten by the next
        reduction instead, see GradReducer) and re-attach ``.grad`` views."""
        if self.grad_buf is None:
            return
        self.grad_buf.data.zero_()
        for i, p in enumerate(self.params):
            view = self.grad_view(i)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view
