"""The offloaded optimizer step (ZeRO-Offload / ZeRO-Infinity), stages 1-3.

:class:`OffloadedOptimizer` is the :class:`~zero_core.optim.partitioned.PartitionedOptimizer`
with the fp32 master weights and the optimizer states moved to a store in host memory
(host.py) or in swap files (nvme.py). It is built by the engine instead of the partitioned
optimizer when ``zero_optimization.offload_optimizer.device`` is ``cpu`` or ``nvme``.

One step, for every sub-group ``s`` of this rank's partition (subgroups.py), in order:

1. ``store.acquire(s)``: master and states of ``s`` in host memory (NVMe: read ahead
   while the previous sub-groups were stepped);
2. the reduced gradient of ``s`` is copied to a host fp32 buffer, piece by bucket piece,
   and multiplied by ``grad_factor`` (loss-scale × clipping) — the same operations, in
   the same dtype, as the on-device step;
3. the fused *CPU* kernel (the ``"cpu"`` kernel set of the registry, whatever the
   accelerator) updates master and states;
4. the new values go back to the device in the compute dtype: at stages 1 and 2 into the
   send buffer of each bucket, whose all-gather starts as soon as the bucket's last piece
   is written; at stage 3 into the parameter partition (or the parameter offload store);
5. ``store.release(s)`` (NVMe: written behind, on a worker thread).

Every update is element-wise and every piece starts on an alignment boundary, so the
offloaded step is bit-identical to the on-device step with the same kernels (tested).

Variants (composed at the end of this file from mixins, so that their modules need not
import this one): ``ratio`` < 1 steps the first sub-groups on the device (partial.py);
``super_offload`` speculates the host step before the verdict (speculative.py).

Checkpoints: ``flat_state`` and each group's ``master`` are the store's flat buffers (host
tensors, or memory-mapped swap files), so ``engine_state.bucket_fragments`` /
``unit_fragments`` save and load offloaded training unchanged.
"""
from __future__ import annotations

from collections import deque

import torch

from zero_core.runtime import registry
from zero_core.partitioning.buffer_pool import BufferPool
from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.optim.partitioned import PartitionedOptimizer
from zero_core.offload.cleanup import rank_directory
from zero_core.offload.host import MASTER, HostStateStore
from zero_core.offload.nvme import MasterWriteThrough, NvmeStateStore
from zero_core.offload.partial import PartialOffload
from zero_core.offload.speculative import Speculation, build_speculative
from zero_core.offload.subgroups import plan_subgroups


#: the ledger's name for this optimizer's host<->device copies (CommLedger.record_copy)
TRANSFER = "offload_optimizer"


class OffloadedOptimizer(PartitionedOptimizer):
    """Steps the partitions of *buffers* on the CPU from a host or NVMe *store* kind (see
    module docstring). *param_sink* (stage 3 parameter offload) receives the updated
    parameter values instead of the partitions in ``param_buf``."""

    def __init__(self, hyper_groups: list[dict], rule, buffers, comm, ledger, zero_grad_fn,
                 offload, sub_group_size: int, accelerator, rank: int, param_sink=None,
                 max_inflight: int = 4):
        torch.optim.Optimizer.__init__(self, hyper_groups, rule.default_dict())
        if rule.kind == "torch":
            raise ConfigError(
                f"zero_optimization.offload_optimizer: the offloaded optimizer runs the fused "
                f"CPU Adam/AdamW/SGD kernels; {rule.torch_class.__name__} has none. Use Adam, "
                f"AdamW or SGD, or set offload_optimizer.device to 'none'")
        self.rule, self.buffers, self.comm = rule, buffers, comm
        self.ledger, self.max_inflight = ledger, max_inflight
        self._zero_grad_fn = zero_grad_fn
        self.grad_factor = 1.0
        self.found_inf = None
        self.step_counts = [0] * len(buffers)
        self._inner = None
        self.param_sink = param_sink
        # the CPU step: the fused CPU kernels, whatever the accelerator computes with
        self.kernels = registry.load().kernel_set("cpu")
        momentum = any(float(g.get("momentum", 0.0)) for g in self.param_groups)
        self.state_names = tuple(n for n in rule.state_names
                                 if n != "momentum_buffer" or momentum)
        names = (MASTER,) + self.state_names
        layouts = [gb.layout if gb is not None else None for gb in buffers]
        self.subgroups = plan_subgroups(layouts, sub_group_size)
        largest = max((sg.numel for sg in self.subgroups), default=1)
        if offload.device == "cpu":
            self.store = HostStateStore(layouts, names, rank, largest, accelerator,
                                        offload.pin_memory)
        else:
            directory = rank_directory(offload.nvme_path, rank,
                                       "zero_optimization.offload_optimizer.nvme_path")
            self.store = NvmeStateStore(layouts, names, rank, self.subgroups, directory,
                                        offload.buffer_count, accelerator, offload.pin_memory)
        self._initialize_master()
        self.flat_state = [{} if gb is None else
                           {n: self._published(self.store.flat(j, n)) for n in self.state_names}
                           for j, gb in enumerate(buffers)]
        present = [gb for gb in buffers if gb is not None]
        self._send = None
        if any(gb.gathers_after_step for gb in present):
            max_shard = max(max(gb.layout.bucket_sizes) // gb.world_size for gb in present)
            device = present[0].param_buf.data.device
            self._send = BufferPool(max_shard, present[0].param_buf.dtype, device,
                                    lambda t: ledger.track("communication_buffers", t))

    # ---- construction ---------------------------------------------------------------------
    @torch.no_grad()
    def _initialize_master(self):
        """Copy each group's fp32 master (or fp32 parameters) into the store, then point the
        group (and stage-3 units) at the store's master so nothing else keeps a copy."""
        by_group: dict[int, list] = {}
        for sg in self.subgroups:
            by_group.setdefault(sg.group, []).append(sg)
        for j, gb in enumerate(self.buffers):
            if gb is None:
                continue
            # fp32 with offloaded parameters: the values are in the parameter store; read
            # them unit by unit rather than through a map of the whole file
            from_sink = gb.master is None and self.param_sink is not None
            last = {}

            def source(k, gb=gb, from_sink=from_sink, last=last):
                if not from_sink:
                    return gb.master_bucket(k)
                if k not in last:
                    last.clear()
                    last[k] = self.param_sink.read_partition(gb, k)
                return last[k]

            for sg in by_group.get(j, []):
                def fill(dst, sg=sg):
                    for p in sg.pieces:
                        src = source(p.bucket).narrow(0, p.shard_offset, p.numel)
                        dst.narrow(0, p.sub_offset, p.numel).copy_(src)
                if isinstance(self.store, NvmeStateStore):
                    self.store.write_initial(sg, MASTER, fill)
                else:
                    fill(self.store.acquire(sg)[MASTER])
                    self.store.release(sg)
            master = self._published(self.store.flat(j, MASTER))
            # stage 3: GatheredParameters write-backs of unit k must reach the offloaded master
            gb.replace_master(master, self._unit_master(j, master))

    def _published(self, flat):
        """What the group buffers and checkpoints are given for a store buffer: the buffer
        itself (partial offload, partial.py, wraps it to keep it in step with the device)."""
        return flat

    def _unit_master(self, j: int, master):
        """Where stage-3 write-backs of unit k go: ``unit_master(k)`` (the host store's
        view, or the swap files through :class:`MasterWriteThrough`)."""
        if isinstance(self.store, HostStateStore):
            return master.bucket
        lay = master.layout
        return lambda k: MasterWriteThrough(self.store, j, lay.partition_start(k),
                                            lay.shard_size(k), self.subgroups)

    def _streamed(self) -> list:
        """The sub-groups the store streams each step (partial.py keeps some on the device)."""
        return self.subgroups

    @property
    def skips_on_device(self) -> bool:
        """No: the host steps, after waiting for the gradients it copies; the engine reads
        the verdict on the host first (engine/update.py)."""
        return False

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Apply one update from the reduced gradients (called by ``engine.step()``)."""
        if closure is not None:
            raise ZeroCoreError("OffloadedOptimizer.step() takes no closure: the engine "
                                "computes gradients with engine.backward(loss)")
        for j, gb in enumerate(self.buffers):
            if gb is not None:
                self.step_counts[j] += 1
        store = self.store
        store.begin(self._streamed())
        inflight: deque = deque()   # all-gathers launched (stages 1-2)
        sends: dict = {}            # (group, bucket) -> send buffer being filled
        for sg in self.subgroups:
            self._step_subgroup(sg, sends, inflight)
        self._drain(inflight)
        if self.param_sink is not None:
            self.param_sink.flush()
        store.finish()

    def _step_subgroup(self, sg, sends: dict, inflight) -> None:
        """One sub-group's host step (module docstring, steps 1-5)."""
        gb = self.buffers[sg.group]
        states = self.store.acquire(sg)
        grad = self.store.grad_buffer(sg.numel)
        self._gather_grad(gb, sg, grad)
        self._kernel_subgroup(sg.group, states, grad)
        self._write_parameters(gb, sg, states[MASTER], sends, inflight)
        self.store.release(sg)

    def _gather_grad(self, gb, sg, grad: torch.Tensor) -> None:
        """*sg*'s reduced gradient into the fp32 *grad*, multiplied by ``grad_factor``."""
        for p in sg.pieces:
            src = gb.reduced_grad_bucket(p.bucket).narrow(0, p.shard_offset, p.numel)
            dst = grad.narrow(0, p.sub_offset, p.numel)
            dst.copy_(src)
            self.comm.ledger.record_copy(TRANSFER, dst, src)
        if self.grad_factor != 1.0:
            grad.mul_(self.grad_factor)

    def _kernel_subgroup(self, j: int, states: dict, grad: torch.Tensor,
                         kernels=None, step: int | None = None) -> None:
        hp = self.param_groups[j]
        t = self.step_counts[j] if step is None else step
        master = states[MASTER]
        kernels = kernels or self.kernels
        if self.rule.kind == "adam":
            beta1, beta2 = hp["betas"]
            kernels.adam_step(
                master, grad, states["exp_avg"], states["exp_avg_sq"], lr=float(hp["lr"]),
                beta1=float(beta1), beta2=float(beta2), eps=float(hp["eps"]),
                weight_decay=float(hp["weight_decay"]), step=t, adamw=self.rule.adamw,
                bias_correction=bool(hp.get("bias_correction", self.rule.bias_correction)))
        else:
            momentum = float(hp.get("momentum", 0.0))
            kernels.sgd_step(
                master, grad, states.get("momentum_buffer") if momentum else None,
                lr=float(hp["lr"]), momentum=momentum,
                dampening=float(hp.get("dampening", 0.0)),
                weight_decay=float(hp.get("weight_decay", 0.0)),
                nesterov=bool(hp.get("nesterov", False)), first_step=t == 1)

    def _write_parameters(self, gb, sg, master: torch.Tensor, sends: dict, inflight) -> None:
        """Stream the updated values of *sg* back in the compute dtype (a rounding copy is
        what the kernels' ``param_lowp`` does too): into the partition itself where the
        buffers keep parameters partitioned (stage 3), else into send buffers whose
        all-gather starts as soon as a bucket is complete (stages 1-2)."""
        for p in sg.pieces:
            values = master.narrow(0, p.sub_offset, p.numel)
            if not gb.gathers_after_step:
                if self.param_sink is not None:
                    self.param_sink.write_piece(gb, p.bucket, p.shard_offset, values)
                else:
                    dst = gb.param_buf.bucket(p.bucket).narrow(0, p.shard_offset, p.numel)
                    dst.copy_(values)
                    self.comm.ledger.record_copy(TRANSFER, dst, values)
                continue
            key = (sg.group, p.bucket)
            send = sends.get(key)
            if send is None:
                send = sends[key] = self._send.take(gb.layout.shard_size(p.bucket),
                                                    lambda: self._finish_one(inflight))
            dst = send.narrow(0, p.shard_offset, p.numel)
            dst.copy_(values)
            self.comm.ledger.record_copy(TRANSFER, dst, values)
            if p.shard_offset + p.numel == gb.layout.shard_size(p.bucket):
                del sends[key]
                self._launch_gather(gb, p.bucket, send, inflight)

    # ---- reports and teardown -----------------------------------------------------------------
    def offload_report(self) -> dict:
        """Where the states are, host bytes held, swap bytes read and written so far."""
        rep = self.store.report()
        rep["subgroups"] = len(self.subgroups)
        if self.param_sink is not None:
            rep["params"] = self.param_sink.report()
        return rep

    def close(self) -> None:
        """Stop the swap workers and close the files (the directory is removed at exit)."""
        self.store.close()


class PartialOffloadOptimizer(PartialOffload, OffloadedOptimizer):
    """``offload_optimizer.ratio`` < 1: the first ``1 - ratio`` of the sub-groups stepped on
    the device (partial.py)."""


class SpeculativeOffloadOptimizer(Speculation, PartialOffloadOptimizer):
    """``offload_optimizer.super_offload``: host steps speculated as the boundary backward
    reduces each sub-group, validated in ``step()`` (speculative.py); combines with ``ratio``."""


def build_offloaded_optimizer(ctx, hyper_groups, rule, buffers, zero_grad,
                              param_store=None) -> OffloadedOptimizer:
    """The engine's optimizer when ``offload_optimizer.device`` is cpu or nvme (*ctx*: the
    engine's ``BuildContext``; *buffers*: the stage's group buffers; *param_store*: stage
    3's parameter offload store, which receives the updated values)."""
    if ctx.stage not in (1, 2, 3):
        raise ConfigError(f"zero_optimization.offload_optimizer needs stage 1, 2 or 3 "
                          f"(got {ctx.stage})")
    zc = ctx.config.zero_optimization
    off = zc.offload_optimizer
    args = (hyper_groups, rule, buffers, ctx.comm, ctx.memory_ledger, zero_grad, off,
            zc.sub_group_size, ctx.accelerator, ctx.rank)
    if getattr(off, "super_offload", False):   # speculative host steps (speculative.py)
        return build_speculative(ctx, SpeculativeOffloadOptimizer, args, param_store)
    if off.ratio < 1.0:   # ZeRO-Offload++: part of the states on the device (partial.py)
        return PartialOffloadOptimizer(*args, param_sink=param_store, ratio=off.ratio,
                                       device=ctx.device, device_kernels=ctx.kernels)
    return OffloadedOptimizer(*args, param_sink=param_store)
