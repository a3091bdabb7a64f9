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

1. at the end of the boundary micro-step's backward (``engine.backward`` calls
   :meth:`Speculation.speculate`; the reductions are waited for first),
   every host sub-group's reduced gradient is copied to host memory, and a worker thread
   steps each one with the factor the step will have if nothing intervenes —
   ``postscale / loss_scale`` (``grad_factor`` without clipping) — after saving the
   sub-group's master and states (a copy);
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

So every result equals the non-speculative offloaded step bit for bit (same kernels, same
operations on the same fp32 values; a rollback restores copies, never inverts arithmetic).
Unlike DeepSpeed, it speculates with ``gradient_clipping`` set too: clipping usually does
not trigger, and when it does the redo makes the result exact.

Differences, and why: the speculation starts when the backward has ended, not per
sub-group during it — zero-core's reducers offer no per-unit completion callback, so the
host step overlaps what follows the backward (the norm, its all-reduce, the verdict, the
user's code until ``step()``), not the backward itself. The worker is a thread, not a
process (torch's CPU kernels release the GIL); ``cpuadam_cores_perc`` pins it, as
ZenFlow's worker is pinned (``os.sched_setaffinity`` of the thread, the last share of the
process's cores). Host memory: the gradient copy and the saved values cost 4 + 4·(1 + number
of states) bytes per host element on top of the store. Stages 1-3 with
``offload_optimizer.device: cpu`` (DeepSpeed: stage 3 only; the offloaded optimizer here
is one class for all three) and without MiCS (whose gradients are summed across replicas
after the backward); ``ratio`` < 1 combines (device sub-groups step in ``step()``).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from zero_core.errors import ConfigError
from zero_core.offload.host import MASTER


def _pin_thread(share: float) -> None:
    """Pin the calling thread to the last *share* of the process's cores (Linux)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return
    keep = cores[int((1 - share) * len(cores)):] or cores[-1:]
    os.sched_setaffinity(threading.get_native_id(), keep)


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
        self._grads: dict = {}
        self._saved: dict = {}
        self._pending = None      # (futures, factor, hyper, counts) of the speculation
        self.counts = {"speculated": 0, "accepted": 0, "redone": 0, "rolled_back": 0}

    # ---- speculation ---------------------------------------------------------------------
    def _hyper(self) -> list:
        return [(float(g["lr"]), tuple(g.get("betas", ())), float(g.get("eps", 0.0)),
                 float(g.get("weight_decay", 0.0))) for g in self.param_groups]

    @torch.no_grad()
    def speculate(self, reducer, postscale: float, loss_scaler) -> None:
        """The boundary backward has ended: start the host sub-groups' steps with the
        factor an unclipped, unskipped step will have."""
        self._abandon()
        reducer.wait_all()
        scale = float(loss_scaler.current) if loss_scaler is not None else 1.0
        factor = postscale / scale
        counts = [c + 1 for c in self.step_counts]
        for sg in self._host_sgs:
            grad = self._grads.get((sg.group, sg.index))
            if grad is None:
                grad = self._grads[(sg.group, sg.index)] = torch.empty(sg.numel)
            gb = self.buffers[sg.group]
            for p in sg.pieces:   # device -> host on this thread: the copies stay ordered
                src = gb.reduced_grad_bucket(p.bucket).narrow(0, p.shard_offset, p.numel)
                dst = grad.narrow(0, p.sub_offset, p.numel)
                dst.copy_(src)
                self.comm.ledger.record_copy("offload_optimizer", dst, src)
        futures = [self._worker.submit(self._speculate_one, sg, factor, counts[sg.group])
                   for sg in self._host_sgs]
        self._pending = (futures, factor, self._hyper(), counts)
        self.counts["speculated"] += 1

    def _speculate_one(self, sg, factor: float, step: int) -> None:
        key = (sg.group, sg.index)
        states = self.store.acquire(sg)
        saved = self._saved.get(key)
        if saved is None:
            saved = self._saved[key] = {n: torch.empty_like(t) for n, t in states.items()}
        for n, t in states.items():
            saved[n].copy_(t)
        grad = self._grads[key]
        if factor != 1.0:
            grad.mul_(factor)
        self._kernel_subgroup(sg.group, states, grad, step=step)

    def _wait(self) -> None:
        for f in self._pending[0]:
            f.result()

    @torch.no_grad()
    def _abandon(self) -> None:
        """A speculation that ``step()`` did not take (a skipped step, or the states are
        touched before it): put the saved values back."""
        if self._pending is None:
            return
        self._wait()
        for sg in self._host_sgs:
            states = self.store.acquire(sg)
            for n, t in self._saved[(sg.group, sg.index)].items():
                states[n].copy_(t)
        self._pending = None
        self.counts["rolled_back"] += 1

    def host_view(self) -> None:
        self._abandon()
        super().host_view()

    def before_unit_write(self) -> None:
        self._abandon()

    # ---- validation ------------------------------------------------------------------------
    def step(self, closure=None):
        self._valid = False
        if self._pending is not None:
            self._wait()
            _, factor, hyper, counts = self._pending
            self._valid = (float(self.grad_factor) == factor and hyper == self._hyper()
                           and counts == [c + 1 for c in self.step_counts])
            if not self._valid:
                self.counts["redone"] += 1
        try:
            super().step(closure)
        finally:
            if self._pending is not None and self._valid:
                self.counts["accepted"] += 1
            self._pending = None

    def _step_subgroup(self, sg, sends: dict, inflight) -> None:
        key = (sg.group, sg.index)
        if self._pending is None or key in self._device_keys:
            super()._step_subgroup(sg, sends, inflight)
            return
        states = self.store.acquire(sg)
        if not self._valid:   # rollback, then the plain step with the verdict's factor
            for n, t in self._saved[key].items():
                states[n].copy_(t)
            super()._step_subgroup(sg, sends, inflight)
            return
        self._write_parameters(self.buffers[sg.group], sg, states[MASTER], sends, inflight)
        self.store.release(sg)

    def offload_report(self) -> dict:
        rep = super().offload_report()
        rep["super_offload"] = dict(self.counts)
        return rep

    def close(self) -> None:
        if self._pending is not None:
            self._wait()
        self._worker.shutdown(wait=True)
        super().close()


def build_speculative(ctx, cls, args: tuple, param_store):
    """The optimizer (*cls*) for ``offload_optimizer.super_offload: true`` (*args*: the
    offloaded optimizer's positional arguments)."""
    zc = ctx.config.zero_optimization
    off = zc.offload_optimizer
    if off.device != "cpu":
        raise ConfigError(
            f"zero_optimization.offload_optimizer.super_offload needs offload_optimizer."
            f"device 'cpu' (got {off.device!r}): the speculative step runs on host memory; "
            f"set device to 'cpu', or super_offload to false")
    if ctx.world_comm.world_size != ctx.world_size:   # MiCS: replicas summed after backward
        raise ConfigError("zero_optimization.offload_optimizer.super_offload does not combine "
                          "with MiCS (mics_shard_size): set super_offload to false")
    return cls(*args, param_sink=param_store, ratio=off.ratio,
                                       device=ctx.device, device_kernels=ctx.kernels,
                                       cores_share=off.cpuadam_cores_perc)
