"""SuperOffload: the host step speculated before the step's verdict, validated after it
(DeepSpeed's ``zero_optimization.offload_optimizer.super_offload``, its "speculation then
validation"; ``cpuadam_cores_perc`` is its sibling key).

DeepSpeed 0.19.8 (runtime/superoffload/) builds ``SuperOffloadOptimizer_Stage3`` at stage 3
on CUDA: as soon as a host sub-group's gradients are complete in the boundary backward it
queues that sub-group's CPU Adam step to a worker process, before the global gradient norm
is known; ``step()`` then checks the norm and, on overflow (inf/NaN), rolls the submitted
sub-groups back (``DeepSpeedCPUAdam.rollback_subgroup``: the Adam update inverted
arithmetically); with ``gradient_clipping`` set it does not speculate at all and steps every
sub-group after clipping. ``cpuadam_cores_perc`` (default 0.8) is the share of cores the
worker process is pinned to.

What runs here, with the same results as the plain offloaded step:

1. during the boundary micro-step's backward, the gradient reducer reports each bucket
   (stages 1-2) or fetch unit (stage 3) whose reduction has landed in the accumulator
   (the reducers' ``on_reduced`` hook; the engine attaches it, :meth:`follow_reducer`).
   A host sub-group all of whose buckets have landed has its final gradient: it is copied
   to host memory at once and a worker thread steps it with the factor the step will have
   if nothing intervenes — ``postscale / loss_scale`` (``grad_factor`` without clipping)
   — after saving the sub-group's master and states (host store: a copy in memory; NVMe
   store: a copy in snapshot swap files beside the states'). At the end of the backward
   (``engine.backward`` calls :meth:`speculate`, after waiting for the reductions) the
   sub-groups not started yet are started, and any whose buckets landed again after its
   start (stage 3's second round of a unit under activation checkpointing, a second
   backward of the same boundary) is put back and started anew on its final gradient
   (``report()["started_in_backward"]`` counts the first kind, ``["restarted"]`` the last);
2. ``step()`` waits for the worker and compares what the speculation assumed with what the
   verdict says: the factor (clipping changed it when the norm exceeded
   ``gradient_clipping``), the hyperparameters (lr, betas, eps, weight decay) and the step
   count. Where all match, the speculative values are the step: only the parameters are
   written back. Where not, the saved values are put back and the sub-group is stepped
   anew with the right factor (rollback and redo: ``report()["redone"]``);
3. a step the verdict skips (overflow with fp16/bf16 checks, unequal batches) never calls
   ``step()``: the speculation is rolled back the next time anything touches the states —
   the next speculation, ``step()``, a checkpoint, a stage-3 write-back
   (``report()["rolled_back"]``).

Only the boundary micro-step speculates (the callback asks the engine whether the backward
running is the boundary's). So every result equals the non-speculative offloaded step bit
for bit (same kernels, same operations on the same fp32 values; a rollback restores
copies, never inverts arithmetic). Unlike DeepSpeed, it speculates with
``gradient_clipping`` set too: clipping usually does not trigger, and when it does the
redo makes the result exact.

When a bucket counts as landed: when the reducer retires its collective — at once without
``overlap_comm`` or on one rank, else when the reducer waits for it (it keeps at most
``max_inflight`` collectives in flight) or at the end of the backward. The worker is a
thread, not a process (torch's CPU kernels release the GIL); ``cpuadam_cores_perc`` pins
it, as ZenFlow's worker is pinned (``os.sched_setaffinity`` of the thread, the last share
of the process's cores). Host memory on top of the store: the gradient copy, 4 bytes per
host element, and with ``device: cpu`` the saved values, 4·(1 + number of states); with
``device: nvme`` the saved values go to swap files (the same size as the states' files;
one more write per sub-group and step, one more read per rollback), and the gradient's
buffer takes the new master after the worker's step, so that ``step()`` writes the
parameters without reading the sub-group back. Stages 1-3 (DeepSpeed:
stage 3 only; the offloaded optimizer here is one class for all three) and without MiCS
(whose gradients are summed across replicas after the backward); ``ratio`` < 1 combines
(device sub-groups step in ``step()``).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from zero_core.errors import ConfigError
from zero_core.offload.cleanup import unique_prefix
from zero_core.offload.host import MASTER
from zero_core.offload.swap_file import SwapFile


def _pin_thread(share: float) -> None:
    """Pin the calling thread to the last *share* of the process's cores (Linux)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return
    keep = cores[int((1 - share) * len(cores)):] or cores[-1:]
    os.sched_setaffinity(threading.get_native_id(), keep)


class _Round:
    """One boundary's speculation: what it assumed, and where each host sub-group is."""

    def __init__(self, micro_step, factor: float, hyper: list, counts: list):
        self.micro_step, self.factor, self.hyper, self.counts = micro_step, factor, hyper, counts
        self.futures: dict = {}    # key -> the worker's step of that sub-group
        self.landed: dict = {}     # key -> buckets landed this round
        self.stale: set = set()    # keys whose buckets landed again after their start


class Speculation:
    """The speculative host steps (module docstring), a mixin over the partial-offload
    optimizer (optimizer.py composes ``SpeculativeOffloadOptimizer``)."""

    #: the gradient copies and saved values are host memory by design (device_audit.py)
    HOST_ATTRS = ("_saved", "_grads")

    def __init__(self, *args, cores_share: float = 0.8, **kwargs):
        super().__init__(*args, **kwargs)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zero-core-superoffload",
                                          initializer=_pin_thread, initargs=(cores_share,))
        self._host_sgs = [sg for sg in self.subgroups
                          if (sg.group, sg.index) not in self._device_keys]
        self._buckets = {(sg.group, sg.index): {p.bucket for p in sg.pieces}
                         for sg in self._host_sgs}
        self._in_bucket: dict = {}   # (group, bucket) -> host sub-groups with a piece there
        for sg in self._host_sgs:
            for k in self._buckets[(sg.group, sg.index)]:
                self._in_bucket.setdefault((sg.group, k), []).append(sg)
        self._grads: dict = {}
        self._saved: dict = {}       # device 'cpu': key -> {name: copy}
        self._snap: dict = {}        # device 'nvme': (group, name) -> snapshot SwapFile
        if self.store.kind == "nvme":
            self._open_snapshots()
        self._round: _Round | None = None
        self._backward = None        # () -> (boundary?, micro-step, postscale, loss scaler)
        self._where: dict = {}       # (data_ptr, numel) of a reduced bucket -> (group, k)
        self._ending = False         # in speculate(): the backward itself has ended
        self.counts = {"speculated": 0, "accepted": 0, "redone": 0, "rolled_back": 0,
                       "started_in_backward": 0, "restarted": 0}

    def _open_snapshots(self) -> None:
        store = self.store
        prefix = unique_prefix("superoffload")
        for (j, name), f in store.files.items():
            path = os.path.join(store.directory, f"{prefix}group{j}.{name}.saved")
            self._snap[(j, name)] = SwapFile(path, torch.float32, f.numel, f.bounds)

    # ---- following the backward --------------------------------------------------------------
    def follow_reducer(self, reducer, backward_state) -> None:
        """Called once by the engine: have *reducer* report each landed bucket / unit;
        *backward_state()* says (is the backward running the boundary's, the micro-step,
        the engine's postscale, its loss scaler or None)."""
        if hasattr(reducer, "on_reduced"):
            self._backward = backward_state
            reducer.on_reduced = self._on_reduced

    def _hyper(self) -> list:
        return [(float(g["lr"]), tuple(g.get("betas", ())), float(g.get("eps", 0.0)),
                 float(g.get("weight_decay", 0.0))) for g in self.param_groups]

    def _open(self, micro_step, postscale: float, loss_scaler) -> _Round:
        """A new speculation: the previous one, if ``step()`` did not take it, is undone."""
        self._abandon()
        scale = float(loss_scaler.current) if loss_scaler is not None else 1.0
        self._round = _Round(micro_step, postscale / scale, self._hyper(),
                             [c + 1 for c in self.step_counts])
        self.counts["speculated"] += 1
        return self._round

    def _bucket_of(self, grad: torch.Tensor):
        key = (grad.data_ptr(), grad.numel())
        if key not in self._where:
            self._where = {(t.data_ptr(), t.numel()): (j, k)
                           for j, gb in enumerate(self.buffers) if gb is not None
                           for k in range(gb.num_buckets)
                           for t in (gb.reduced_grad_bucket(k),)}
        return self._where.get(key)

    @torch.no_grad()
    def _on_reduced(self, grad: torch.Tensor) -> None:
        """The reducer's hook: *grad* (one bucket's slice of a reduced-gradient
        accumulator) has its reduction of this backward."""
        boundary, micro, postscale, loss_scaler = self._backward()
        if not boundary:
            return
        r = self._round
        if r is None or r.micro_step != micro:
            r = self._open(micro, postscale, loss_scaler)
        where = self._bucket_of(grad)
        if where is None:   # not a bucket this optimizer knows: trust no early start
            r.stale.update(r.futures)
            return
        for sg in self._in_bucket.get(where, ()):
            key = (sg.group, sg.index)
            if key in r.futures:
                r.stale.add(key)
                continue
            landed = r.landed.setdefault(key, set())
            landed.add(where[1])
            if landed == self._buckets[key]:
                self._start(r, sg)
                self.counts["started_in_backward"] += not self._ending

    @torch.no_grad()
    def speculate(self, reducer, postscale: float, loss_scaler) -> None:
        """The boundary backward has ended: start the host sub-groups not started during
        it, and start anew those whose gradient changed after their start."""
        self._ending = True
        try:
            reducer.wait_all()   # lands the last buckets (their hook may start sub-groups)
        finally:
            self._ending = False
        r = self._round
        micro = self._backward()[1] if self._backward is not None else None
        if r is None or self._backward is None or r.micro_step != micro:
            r = self._open(micro, postscale, loss_scaler)
        for sg in self._host_sgs:
            key = (sg.group, sg.index)
            if key in r.stale:
                r.futures.pop(key).result()
                self._restore(sg)
                self.counts["restarted"] += 1
            if key not in r.futures:
                self._start(r, sg)
        r.stale.clear()

    def _start(self, r: _Round, sg) -> None:
        """Copy *sg*'s reduced gradient to host memory (on this thread: the copies stay
        ordered with the device's work) and queue its step."""
        key = (sg.group, sg.index)
        grad = self._grads.get(key)
        if grad is None:
            grad = self._grads[key] = torch.empty(sg.numel)
        gb = self.buffers[sg.group]
        for p in sg.pieces:
            src = gb.reduced_grad_bucket(p.bucket).narrow(0, p.shard_offset, p.numel)
            dst = grad.narrow(0, p.sub_offset, p.numel)
            dst.copy_(src)
            self.comm.ledger.record_copy("offload_optimizer", dst, src)
        r.futures[key] = self._worker.submit(self._speculate_one, sg, r.factor,
                                             r.counts[sg.group])

    # ---- the worker's part, and putting it back -------------------------------------------------
    def _speculate_one(self, sg, factor: float, step: int) -> None:
        key = (sg.group, sg.index)
        states = self.store.acquire(sg)
        try:
            if self._snap:
                for n, t in states.items():
                    self._snap[(sg.group, n)].write(sg.index, t)
            else:
                saved = self._saved.get(key)
                if saved is None:
                    saved = self._saved[key] = {n: torch.empty_like(t) for n, t in states.items()}
                for n, t in states.items():
                    saved[n].copy_(t)
            grad = self._grads[key]
            if factor != 1.0:
                grad.mul_(factor)
            self._kernel_subgroup(sg.group, states, grad, step=step)
            if self._snap:   # the new master, for step() to write without reading it back
                grad.copy_(states[MASTER])
        finally:
            self.store.release(sg)

    @torch.no_grad()
    def _restore(self, sg) -> None:
        """Put *sg*'s saved master and states back into the store."""
        states = self.store.acquire(sg)
        try:
            for n, t in states.items():
                if self._snap:
                    self._snap[(sg.group, n)].read(sg.index, t)
                else:
                    t.copy_(self._saved[(sg.group, sg.index)][n])
        finally:
            self.store.release(sg)

    def _wait(self) -> None:
        for f in self._round.futures.values():
            f.result()

    @torch.no_grad()
    def _abandon(self) -> None:
        """A speculation that ``step()`` did not take (a skipped step, or the states are
        touched before it): put the saved values back."""
        if self._round is None:
            return
        self._wait()
        for sg in self._host_sgs:
            if (sg.group, sg.index) in self._round.futures:
                self._restore(sg)
        if self._snap:
            self.store.finish()
        self._round = None
        self.counts["rolled_back"] += 1

    def host_view(self) -> None:
        self._abandon()
        super().host_view()

    def before_unit_write(self) -> None:
        self._abandon()

    # ---- validation ------------------------------------------------------------------------
    def step(self, closure=None):
        self._valid = False
        r = self._round
        if r is not None:
            self._wait()
            self._valid = (float(self.grad_factor) == r.factor and r.hyper == self._hyper()
                           and r.counts == [c + 1 for c in self.step_counts]
                           and len(r.futures) == len(self._host_sgs) and not r.stale)
            if not self._valid:
                self.counts["redone"] += 1
        try:
            super().step(closure)
        finally:
            if r is not None and self._valid:
                self.counts["accepted"] += 1
            self._round = None

    def _step_subgroup(self, sg, sends: dict, inflight) -> None:
        key = (sg.group, sg.index)
        r = self._round
        if r is None or key in self._device_keys:
            super()._step_subgroup(sg, sends, inflight)
            return
        if not self._valid:   # rollback, then the plain step with the verdict's factor
            if key in r.futures:
                self._restore(sg)
            super()._step_subgroup(sg, sends, inflight)
            return
        if self._snap:   # NVMe: the worker left the new master in the gradient's buffer
            self._write_parameters(self.buffers[sg.group], sg, self._grads[key], sends,
                                   inflight)
            return
        states = self.store.acquire(sg)
        self._write_parameters(self.buffers[sg.group], sg, states[MASTER], sends, inflight)
        self.store.release(sg)

    def offload_report(self) -> dict:
        rep = super().offload_report()
        rep["super_offload"] = dict(self.counts)
        return rep

    def close(self) -> None:
        if self._round is not None:
            self._wait()
        self._worker.shutdown(wait=True)
        super().close()
        for f in self._snap.values():
            f.close()


def build_speculative(ctx, cls, args: tuple, param_store):
    """The optimizer (*cls*) for ``offload_optimizer.super_offload: true`` (*args*: the
    offloaded optimizer's positional arguments)."""
    zc = ctx.config.zero_optimization
    off = zc.offload_optimizer
    if off.device not in ("cpu", "nvme"):
        raise ConfigError(
            f"zero_optimization.offload_optimizer.super_offload needs offload_optimizer."
            f"device 'cpu' or 'nvme' (got {off.device!r}): the speculative step is the host's; "
            f"set device to 'cpu', or super_offload to false")
    if ctx.world_comm.world_size != ctx.world_size:   # MiCS: replicas summed after backward
        raise ConfigError("zero_optimization.offload_optimizer.super_offload does not combine "
                          "with MiCS (mics_shard_size): set super_offload to false")
    return cls(*args, param_sink=param_store, ratio=off.ratio,
                                       device=ctx.device, device_kernels=ctx.kernels,
                                       cores_share=off.cpuadam_cores_perc)
