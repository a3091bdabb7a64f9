"""The optimizer over flat fp32 partitions, with the parameter all-gather pipelined in.

:class:`PartitionedOptimizer` is a ``torch.optim.Optimizer`` so that LR schedulers
(torch's and zero-core's) can drive it through ``param_groups``; its ``step()`` is called by
the engine once gradients are reduced, unscaled and clipped. For each bucket it updates
this rank's fp32 slice (master weights and optimizer states live only for that slice at
stages 1 and 2), writes the new low-precision values into a send buffer in the same
kernel pass, and launches the bucket's all_gather before stepping the next bucket, so the
gather of bucket k overlaps the update of bucket k+1.

The optimizer knows no ZeRO stage: each group's buffers
(:class:`~zero_core.interfaces.engine_parts.GroupBuffersProtocol`) say which elements this
rank updates (``state_kind``: whole buckets at stage 0, its slice at stages 1-3) and
whether the updated slices are all-gathered afterwards (``gathers_after_step``: stages
1-2) or written in place into ``param_buf`` (stage 0's whole bucket, stage 3's partition).
"""
from __future__ import annotations

from collections import deque

import torch

from zero_core.partitioning.buffer_pool import BufferPool
from zero_core.interfaces.communicator import Communicator
from zero_core.errors import ZeroCoreError
from zero_core.partitioning.flat_buffer import FlatBuffer
from zero_core.interfaces.engine_parts import GroupBuffersProtocol
from zero_core.interfaces.kernels import KernelSet
from zero_core.memory import MemoryLedger
from zero_core.optim.rules import UpdateRule


class PartitionedOptimizer(torch.optim.Optimizer):
    """Steps the flat partitions of *buffers* (one per entry of *hyper_groups*, None for a
    group without trainable parameters) with *rule*; hyperparameters are read from
    ``self.param_groups`` at every step, so schedulers that edit them take effect."""

    def __init__(self, hyper_groups: list[dict], rule: UpdateRule,
                 buffers: list[GroupBuffersProtocol | None], kernels: KernelSet,
                 comm: Communicator, ledger: MemoryLedger, zero_grad_fn, max_inflight: int = 4):
        super().__init__(hyper_groups, rule.default_dict())
        self.rule, self.buffers, self.kernels, self.comm = rule, buffers, kernels, comm
        self.ledger = ledger
        self.max_inflight = max_inflight
        self._zero_grad_fn = zero_grad_fn
        #: set by the engine before step(): multiply gradients by this (unscale × clip)
        self.grad_factor = 1.0
        self.step_counts = [0] * len(buffers)
        self.flat_state: list[dict[str, FlatBuffer]] = []
        for j, gb in enumerate(buffers):
            states = {}
            if gb is not None:
                for name in rule.state_names:
                    if name == "momentum_buffer" and not any(
                            float(g.get("momentum", 0.0)) for g in self.param_groups):
                        continue  # plain SGD keeps no state
                    states[name] = FlatBuffer(gb.layout, gb.state_kind, torch.float32,
                                              gb.param_buf.data.device, gb.rank)
                    ledger.track("optimizer_states", states[name].data)
            self.flat_state.append(states)
        present = [gb for gb in buffers if gb is not None]
        max_shard = max((max(gb.layout.bucket_sizes) // gb.world_size for gb in present
                         if gb.num_buckets), default=1)
        device = present[0].param_buf.data.device if present else torch.device("cpu")
        lowp = present[0].param_buf.dtype if present else torch.float32
        track = lambda t: ledger.track("communication_buffers", t)  # noqa: E731
        full = max_shard * (present[0].world_size if present else 1)
        whole = any(gb.state_kind == "full" for gb in present)
        # fp32 gradient of one bucket for mixed precision (the kernels read fp32)
        self._grad32 = BufferPool(full if whole else max_shard, torch.float32, device, track)
        self._send = BufferPool(max_shard, lowp, device, track)
        self._inner: torch.optim.Optimizer | None = None

    # ---- torch.optim.Optimizer interface -------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the engine's gradient buffers (``set_to_none`` does not apply: the flat
        buffers stay allocated)."""
        self._zero_grad_fn()

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one update from the reduced gradients (called by ``engine.step()``)."""
        if closure is not None:
            raise ZeroCoreError("PartitionedOptimizer.step() takes no closure: the engine "
                                "computes gradients with engine.backward(loss)")
        for j, gb in enumerate(self.buffers):
            if gb is not None:
                self.step_counts[j] += 1
        if self.rule.kind == "torch":
            self._step_torch()
        else:
            self._step_fused()

    # ---- fused kernels ------------------------------------------------------------------
    def _step_fused(self):
        inflight: deque = deque()
        for j, gb in enumerate(self.buffers):
            if gb is None:
                continue
            hp = self.param_groups[j]
            for k in range(gb.num_buckets):
                grad, scratch = self._fp32_grad(gb, k)
                send = self._send_buffer(gb, k, inflight)
                lowp = send if gb.mixed and send is not None else None
                if gb.mixed and not gb.gathers_after_step:
                    # written in place: stage 0's whole bucket, stage 3's partition
                    lowp = gb.param_buf.bucket(k)
                master = gb.master_bucket(k)
                self._kernel(j, hp, master, grad, k, lowp)
                if scratch is not None:
                    self._grad32.release(scratch)
                if send is not None:
                    if not gb.mixed:
                        # fp32: the updated slice lives inside the gather's output; MPI
                        # forbids a send buffer that aliases the receive buffer, so send a
                        # copy (1/N of the bucket)
                        send.copy_(master)
                    self._launch_gather(gb, k, send, inflight)
        self._drain(inflight)

    def _kernel(self, j, hp, master, grad, k, lowp):
        states = self.flat_state[j]
        t = self.step_counts[j]
        if self.rule.kind == "adam":
            beta1, beta2 = hp["betas"]
            self.kernels.adam_step(
                master, grad, states["exp_avg"].bucket(k), states["exp_avg_sq"].bucket(k),
                lr=float(hp["lr"]), beta1=float(beta1), beta2=float(beta2),
                eps=float(hp["eps"]), weight_decay=float(hp["weight_decay"]), step=t,
                adamw=self.rule.adamw,
                bias_correction=bool(hp.get("bias_correction", self.rule.bias_correction)),
                param_lowp=lowp)
        else:
            momentum = float(hp.get("momentum", 0.0))
            buf = states["momentum_buffer"].bucket(k) if momentum else None
            self.kernels.sgd_step(
                master, grad, buf, lr=float(hp["lr"]), momentum=momentum,
                dampening=float(hp.get("dampening", 0.0)),
                weight_decay=float(hp.get("weight_decay", 0.0)),
                nesterov=bool(hp.get("nesterov", False)), first_step=t == 1, param_lowp=lowp)

    def _fp32_grad(self, gb: GroupBuffersProtocol, k: int):
        """Bucket *k*'s reduced gradient in fp32, multiplied by ``grad_factor``; and the
        scratch buffer to give back (mixed precision) or None."""
        g = gb.reduced_grad_bucket(k)
        f = self.grad_factor
        if not gb.mixed:
            if f != 1.0:
                g.mul_(f)
            return g, None
        s = self._grad32.take(g.numel())
        s.copy_(g)
        if f != 1.0:
            s.mul_(f)
        return s, s

    def _send_buffer(self, gb: GroupBuffersProtocol, k: int, inflight):
        """The buffer this rank all-gathers bucket *k* from, or None when *gb* does not
        gather after the step (stage 0 holds everything; stage 3 keeps parameters
        partitioned)."""
        if not gb.gathers_after_step:
            return None
        return self._send.take(gb.layout.shard_size(k), lambda: self._finish_one(inflight))

    def _launch_gather(self, gb, k, send, inflight):
        handle = self.comm.all_gather_into(gb.param_buf.bucket(k), send, async_op=True)
        inflight.append((handle, send))
        while len(inflight) > self.max_inflight:
            self._finish_one(inflight)

    def _finish_one(self, inflight) -> bool:
        if not inflight:
            return False
        handle, send = inflight.popleft()
        handle.wait()
        self._send.release(send)
        return True

    def _drain(self, inflight):
        while self._finish_one(inflight):
            pass

    # ---- any element-wise torch.optim class -------------------------------------------
    def _build_inner(self):
        """Re-create the user's optimizer class over the fp32 values this rank updates:
        parameter-shaped views where it updates whole buckets (stage 0), one flat slice
        per bucket where it updates its partition (stages 1-3)."""
        groups = []
        self._inner_map = []   # (group j, its fp32 gradient scratch or None), inner group order
        for j, gb in enumerate(self.buffers):
            if gb is None:
                continue
            grad32 = None
            whole = gb.state_kind == "full"
            if gb.mixed:
                grad32 = FlatBuffer(gb.layout, gb.state_kind, torch.float32,
                                    gb.param_buf.data.device, gb.rank)
                self.ledger.track("communication_buffers", grad32.data)
            tensors = []
            if whole:
                values = gb.master if gb.master is not None else gb.param_buf
                grads = grad32 if grad32 is not None else gb.grad_buf
                for i, p in enumerate(gb.params):
                    t = values.param(i, p.shape)
                    t.grad = grads.param(i, p.shape)
                    tensors.append(t)
            else:
                for k in range(gb.num_buckets):
                    t = gb.master_bucket(k)
                    t.grad = grad32.bucket(k) if grad32 is not None else gb.reduced_grad_bucket(k)
                    tensors.append(t)
            hp = {key: v for key, v in self.param_groups[j].items() if key != "params"}
            groups.append({**hp, "params": tensors})
            self._inner_map.append((j, grad32))
        self._inner = self.rule.torch_class(groups)

    def _step_torch(self):
        if self._inner is None:
            self._build_inner()
        f = self.grad_factor
        for idx, (j, grad32) in enumerate(self._inner_map):
            gb = self.buffers[j]
            for k in range(gb.num_buckets):
                g = gb.reduced_grad_bucket(k)
                if grad32 is not None:
                    dst = grad32.bucket(k)
                    dst.copy_(g)
                    if f != 1.0:
                        dst.mul_(f)
                elif f != 1.0:
                    g.mul_(f)
            inner = self._inner.param_groups[idx]
            for key, v in self.param_groups[j].items():
                if key != "params":
                    inner[key] = v
        self._inner.step()
        inflight: deque = deque()
        for j, _ in self._inner_map:
            gb = self.buffers[j]
            for k in range(gb.num_buckets):
                if not gb.gathers_after_step:
                    if gb.mixed:
                        gb.param_buf.bucket(k).copy_(gb.master.bucket(k))
                    continue
                send = self._send_buffer(gb, k, inflight)
                send.copy_(gb.master_bucket(k))
                self._launch_gather(gb, k, send, inflight)
        self._drain(inflight)
