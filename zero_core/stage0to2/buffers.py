"""The flat buffers of one parameter group and which piece of them each stage works on.

Per group (Ψ_g trainable elements, N ranks, compute dtype c, gradient-accumulation
dtype a = ``grad_dtype``):

==========================  =========================  ==========================
buffer                      stage 0                    stage 1 / stage 2
==========================  =========================  ==========================
``param_buf`` (c, full)     model parameters are views of it
``grad_buf`` (a, full)      ``.grad`` views            stage 1 only
``grad_part`` (a, part.)    —                          stage 2 only: accumulator
``master`` (m)              full (mixed precision)     partition (mixed precision)
==========================  =========================  ==========================

m is fp32, or bf16 with ``bf16.bf16_master_weights_and_grads`` (*master_dtype*; stages 1-2
only, as in DeepSpeed: at stage 0 a bf16 master would be a second copy of ``param_buf``).

In fp32 training there is no separate master: the fp32 parameters are stepped in place
(stage 0: whole buckets; stages 1/2: this rank's slice of each bucket).

a is c unless ``data_types.grad_accum_dtype`` asks for fp32 under bf16/fp16. Torch requires
``.grad`` to have the parameter's dtype, so at stage 1 the fp32 ``grad_buf`` is then not
``.grad`` views but an accumulator the reducer's hooks add each micro-step's ``.grad`` into
(``.grad`` is dropped right after, as at stage 2; ``grad_views`` says which). Stage 0 refuses
the mix, as DeepSpeed does.

The class meets :class:`~zero_core.interfaces.engine_parts.BucketBuffersProtocol`; what
the optimizer must do differently per stage it learns from ``state_kind`` and
``gathers_after_step``, never from the stage number.
"""
from __future__ import annotations

import torch

from zero_core.config.precision import dtype_name, master_dtype_for
from zero_core.errors import ConfigError
from zero_core.interfaces.engine_parts import BucketBuffersProtocol
from zero_core.partitioning.flat_buffer import FlatBuffer, check_master_handover
from zero_core.memory import MemoryLedger
from zero_core.partitioning.layout import alignment_for, plan_group_layout


class GroupBuffers(BucketBuffersProtocol):
    """Flattens *params* (in the given order) into buckets and makes them views."""

    def __init__(self, params: list[torch.nn.Parameter], stage: int,
                 compute_dtype: torch.dtype, device: torch.device, rank: int,
                 world_size: int, reduce_bucket_size: int, ledger: MemoryLedger,
                 fp32_values: list[torch.Tensor], grad_dtype: torch.dtype | None = None,
                 master_dtype: torch.dtype = torch.float32):
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
        master_dtype = master_dtype_for(stage, compute_dtype, master_dtype)
        if self.mixed:
            self.master = FlatBuffer(lay, self.state_kind, master_dtype, device, rank)
            ledger.track("master_weights", self.master.data)
            self._fill_master(fp32_values)
        self.grad_dtype = _grad_dtype(stage, compute_dtype, grad_dtype)
        # .grad must have the parameter's dtype: views only when the accumulator has it
        self.grad_views = stage < 2 and self.grad_dtype == compute_dtype
        self.grad_buf = self.grad_part = None
        if stage < 2:
            self.grad_buf = FlatBuffer(lay, "full", self.grad_dtype, device, rank)
            ledger.track("gradients", self.grad_buf.data)
        else:
            self.grad_part = FlatBuffer(lay, "partition", self.grad_dtype, device, rank)
            ledger.track("gradients", self.grad_part.data)
        for i, p in enumerate(params):
            p.data = self.param_buf.param(i, p.shape)
            p.grad = self.grad_view(i) if self.grad_views else None

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
        check_master_handover(self.master, master)
        self.master = master

    def grad_view(self, i: int) -> torch.Tensor:
        """The ``.grad`` view of parameter *i* (stages 0 and 1); with ``grad_views``
        false (stage 1, fp32 accumulation), its slot of the fp32 accumulator."""
        return self.grad_buf.param(i, self.params[i].shape)

    def master_bucket(self, k: int) -> torch.Tensor:
        """The master values (fp32, or bf16 master) this rank updates for bucket *k*."""
        if self.master is not None:
            return self.master.bucket(k)
        return self.param_buf.bucket(k) if self.stage == 0 else self.param_buf.shard(k)

    def reduced_grad_bucket(self, k: int) -> torch.Tensor:
        """This rank's reduced gradient for bucket *k* (``grad_dtype``), after reduction."""
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
        if not self.grad_views:
            return
        for i, p in enumerate(self.params):
            view = self.grad_view(i)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view


def _grad_dtype(stage: int, compute_dtype: torch.dtype,
                grad_dtype: torch.dtype | None) -> torch.dtype:
    """The gradient accumulator's dtype (None: the compute dtype). Stage 0 keeps gradients
    only in ``.grad``, which must have the parameter's dtype: DeepSpeed refuses the mix
    there, and so does this."""
    if grad_dtype is None or grad_dtype == compute_dtype:
        return compute_dtype
    if stage == 0:
        c, a = dtype_name(compute_dtype), dtype_name(grad_dtype)
        raise ConfigError(
            f"data_types.grad_accum_dtype = \"{a}\" with {c} training is not supported at "
            f"ZeRO stage 0: there gradients accumulate only in .grad, which must have the "
            f"parameters' dtype ({c}); DeepSpeed refuses this mix too. Use "
            f"zero_optimization.stage 1, 2 or 3 for {a} gradient accumulation, or remove "
            f"data_types.grad_accum_dtype")
    return grad_dtype
