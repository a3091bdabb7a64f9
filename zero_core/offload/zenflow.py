"""ZenFlow: the offloaded update without the host step on the critical path (DeepSpeed's
``zero_optimization.zenflow``), ZeRO stages 1 and 2 with ``offload_optimizer.device: cpu``;
stage 3 is offload/zenflow_stage3.py (these rules over its partitions).

DeepSpeed 0.19.8 has ZenFlow at stages 1, 2 and 3 (runtime/zenflow/);
``update_interval: "auto"`` (its default) is offload/zenflow_auto.py's rule, asked below.

What one optimizer step ``t`` (1, 2, ...) does. ``g_t`` is the step's reduced gradient after
unscaling and clipping (``grad_factor``, as in every zero-core step); W =
``full_warm_up_rounds``, U = ``update_interval``, S = the selection interval in steps
(``select_strategy`` "step": ``select_interval``; "epoch": ``select_interval`` × steps per
epoch; "auto": "epoch" with interval 1; steps per epoch come from ``initialize``'s
``training_data`` loader — without one, S = 0: the columns are selected once):

* t <= W: the plain offloaded step (host Adam on every element, step count t).
* Selection, at t = W + 1 and at every t with S > 0 and (t - 1) % S == 0: for each 2-D weight
  (rows × columns, ``torch.nn.Linear``'s (out, in)), the column importance is
  Σ_rows |g_t[:, c]| (one all-reduce of the column sums per group: every rank selects the
  same columns); the top max(1, int(columns × ``topk_ratio``)) columns are *selected*. Every
  element of a parameter that is not 2-D (biases, norms) is selected, as in DeepSpeed. The
  selected elements of this rank's partition get an fp32 copy of their master values on the
  device and fresh Adam moments (DeepSpeed clears them too); the device step count is not
  reset (nor is DeepSpeed's).
* Every step after warm-up: the selected elements take an Adam step on the device with
  g_t (step count: device steps so far); every element's g_t is added into a host fp32
  accumulator (the device-to-host copy plain offload makes every step).
* Host boundary, at t with (t - W) % U == 0 (U "auto": where offload/zenflow_auto.py's rule
  says at t), or S > 0 and t % S == 0 (so a window ends just
  before each reselection): host Adam on every element of the master with the window's mean
  gradient (Σ g / steps in the window), step count t (DeepSpeed's ``step_id``); then the
  selected elements' master values are set to their device values, so a selected column
  never takes the host's update. With ``overlap_step`` false this runs at once and the
  parameters the next forward sees hold it. With ``overlap_step`` true it runs on a worker
  thread while the next steps compute (double-buffered accumulators, as DeepSpeed's
  ``overlap_grad``); its result reaches the parameters at the next host boundary, or at a
  reselection, whichever comes first: one window later, as in DeepSpeed, whose next window's
  gradients are computed on parameters that lack the previous window's host update — the
  approximation ZenFlow makes. ``flush()`` applies the update in flight (collective).

The bound, and what the tests hold it to: ZenFlow is not Adam. Every selected element follows
Adam on its own gradients exactly; every other element follows Adam on the window means,
U times less often (and one window late with ``overlap_step``). With U = 1 and no
reselection (select once, the default without a loader; W = 0) every element takes one Adam
step per step from the same gradient with the same step count: plain offloaded Adam, bit for
bit with the same kernels (tested). tests/test_zenflow.py holds the engine to a float64
re-implementation of the rules above on random data (both overlap modes, warm-up,
reselection, 1 and 2 ranks, cpu and vdev).

Differences from DeepSpeed, none of which changes the rules above: DeepSpeed's
``update_interval`` replaces ``gradient_accumulation_steps`` (each micro-batch is a ZenFlow
step, and its loss is divided by U); here a ZenFlow step is an optimizer step, so
``gradient_accumulation_steps`` keeps its meaning (1 is what DeepSpeed's ZenFlow examples
use) and the device step sees g_t, not g_t / U (Adam is scale-free up to ``eps``).
DeepSpeed updates the selected columns of the 16-bit parameters directly; here they keep
an fp32 copy on the device (4 bytes × selected elements, plus the moments unless
``offload``). DeepSpeed's device step is always AdamW; here it follows the configured rule,
like the host step. ``pt_reserved_cores_perc`` (with ``overlap_step``): DeepSpeed runs the host
step in a process pinned to the non-reserved cores; here the worker thread is pinned there
(``os.sched_setaffinity`` of that thread; torch's intra-op pool is process-wide, so the
training thread is not restricted).

Checkpoints (``flat_state``, ``checkpoint_extra``, ``load_checkpoint_extra``): a save first
flushes the host update in flight (so the run that saves continues from the flushed state,
and the save equals it), writes the selected elements' device values into the master, and
stores beside plain offload's master and moments four per-element fp32 columns
(:data:`CHECKPOINT_KEYS`: the current window's gradient sum, the selection as 1.0/0.0, the
device moments) and, in ``common.pt``, the step, device-step and window counters (and the
"auto" rule's per-weight sums). Being per
element, they reshard like the moments (any world size); the selection is saved, not redone
at load, so a resumed run continues bit for bit (tests/test_zenflow.py). DeepSpeed 0.19.8
saves none of this (its ZenFlow adds nothing to the ZeRO checkpoint): a resumed DeepSpeed run
loses the window's gradients and the selected columns' moments until its next selection. A
checkpoint without these columns (plain offload, DeepSpeed) loads into a ZenFlow engine only
with ``load_optimizer_states=False``; a ZenFlow checkpoint loads into a plain offload engine
(the window's gradients are dropped).
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.offload.host import HostStateStore
from zero_core.offload.optimizer import MASTER, OffloadedOptimizer
from zero_core.offload.zenflow_auto import AutoInterval
from zero_core.partitioning.flat_buffer import FlatBuffer

#: the ledger's name for ZenFlow's host<->device copies (CommLedger.record_copy)
TRANSFER = "zenflow"
#: ZenFlow's per-element state in a checkpoint, beside plain offload's master and moments:
#: the current window's gradient sum, the selection (1.0 selected), the device moments
CHECKPOINT_KEYS = ("zenflow_acc", "zenflow_selected", "zenflow_exp_avg", "zenflow_exp_avg_sq")


def worker_cores(cores: list[int], reserved_perc: float) -> list[int]:
    """The cores the host update's worker thread runs on: all but the first
    ceil(reserved_perc × n), which stay with training; every core when that leaves one
    side empty (DeepSpeed's split)."""
    reserved = math.ceil(reserved_perc * len(cores))
    return cores[reserved:] if 0 < reserved < len(cores) else list(cores)


class _HostSide:
    """ZenFlow's host memory: gradient accumulators (two with ``overlap_step``), the
    selected elements' indices and value snapshots, and (``offload``) their moments."""

    TENSOR_HOME = "host"  # zero_core.testing.device_audit

    def __init__(self, keys, shard_sizes, count: int, pin):
        self.acc = [{key: pin(torch.zeros(shard_sizes[key])) for key in keys}
                    for _ in range(count)]
        # device -> host landing buffers of the gradients after a window's first step (made
        # at first use: on the cpu accelerator gradients are added in place)
        self.scratch = {}
        self._make = lambda key: pin(torch.empty(shard_sizes[key]))
        self.idx: dict = {}
        self.snap: dict = {}
        self.moments: dict = {}


class ZenFlowOptimizer(OffloadedOptimizer):
    """The offloaded optimizer with ZenFlow's step (module docstring). *zf*: the parsed
    ``ZenFlowConfig``; *device_kernels*: the accelerator's kernel set (the device step)."""

    def __init__(self, hyper_groups, rule, buffers, comm, ledger, zero_grad_fn, offload,
                 sub_group_size, accelerator, rank, zf, device_kernels, device,
                 param_sink=None):
        if rule.kind != "adam":
            raise ConfigError("zero_optimization.zenflow: ZenFlow steps Adam/AdamW (the "
                              "optimizer DeepSpeed's ZenFlow runs); set optimizer.type to "
                              "Adam or AdamW, or remove the zenflow section")
        super().__init__(hyper_groups, rule, buffers, comm, ledger, zero_grad_fn, offload,
                         sub_group_size, accelerator, rank, param_sink=param_sink)
        if not isinstance(self.store, HostStateStore):  # the config refuses it first
            raise ConfigError("zero_optimization.zenflow needs offload_optimizer.device cpu")
        self.zf, self.device, self.dev_kernels = zf, device, device_kernels
        self.rank = rank
        self.select_every = zf.select_interval if zf.select_strategy == "step" else 0
        self.keys = [(j, k) for j, gb in enumerate(buffers) if gb is not None
                     for k in range(gb.num_buckets)]
        sizes = {(j, k): buffers[j].layout.shard_size(k) for j, k in self.keys}

        def pin(t):
            return accelerator.pin_memory(t) if offload.pin_memory else t
        self._pin = pin
        self.host = _HostSide(self.keys, sizes, 2 if zf.overlap_step else 1, pin)
        self._cur = 0                 # accumulator the current window adds into
        self._window = 0              # steps in the current window
        self.t = 0                    # ZenFlow steps taken
        self.device_steps = 0         # device Adam steps since the first selection
        self._w: dict = {}            # (j, k) -> fp32 device copy of the selected values
        self._idx: dict = {}          # (j, k) -> device int64 indices into the shard
        self._mv: dict = {}           # (j, k) -> device moments (offload: None)
        self._job = None              # the host update in flight (overlap_step)
        self._ckpt: dict = {}         # j -> the checkpoint columns flat_state last made
        self._pool = None
        #: test hook: called on the worker at the start of each host update
        self._before_host_update = None
        # update_interval "auto": the rule that says when the host update is due
        self.auto = (AutoInterval(self, zf.topk_ratio, zf.auto_ratio)
                     if zf.update_interval == "auto" else None)
        # applied: (window's last step, the step it reached the parameters), the last 64
        self.stats = {"selections": 0, "host_updates": 0, "host_wait_s": 0.0,
                      "applied": deque(maxlen=64)}

    # ---- the schedule -----------------------------------------------------------------------
    def set_steps_per_epoch(self, steps: int) -> None:
        """``initialize`` knows the loader: ``select_strategy`` epoch/auto select every
        ``select_interval`` (auto: 1) epochs of *steps* optimizer steps."""
        zf = self.zf
        if zf.select_strategy == "step" or steps <= 0:
            return
        per = 1 if zf.select_strategy == "auto" else zf.select_interval
        self.select_every = per * steps
        if self.auto is None and self.select_every and self.select_every < zf.update_interval:
            raise ConfigError(
                f"zero_optimization.zenflow: selecting every {self.select_every} steps "
                f"({zf.select_strategy}: {per} epoch(s) of {steps} steps) is less than "
                f"update_interval {zf.update_interval}; lower update_interval or use "
                f"select_strategy \"step\" with select_interval >= update_interval")

    def _reselects(self, t: int) -> bool:
        w, s = self.zf.full_warm_up_rounds, self.select_every
        return t == w + 1 or (t > w + 1 and s > 0 and (t - 1) % s == 0)

    def _host_boundary(self, t: int) -> bool:
        w, s = self.zf.full_warm_up_rounds, self.select_every
        if self.auto is not None:   # asked every step (collective): offload/zenflow_auto.py
            due = self.auto.observe(self._window)
        else:
            due = (t - w) % self.zf.update_interval == 0
        return due or (s > 0 and t % s == 0)

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One ZenFlow step from the reduced gradients (called by ``engine.step()``)."""
        if closure is not None:
            raise ZeroCoreError("ZenFlowOptimizer.step() takes no closure")
        self._ckpt = {}   # the last checkpoint's buffers (flat_state): the save holds its own
        self.t += 1
        t = self.t
        for j, gb in enumerate(self.buffers):
            if gb is not None:
                self.step_counts[j] = t
        if t <= self.zf.full_warm_up_rounds:
            self._accumulate()
            self._run_host_update(self._submission(t), sync=True)
            self._apply(t)
            self._gather()
            return
        if self._reselects(t):
            self._wait_and_apply(t)
            self._select()
        self._device_step()
        self._accumulate()
        if self._host_boundary(t):
            job = self._submission(t)
            if self.zf.overlap_step:
                self._wait_and_apply(t)
                self._submit(job)
            else:
                self._run_host_update(job, sync=True)
                self._apply(t)
        self._gather()

    def _shard_grad(self, j, k):
        return self.buffers[j].reduced_grad_bucket(k)

    def _param_shard(self, j, k):
        return self.buffers[j].param_buf.shard(k)

    def _accumulate(self) -> None:
        acc, first = self.host.acc[self._cur], self._window == 0
        for key in self.keys:
            src = self._shard_grad(*key)
            if first or src.device.type != "cpu":  # the window's first, or across the bus
                if not first and key not in self.host.scratch:
                    self.host.scratch[key] = self.host._make(key)
                dst = acc[key] if first else self.host.scratch[key]
                dst.copy_(src)
                self.comm.ledger.record_copy(TRANSFER, dst, src)
                if first:
                    if self.grad_factor != 1.0:
                        dst.mul_(self.grad_factor)
                    continue
                src = dst
            acc[key].add_(src, alpha=self.grad_factor)
        self._window += 1

    def _hyper(self, j):
        hp = self.param_groups[j]
        beta1, beta2 = hp["betas"]
        return dict(lr=float(hp["lr"]), beta1=float(beta1), beta2=float(beta2),
                    eps=float(hp["eps"]), weight_decay=float(hp["weight_decay"]),
                    adamw=self.rule.adamw,
                    bias_correction=bool(hp.get("bias_correction", self.rule.bias_correction)))

    def _device_step(self) -> None:
        if not self._w:
            return
        self.device_steps += 1
        for key, w in self._w.items():
            j, k = key
            idx = self._idx[key]
            g = self._shard_grad(j, k).index_select(0, idx).to(torch.float32)
            if self.grad_factor != 1.0:
                g.mul_(self.grad_factor)
            if self.zf.offload:
                m_h, v_h = self.host.moments[key]
                m, v = m_h.to(self.device), v_h.to(self.device)
            else:
                m, v = self._mv[key]
            self.dev_kernels.adam_step(w, g, m, v, step=self.device_steps, **self._hyper(j))
            if self.zf.offload:
                m_h.copy_(m)
                v_h.copy_(v)
            self._write_selected(key, w)

    def _write_selected(self, key, w) -> None:
        """The device step's new values *w* of the selected elements into the parameters."""
        shard = self._param_shard(*key)
        shard.index_copy_(0, self._idx[key], w.to(shard.dtype))

    # ---- selection ----------------------------------------------------------------------------
    def _select(self) -> None:
        """Choose the columns from this step's gradient (module docstring)."""
        self.stats["selections"] += 1
        for j, gb in enumerate(self.buffers):
            if gb is None:
                continue
            lay, world = gb.layout, gb.world_size
            two_d = [i for i, p in enumerate(gb.params) if p.dim() == 2]
            sums = {i: torch.zeros(gb.params[i].shape[1], dtype=torch.float32,
                                   device=self.device) for i in two_d}
            pieces = []   # (k, local lo, param i, param lo, numel)
            for k in range(lay.num_buckets):
                lo = lay.shard_start(k, self.rank)
                hi = lo + lay.shard_size(k)
                for i, (start, n) in enumerate(zip(lay.offsets, lay.numels)):
                    a, b = max(lo, start), min(hi, start + n)
                    if a < b:
                        pieces.append((k, a - lo, i, a - start, b - a))
            grads = {k: self._shard_grad(j, k) for k in range(lay.num_buckets)}
            for k, loc, i, plo, n in pieces:
                if i in sums:
                    cols = self._cols(gb, i, plo, n)
                    vals = grads[k].narrow(0, loc, n).to(torch.float32).abs()
                    sums[i].index_add_(0, cols, vals)
            chosen = {}
            if two_d:
                flat = torch.cat([sums[i] for i in two_d])
                if world > 1:
                    self.comm.all_reduce(flat, "sum")
                off = 0
                for i in two_d:
                    c = gb.params[i].shape[1]
                    mask = torch.zeros(c, dtype=torch.bool, device=self.device)
                    top = torch.topk(flat.narrow(0, off, c), max(1, int(c * self.zf.topk_ratio)))
                    mask[top.indices] = True
                    chosen[i] = mask
                    off += c
            per_bucket: dict[int, list] = {}
            for k, loc, i, plo, n in pieces:
                local = torch.arange(loc, loc + n, device=self.device)
                if i in chosen:
                    local = local[chosen[i][self._cols(gb, i, plo, n)]]
                per_bucket.setdefault(k, []).append(local)
            for k in range(lay.num_buckets):
                self._adopt((j, k), torch.cat(per_bucket[k]) if k in per_bucket else None)

    def _cols(self, gb, i, plo, n):
        c = gb.params[i].shape[1]
        return torch.arange(plo, plo + n, device=self.device) % c

    def _adopt(self, key, idx) -> None:
        """Take the selected elements *idx* of shard *key*: their master values to the
        device in fp32, fresh moments."""
        for d in (self._w, self._idx, self._mv, self.host.idx, self.host.moments):
            d.pop(key, None)
        if idx is None or idx.numel() == 0:
            return
        idx_h = idx.cpu()
        master = self.store.flat(key[0], MASTER).bucket(key[1])
        w = master.index_select(0, idx_h).to(self.device)
        self.comm.ledger.record_copy(TRANSFER, w, master)
        self._idx[key], self._w[key], self.host.idx[key] = idx, w, idx_h
        if self.zf.offload:
            self.host.moments[key] = (self._pin(torch.zeros(idx.numel())),
                                      self._pin(torch.zeros(idx.numel())))
        else:
            self._mv[key] = (torch.zeros_like(w), torch.zeros_like(w))

    # ---- the host update ----------------------------------------------------------------------
    def _submission(self, t: int) -> dict:
        """Everything the host update reads, taken now: the window's accumulator, its step
        count, the hyperparameters and the selected elements' device values."""
        snaps = {}
        for key, w in self._w.items():
            snaps[key] = w.to("cpu", copy=True)  # not an alias on the cpu accelerator
            self.comm.ledger.record_copy(TRANSFER, snaps[key], w)
        job = {"acc": self.host.acc[self._cur], "n": self._window, "t": t, "snaps": snaps,
               "idx": dict(self.host.idx),
               "hyper": {j: self._hyper(j) for j in {key[0] for key in self.keys}}}
        self._window = 0
        if self.auto is not None:
            self.auto.restart()
        if self.zf.overlap_step:
            self._cur ^= 1
        return job

    def _run_host_update(self, job: dict, sync: bool) -> None:
        if not sync and self._before_host_update is not None:
            self._before_host_update()
        for key in self.keys:
            j, k = key
            grad = job["acc"][key]
            if job["n"] != 1:
                grad.div_(job["n"])
            states = {n: self.store.flat(j, n).bucket(k) for n in (MASTER,) + self.state_names}
            self.kernels.adam_step(states[MASTER], grad, states["exp_avg"],
                                   states["exp_avg_sq"], step=job["t"], **job["hyper"][j])
            if key in job["snaps"]:
                states[MASTER].index_copy_(0, job["idx"][key], job["snaps"][key])
        self.stats["host_updates"] += 1
        job["done_t"] = job["t"]

    def _submit(self, job: dict) -> None:
        if self._pool is None:
            cores = worker_cores(sorted(os.sched_getaffinity(0)), self.zf.pt_reserved_cores_perc)
            self._pool = ThreadPoolExecutor(
                1, thread_name_prefix="zenflow-host",
                initializer=lambda: os.sched_setaffinity(0, cores))
        self._job = (job, self._pool.submit(self._run_host_update, job, False))

    def _wait_and_apply(self, t: int) -> None:
        """The host update in flight (if any): wait for it, then put it into the
        parameters."""
        if self._job is None:
            return
        job, future = self._job
        self._job = None
        start = time.perf_counter()
        future.result()
        self.stats["host_wait_s"] += time.perf_counter() - start
        self._apply(t, job["t"])

    def _apply(self, t: int, window_end: int | None = None) -> None:
        """The master into this rank's parameter shards (compute dtype), the selected
        elements' current device values over it."""
        self.stats["applied"].append((t if window_end is None else window_end, t))
        for key in self.keys:
            self._write_applied(key, self.store.flat(key[0], MASTER).bucket(key[1]))

    def _write_applied(self, key, master) -> None:
        """The host update into the parameters: *master*, the selected elements' device
        values over it."""
        shard = self._param_shard(*key)
        shard.copy_(master)
        self.comm.ledger.record_copy(TRANSFER, shard, master)
        if key in self._w:
            shard.index_copy_(0, self._idx[key], self._w[key].to(shard.dtype))

    def _gather(self) -> None:
        """Every rank's updated shards into every rank's ``param_buf`` (stages 1-2)."""
        handles = []
        for j, k in self.keys:
            gb = self.buffers[j]
            send = self._param_shard(j, k).clone()
            handles.append((self.comm.all_gather_into(gb.param_buf.bucket(k), send,
                                                      async_op=True), send))
        for handle, _ in handles:
            handle.wait()

    def flush(self) -> None:
        """Apply the host update in flight now (``overlap_step``; every rank calls it: the
        parameters are all-gathered)."""
        if self._job is not None:
            self._wait_and_apply(self.t)
            self._gather()

    # ---- reports, checkpoints, teardown ---------------------------------------------------------
    @property
    def flat_state(self):
        """The checkpoint's view of the optimizer (``engine.checkpoint_subject()`` reads it on
        every rank, for a save and for a load): plain offload's buffers plus ZenFlow's
        per-element state (:data:`CHECKPOINT_KEYS`). Collective: the host update in flight
        is flushed first, and the selected elements' device values are written into the
        master (what the next host boundary or reselection would put there)."""
        if getattr(self, "host", None) is None:  # during construction
            return self._flat_state
        self.flush()
        cpu, out, self._ckpt = torch.device("cpu"), [], {}
        for j, st in enumerate(self._flat_state):
            gb = self.buffers[j]
            if gb is None:
                out.append(st)
                continue
            extra = {n: FlatBuffer(gb.layout, "partition", torch.float32, cpu, self.rank)
                     for n in CHECKPOINT_KEYS}
            for k in range(gb.num_buckets):
                self._export((j, k), {n: fb.bucket(k) for n, fb in extra.items()})
            self._ckpt[j] = extra
            out.append({**st, **extra})
        return out

    @flat_state.setter
    def flat_state(self, value):
        self._flat_state = value

    def _export(self, key, views: dict) -> None:
        if self._window:
            views["zenflow_acc"].copy_(self.host.acc[self._cur][key])
        if key not in self._w:
            return
        idx = self.host.idx[key]
        w = self._w[key].cpu()
        self.store.flat(key[0], MASTER).bucket(key[1]).index_copy_(0, idx, w)
        views["zenflow_selected"].index_fill_(0, idx, 1.0)
        m, v = self.host.moments[key] if self.zf.offload else self._mv[key]
        views["zenflow_exp_avg"].index_copy_(0, idx, m.cpu())
        views["zenflow_exp_avg_sq"].index_copy_(0, idx, v.cpu())

    def checkpoint_extra(self) -> dict:
        """ZenFlow's counters for ``common.pt`` (checkpoint/save_load.py); equal on every
        rank, read after :attr:`flat_state` flushed."""
        return {"zenflow": {"t": self.t, "device_steps": self.device_steps,
                            "window": self._window,
                            "auto": None if self.auto is None else self.auto.state()}}

    def load_checkpoint_extra(self, extra) -> None:
        """After a load with optimizer states: rebuild the window and the selection from
        the buffers :attr:`flat_state` handed the loader (any world size: the state is per
        element) and *extra* (:meth:`checkpoint_extra`)."""
        zf_state = (extra or {}).get("zenflow")
        if zf_state is None:
            raise ZeroCoreError("this checkpoint was not saved by a ZenFlow engine "
                                "(zero_optimization.zenflow): load it with "
                                "load_optimizer_states=False, or without zenflow")
        self.t, self.device_steps = int(zf_state["t"]), int(zf_state["device_steps"])
        self._window, self._cur, self._job = int(zf_state["window"]), 0, None
        if self.auto is not None:
            self.auto.load(zf_state.get("auto"))
        for key in self.keys:
            j, k = key
            views = {n: fb.bucket(k) for n, fb in self._ckpt[j].items()}
            self.host.acc[0][key].copy_(views["zenflow_acc"])
            idx = views["zenflow_selected"].nonzero().flatten()
            self._adopt(key, idx.to(self.device) if idx.numel() else None)
            if key not in self._w:
                continue
            m, v = (views[n].index_select(0, idx) for n in ("zenflow_exp_avg",
                                                               "zenflow_exp_avg_sq"))
            dst = self.host.moments[key] if self.zf.offload else self._mv[key]
            dst[0].copy_(m)
            dst[1].copy_(v)
        self._ckpt = {}

    def offload_report(self) -> dict:
        rep = super().offload_report()
        rep["zenflow"] = {"selected_elements": sum(w.numel() for w in self._w.values()),
                          "selections": self.stats["selections"],
                          "host_updates": self.stats["host_updates"],
                          "host_wait_s": self.stats["host_wait_s"]}
        return rep

    def close(self) -> None:
        if self._job is not None:
            self._job[1].result()
            self._job = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        super().close()


def build_zenflow(ctx, hyper_groups, rule, buffers, zero_grad) -> ZenFlowOptimizer:
    """The engine's optimizer when ``zero_optimization.zenflow`` is set (*ctx*: the engine's
    ``BuildContext``; engine/optimizer_choice.py decides)."""
    zc = ctx.config.zero_optimization
    if ctx.stage not in (1, 2):   # stage 3: offload/zenflow_stage3.py
        raise ConfigError(f"zero_optimization.zenflow needs stage 1, 2 or 3 (got {ctx.stage})")
    return ZenFlowOptimizer(hyper_groups, rule, buffers, ctx.comm, ctx.memory_ledger, zero_grad,
                            zc.offload_optimizer, zc.sub_group_size, ctx.accelerator, ctx.rank,
                            zc.zenflow, ctx.kernels, ctx.device)
