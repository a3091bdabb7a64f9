"""The optimizer over flat partitions, with the parameter all-gather pipelined in.

:class:`PartitionedOptimizer` is a ``torch.optim.Optimizer`` so that LR schedulers
(torch's and zero-core's) can drive it through ``param_groups``; its ``step()`` is called by
the engine once gradients are reduced, unscaled and clipped. For each bucket it updates
this rank's slice of the master weights (master weights and optimizer states live only
for that slice at stages 1-3), writes the new low-precision values into a send buffer in
the same kernel pass, and launches the bucket's all_gather before stepping the next
bucket, so the gather of bucket k overlaps the update of bucket k+1.

The optimizer knows no ZeRO stage: each group's buffers
(:class:`~zero_core.interfaces.engine_parts.GroupBuffersProtocol`) say which elements this
rank updates (``state_kind``: whole buckets at stage 0, its slice at stages 1-3) and
whether the updated slices are all-gathered afterwards (``gathers_after_step``: stages
1-2) or written in place into ``param_buf`` (stage 0's whole bucket, stage 3's partition).

**Lamb** (config ``optimizer.type: "Lamb"``, DeepSpeed's FusedLamb) is not element-wise:
each parameter's step is scaled by its trust ratio, and under ZeRO a rank holds only
fragments of a parameter (a parameter may straddle buckets and rank slices). The step
takes two passes over the buckets. Pass 1 updates the moments and adds each local
fragment's squared norms of w and u into one float64 vector of 2 × (parameters) sums,
completed by ONE all_reduce where the buffers hold partitions; pass 2 recomputes u from
the stored moments and applies the scaled update, then gathers like the other rules.
FusedLamb's arithmetic (fp32), exactly:

    m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2
    u  = m / (sqrt(v) + eps) + weight_decay * w      (raw moments: no bias correction in u)
    ratio = clamp(||w|| / ||u||, min_coeff, max_coeff); 1 when ||w|| or ||u|| is 0
    w <- w - step_size * ratio * u,   step_size = lr sqrt(1 - b2^t) / (1 - b1^t)  (or lr)

It is torch ops here, not a KernelSet entry: torch has no fused Lamb to wrap, so every
target's "kernel" would be these same ops, and the reduction between the passes would
make it two kernels that every kernel set and plugin would have to provide.

**bf16 master weights / states** (``bf16.bf16_master_weights_and_grads`` /
``bf16_optimizer_states``): the buffers' ``master`` (and, with *state_dtype*, the states)
are bf16. The kernels compute in fp32, so each bucket's stored values are widened into
fp32 scratch buffers from one pool (bucket-sized, counted as working memory), stepped,
and stored back rounded to nearest even: the extra memory is a few buckets, never a
partition.
"""
from __future__ import annotations

from collections import deque

import torch

from zero_core.partitioning.buffer_pool import BufferPool
from zero_core.interfaces.communicator import Communicator
from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.partitioning.flat_buffer import FlatBuffer
from zero_core.interfaces.engine_parts import GroupBuffersProtocol
from zero_core.interfaces.kernels import KernelSet
from zero_core.memory import MemoryLedger
from zero_core.optim.rules import UpdateRule


#: dtypes the optimizer states may be stored in (bf16: ``bf16.bf16_optimizer_states``)
STATE_DTYPES = (torch.float32, torch.bfloat16)


class PartitionedOptimizer(torch.optim.Optimizer):
    """Steps the flat partitions of *buffers* (one per entry of *hyper_groups*, None for a
    group without trainable parameters) with *rule*; hyperparameters are read from
    ``self.param_groups`` at every step, so schedulers that edit them take effect.
    *state_dtype*: the dtype of the optimizer states (fp32, or bf16 beside a bf16 master);
    the master's dtype is the buffers' (``gb.master``)."""

    def __init__(self, hyper_groups: list[dict], rule: UpdateRule,
                 buffers: list[GroupBuffersProtocol | None], kernels: KernelSet,
                 comm: Communicator, ledger: MemoryLedger, zero_grad_fn, max_inflight: int = 4,
                 state_dtype: torch.dtype = torch.float32):
        super().__init__(hyper_groups, rule.default_dict())
        self.rule, self.buffers, self.kernels, self.comm = rule, buffers, kernels, comm
        self.ledger = ledger
        self.max_inflight = max_inflight
        self._zero_grad_fn = zero_grad_fn
        #: set by the engine before step(): multiply gradients by this (unscale × clip); a
        #: float, or a 0-dim device tensor when the engine decides on the device
        self.grad_factor = 1.0
        #: set by the engine with a tensor grad_factor: 1.0 makes the kernels skip the step
        self.found_inf: torch.Tensor | None = None
        self.step_counts = [0] * len(buffers)
        present = [gb for gb in buffers if gb is not None]
        self._check_dtypes(present, state_dtype)
        self.flat_state: list[dict[str, FlatBuffer]] = []
        for j, gb in enumerate(buffers):
            states = {}
            if gb is not None:
                for name in rule.state_names:
                    if name == "momentum_buffer" and not any(
                            float(g.get("momentum", 0.0)) for g in self.param_groups):
                        continue  # plain SGD keeps no state
                    states[name] = FlatBuffer(gb.layout, gb.state_kind, state_dtype,
                                              gb.param_buf.data.device, gb.rank)
                    ledger.track("optimizer_states", states[name].data)
            self.flat_state.append(states)
        max_shard = max((max(gb.layout.bucket_sizes) // gb.world_size for gb in present
                         if gb.num_buckets), default=1)
        device = present[0].param_buf.data.device if present else torch.device("cpu")
        lowp = present[0].param_buf.dtype if present else torch.float32
        track = lambda t: ledger.track("communication_buffers", t)  # noqa: E731
        full = max_shard * (present[0].world_size if present else 1)
        whole = any(gb.state_kind == "full" for gb in present)
        # fp32 gradient of one bucket for mixed precision (the kernels read fp32)
        self._grad32 = BufferPool(full if whole else max_shard, torch.float32, device, track)
        # fp32 working copies of one bucket's bf16 master/states, and Lamb's update u;
        # allocated on first use only
        self._wide = BufferPool(full if whole else max_shard, torch.float32, device, track)
        self._send = BufferPool(max_shard, lowp, device, track)
        self._inner: torch.optim.Optimizer | None = None
        self._device = device
        #: Lamb: the trust ratio of every parameter at the last step, groups one after
        #: the other, each in layout order (get_lamb_coeffs: in param_groups order)
        self.lamb_coeffs: list[float] = []
        if rule.kind == "lamb":
            self._plan_lamb(device)

    # ---- what the engine asks every optimizer (variants override; the defaults do nothing) --
    #: True while this step's gradients were not reduced across ranks (the 1-bit
    #: optimizers' compressed phase, optim/onebit.py): the step all-reduces the norms then
    local_gradients = False

    def speculate(self, reducer, postscale: float, loss_scaler) -> None:
        """Called after the backward that ends an accumulation window, before ``step()``
        (SuperOffload starts its host step here: offload/speculative.py)."""

    def set_steps_per_epoch(self, steps: int) -> None:
        """Told by ``initialize(training_data=)``: optimizer steps per epoch (ZenFlow's
        epoch-based column selection: offload/zenflow.py)."""

    def follow_reducer(self, reducer, backward_state) -> None:
        """Told once, after the gradient reducer exists: *reducer* (its ``on_reduced`` hook
        reports each bucket / unit whose reduction landed) and *backward_state()*, which says
        (boundary backward?, micro-step, postscale, loss scaler) of the backward running.
        SuperOffload starts host steps during backward from it (offload/speculative.py)."""

    def rank_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """State that differs between the ranks and that the flat states do not hold (the
        1-bit optimizers' error feedback: optim/onebit.py), written into this rank's own
        shard of a checkpoint beside its RNG states (host copies taken at the save)."""
        return {}

    def load_rank_checkpoint_tensors(self, tensors: dict | None) -> None:
        """Given back what :meth:`rank_checkpoint_tensors` saved, after
        :meth:`load_checkpoint_extra`; None when the checkpoint was saved on another world
        size (the ranks' states no longer map) or holds no rank state of this rank."""

    def checkpoint_extra(self) -> dict | None:
        """State of this optimizer's own that the flat states do not hold, kept in the
        checkpoint's ``common.pt`` (ZenFlow's window, the 1-bit optimizers' counters)."""
        return None

    def load_checkpoint_extra(self, extra: dict | None) -> None:
        """Given back what :meth:`checkpoint_extra` saved (None: a checkpoint without it),
        after the flat states were loaded."""

    def _check_dtypes(self, present, state_dtype) -> None:
        if state_dtype not in STATE_DTYPES:
            raise ConfigError(f"optimizer state dtype {state_dtype}: use torch.float32 or "
                              f"torch.bfloat16 (bf16.bf16_optimizer_states)")
        narrow = state_dtype != torch.float32 or any(
            gb.master is not None and gb.master.dtype != torch.float32 for gb in present)
        if narrow and self.rule.kind == "torch":
            cls = self.rule.torch_class.__name__
            raise ConfigError(
                f"bf16.bf16_master_weights_and_grads / bf16_optimizer_states work with the "
                f"engine's own update rules (Adam, AdamW, SGD, Lamb); torch.optim.{cls} is "
                f"re-created over fp32 values and cannot keep bf16 master weights or states. "
                f"Use one of those optimizers, or turn the bf16 flags off")

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
        elif self.rule.kind == "lamb":
            self._step_lamb()
        else:
            self._step_fused()

    @property
    def skips_on_device(self) -> bool:
        """Whether a step can be skipped on the device (``found_inf``): the fused Adam/SGD
        kernels of a set that takes it. Otherwise the engine decides on the host first."""
        return self.rule.kind in ("adam", "sgd") and getattr(self.kernels, "skips_on_device",
                                                              False)

    def undo_step(self) -> None:
        """The last step was skipped on the device: its step count does not count."""
        for j, gb in enumerate(self.buffers):
            if gb is not None:
                self.step_counts[j] -= 1

    def get_lamb_coeffs(self) -> list[float]:
        """Lamb: the trust ratio applied to each trained parameter at the last step, in
        the order of ``param_groups`` (DeepSpeed's ``FusedLamb.get_lamb_coeffs``); empty
        before the first step and for other rules."""
        if not self.lamb_coeffs:
            return []
        where, base = {}, 0
        for gb in self.buffers:
            if gb is not None:
                where.update((id(p), base + i) for i, p in enumerate(gb.params))
                base += len(gb.params)
        return [self.lamb_coeffs[where[id(p)]] for g in self.param_groups
                for p in g["params"] if id(p) in where]

    # ---- stored values in fp32 (bf16 master weights / optimizer states) -------------------
    def _open(self, stored: torch.Tensor) -> torch.Tensor:
        """*stored* itself when fp32, else an fp32 scratch copy of it."""
        if stored.dtype == torch.float32:
            return stored
        wide = self._wide.take(stored.numel())
        wide.copy_(stored)
        return wide

    def _close(self, stored: torch.Tensor, wide: torch.Tensor, write: bool = True,
               keep: bool = False) -> None:
        """Store *wide* back into *stored* (rounded to its dtype) when *write*; with *keep*
        the scratch stays in use, holding the stored (rounded) values; else it is freed."""
        if stored.dtype == torch.float32:
            return   # _open handed out the stored tensor itself
        if write:
            stored.copy_(wide)
        if keep:
            wide.copy_(stored)
        else:
            self._wide.release(wide)

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
                lowp = self._lowp_target(gb, k, send)
                stored = gb.master_bucket(k)
                master = self._open(stored)
                states = {n: self._open(fb.bucket(k)) for n, fb in self.flat_state[j].items()}
                self._kernel(j, hp, master, grad, states, lowp)
                for n, fb in self.flat_state[j].items():
                    self._close(fb.bucket(k), states[n])
                self._close(stored, master)
                if scratch is not None:
                    self._grad32.release(scratch)
                self._finish_bucket(gb, k, send, inflight)
        self._drain(inflight)

    def _lowp_target(self, gb, k, send):
        """Where the kernel writes bucket *k*'s new low-precision values, or None (fp32
        training: the master is the parameter)."""
        if not gb.mixed:
            return None
        if not gb.gathers_after_step:
            # written in place: stage 0's whole bucket, stage 3's partition
            return gb.param_buf.bucket(k)
        return send

    def _finish_bucket(self, gb, k, send, inflight):
        """Launch bucket *k*'s all-gather of the updated slice (stages 1-2)."""
        if send is None:
            return
        if not gb.mixed:
            # fp32: the updated slice lives inside the gather's output; MPI forbids a send
            # buffer that aliases the receive buffer, so send a copy (1/N of the bucket)
            send.copy_(gb.master_bucket(k))
        self._launch_gather(gb, k, send, inflight)

    def _kernel(self, j, hp, master, grad, states, lowp):
        t = self.step_counts[j]
        skip = {} if self.found_inf is None else {"found_inf": self.found_inf}
        if self.rule.kind == "adam":
            beta1, beta2 = hp["betas"]
            self.kernels.adam_step(
                master, grad, states["exp_avg"], states["exp_avg_sq"],
                lr=float(hp["lr"]), beta1=float(beta1), beta2=float(beta2),
                eps=float(hp["eps"]), weight_decay=float(hp["weight_decay"]), step=t,
                adamw=self.rule.adamw,
                bias_correction=bool(hp.get("bias_correction", self.rule.bias_correction)),
                param_lowp=lowp, **skip)
        else:
            momentum = float(hp.get("momentum", 0.0))
            buf = states["momentum_buffer"] if momentum else None
            self.kernels.sgd_step(
                master, grad, buf, lr=float(hp["lr"]), momentum=momentum,
                dampening=float(hp.get("dampening", 0.0)),
                weight_decay=float(hp.get("weight_decay", 0.0)),
                nesterov=bool(hp.get("nesterov", False)), first_step=t == 1, param_lowp=lowp,
                **skip)

    def _fp32_grad(self, gb: GroupBuffersProtocol, k: int):
        """Bucket *k*'s reduced gradient in fp32, multiplied by ``grad_factor``; and the
        scratch buffer to give back (mixed precision) or None."""
        g = gb.reduced_grad_bucket(k)
        f = self.grad_factor
        # a device tensor is always applied: comparing it with 1.0 would read it back
        scale = isinstance(f, torch.Tensor) or f != 1.0
        if g.dtype == torch.float32:
            if scale:
                g.mul_(f)
            return g, None
        s = self._grad32.take(g.numel())
        s.copy_(g)
        if scale:
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

    # ---- Lamb (see the module docstring) --------------------------------------------------
    def _plan_lamb(self, device) -> None:
        """For every (group, bucket): the fragments of parameters in the slice this rank
        updates — offset in the slice, size, global parameter index (groups' parameters
        numbered one after the other) — and the index tensor that adds their squared norms
        into the sums vector ([||w||^2 of every parameter..., ||u||^2 of every parameter...])."""
        self._lamb_plan: list[list | None] = []
        self._lamb_group: list[int] = []   # global parameter index -> its group
        pieces = []
        for j, gb in enumerate(self.buffers):
            if gb is None:
                self._lamb_plan.append(None)
                continue
            lay, base = gb.layout, len(self._lamb_group)
            self._lamb_group += [j] * len(gb.params)
            by_bucket: dict[int, list] = {}
            for seg in lay.segments:
                by_bucket.setdefault(seg.bucket, []).append(seg)
            per = []
            for k in range(lay.num_buckets):
                if gb.state_kind == "full":
                    lo, hi = 0, lay.bucket_sizes[k]
                else:
                    lo = gb.rank * lay.shard_size(k)
                    hi = lo + lay.shard_size(k)
                frag = []
                for seg in by_bucket.get(k, ()):
                    a, b = max(lo, seg.bucket_lo), min(hi, seg.bucket_lo + seg.numel)
                    if a < b:
                        frag.append((base + seg.param, a - lo, b - a))
                per.append(frag)
                pieces.append(frag)
            self._lamb_plan.append(per)
        total = len(self._lamb_group)
        self._lamb_index = [None if not frag else torch.tensor(
            [i for i, _, _ in frag] + [total + i for i, _, _ in frag], dtype=torch.int64,
            device=device) for frag in pieces]
        # one all_reduce where some group holds partitions (each rank: fragments only)
        self._lamb_reduce = any(gb is not None and gb.state_kind == "partition"
                                and gb.world_size > 1 for gb in self.buffers)

    @staticmethod
    def _views(t: torch.Tensor, frag) -> list[torch.Tensor]:
        return [t.narrow(0, off, n) for _, off, n in frag]

    def _lamb_update(self, m, v, w, eps: float, wd: float) -> torch.Tensor:
        """FusedLamb's u = m / (sqrt(v) + eps) + wd * w, in an fp32 scratch buffer."""
        u = self._wide.take(m.numel())
        torch.sqrt(v, out=u)
        u.add_(eps)
        torch.div(m, u, out=u)
        if wd != 0:
            u.add_(w, alpha=wd)
        return u

    def _step_lamb(self):
        total = len(self._lamb_group)
        sums = torch.zeros(2 * total, dtype=torch.float64, device=self._device)
        # pass 1: moments; squared norms of w and u over this rank's fragments
        b = 0
        for j, gb in enumerate(self.buffers):
            if gb is None:
                continue
            hp = self.param_groups[j]
            beta1, beta2 = (float(x) for x in hp["betas"])
            st = self.flat_state[j]
            for k in range(gb.num_buckets):
                frag, index = self._lamb_plan[j][k], self._lamb_index[b]
                b += 1
                grad, scratch = self._fp32_grad(gb, k)
                m_st, v_st = st["exp_avg"].bucket(k), st["exp_avg_sq"].bucket(k)
                m, v = self._open(m_st), self._open(v_st)
                m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                if scratch is not None:
                    self._grad32.release(scratch)
                # u is computed from the moments as stored (pass 2 reads them back)
                self._close(m_st, m, keep=True)
                self._close(v_st, v, keep=True)
                if frag:
                    w_st = gb.master_bucket(k)
                    w = self._open(w_st)
                    u = self._lamb_update(m, v, w, float(hp["eps"]), float(hp["weight_decay"]))
                    norms = torch._foreach_norm(self._views(w, frag) + self._views(u, frag))
                    sums.index_add_(0, index, torch.stack(norms).double().square())
                    self._wide.release(u)
                    self._close(w_st, w, write=False)
                self._close(m_st, m, write=False)
                self._close(v_st, v, write=False)
        if self._lamb_reduce:
            self.comm.all_reduce(sums, "sum")
        ratios = self._trust_ratios(sums.tolist())
        # pass 2: the update, the low-precision copy, the all-gather
        inflight: deque = deque()
        for j, gb in enumerate(self.buffers):
            if gb is None:
                continue
            hp = self.param_groups[j]
            step_size = self._lamb_step_size(j, hp)
            st = self.flat_state[j]
            for k in range(gb.num_buckets):
                frag = self._lamb_plan[j][k]
                send = self._send_buffer(gb, k, inflight)
                lowp = self._lowp_target(gb, k, send)
                w_st = gb.master_bucket(k)
                w = self._open(w_st)
                if frag:
                    m_st, v_st = st["exp_avg"].bucket(k), st["exp_avg_sq"].bucket(k)
                    m, v = self._open(m_st), self._open(v_st)
                    u = self._lamb_update(m, v, w, float(hp["eps"]), float(hp["weight_decay"]))
                    self._close(m_st, m, write=False)
                    self._close(v_st, v, write=False)
                    us = self._views(u, frag)
                    torch._foreach_mul_(us, [ratios[i] for i, _, _ in frag])
                    torch._foreach_add_(self._views(w, frag), us, alpha=-step_size)
                    self._wide.release(u)
                if lowp is not None:
                    lowp.copy_(w)
                self._close(w_st, w, write=bool(frag))
                self._finish_bucket(gb, k, send, inflight)
        self._drain(inflight)

    def _trust_ratios(self, sums: list[float]) -> list[float]:
        """FusedLamb's coefficient per parameter from the completed squared-norm sums."""
        total = len(self._lamb_group)
        out = []
        for i, j in enumerate(self._lamb_group):
            hp = self.param_groups[j]
            w_norm, u_norm = sums[i] ** 0.5, sums[total + i] ** 0.5
            ratio = 1.0
            if w_norm != 0 and u_norm != 0:
                # FusedLamb clamps to max_coeff, then to min_coeff
                ratio = max(min(w_norm / u_norm, float(hp["max_coeff"])),
                            float(hp["min_coeff"]))
            out.append(ratio)
        self.lamb_coeffs = out
        return out

    def _lamb_step_size(self, j: int, hp: dict) -> float:
        """lr, times sqrt(1 - b2^t) / (1 - b1^t) with bias correction (FusedLamb)."""
        lr = float(hp["lr"])
        if not bool(hp.get("bias_correction", self.rule.bias_correction)):
            return lr
        beta1, beta2 = (float(x) for x in hp["betas"])
        t = self.step_counts[j]
        return lr * (1.0 - beta2 ** t) ** 0.5 / (1.0 - beta1 ** t)
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
