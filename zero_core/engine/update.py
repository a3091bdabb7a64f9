"""The optimizer update at an accumulation boundary, decided on the device; what the host
learns of it, one step later (ARCHITECTURE §4, "a step without synchronizations").

On a GPU every value the host reads back — an ``.item()``, a norm, an overflow flag, a
``torch.tensor(..., device=...)`` — makes it wait until the device has caught up, and a
host that waits cannot queue the next step's kernels. So the update's decisions are device
tensors handed to the kernels:

* the global squared gradient norm (one all-reduce, which also carries the sample counts
  for the equal-batch check), the clip coefficient and ``1/loss_scale``: the one gradient
  multiplier (``optimizer.grad_factor``);
* whether to skip (non-finite gradients, unequal batches): ``found_inf``, which the kernels
  honour by leaving weights and states untouched (torch's fused optimizers' own flag);
* the fp16 loss scale's next value (optim/loss_scaler.py ``update_on_device``).

The host's share — the LR schedule (which does not advance on a skipped step, as in
DeepSpeed), ``skipped_steps``, the norm report, monitor events, warnings and errors — comes
from a few float64 (:class:`Verdict`) copied with ``non_blocking`` into pinned memory and
read when the host next needs them: at the next update, before its learning rate is used, or
when a report asks (``get_lr()``, ``skipped_steps``, ...). By then the device has finished the
step in any real pipeline; an event query confirms it, and only if it has not is the wait a
synchronization (counted by the device, as every wait is).

Errors and warnings that name something (the first parameter with a non-finite gradient,
each rank's sample count) are raised at *collective* points only — the next update,
``save_checkpoint``/``load_checkpoint`` — where every rank reads the same verdict, never
from a report that one rank alone calls. They name the step they are about; its weights
were not updated.

Optimizers that must know before they step — ``torch.optim`` rules, Lamb (its trust
ratios are read on the host), the host optimizer of ``offload_optimizer``, a kernel set
without ``skips_on_device`` — read the verdict at once: one counted synchronization per step.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from zero_core.checkpoint.engine_state import layout_fragments, parameter_names
from zero_core.engine.step_stats import (all_reduce_step_stats, batches_differ,
                                         raise_batch_mismatch)
from zero_core.interfaces.ledger import CommLedger
from zero_core.optim.grad_norm import CHUNK, PieceNorms
from zero_core.optim.loss_scaler import LossScaleUnderflowError, underflow_message
from zero_core.optim.nonfinite import NonFiniteGradientError

log = logging.getLogger("zero_core.engine")

# the verdict's fields, in the order of its float64 vector
FIELDS = ("sumsq", "norm", "factor", "skip", "nonfinite", "differ", "underflow")


class GradPieces:
    """This rank's reduced gradient cut at parameter boundaries (and every ``CHUNK``
    elements). One norm per piece gives the global norm — float32 within a piece, float64
    across, as optim/grad_norm.py — and, when it is not finite, the first parameter to
    blame, with no second pass over the gradients."""

    def __init__(self, module, rank: int):
        self.names = parameter_names(module)                      # id(param) -> name
        self.order = {n: i for i, n in enumerate(self.names.values())}
        self.rank = rank
        self._key = None
        self.pieces: list[torch.Tensor] = []
        self.owners: list[int] = []        # piece -> parameter index (named_parameters order)
        self._norms: PieceNorms | None = None

    def _build(self, buffers) -> None:
        self.pieces, self.owners = [], []
        for gb in buffers:
            grads = _grad_source(gb)
            owned = sum(t.numel() for t in gb.reduced_grad_tensors())
            # stage 0 norms its whole buffer (every rank's slices); the others their own
            ranks = range(gb.world_size) if owned == grads.data.numel() and grads.kind == "full" \
                else [self.rank]
            for f in layout_fragments(gb.layout, gb.params, self.names, {"g": grads},
                                      self.rank, ranks):
                t = f.tensors["g"]
                for lo in range(0, t.numel(), CHUNK):
                    self.pieces.append(t[lo:lo + CHUNK])
                    self.owners.append(self.order[f.name])
        self._norms = PieceNorms(self.pieces)

    def norms(self, buffers) -> torch.Tensor:
        """The L2 norm of every piece: a float32 vector on the gradients' device."""
        key = tuple((id(gb), _grad_source(gb).data.data_ptr()) for gb in buffers)
        if key != self._key:
            self._build(buffers)
            self._key = key
        if not self.pieces:
            device = buffers[0].master.data.device if buffers else torch.device("cpu")
            return torch.zeros(0, dtype=torch.float32, device=device)
        return self._norms()

    def first_nonfinite(self, norms: list[float]) -> int:
        """Index (``named_parameters`` order) of the first parameter whose piece norm is
        not finite on this rank; the number of parameters if none."""
        bad = [self.owners[i] for i, n in enumerate(norms) if not math.isfinite(n)]
        return min(bad, default=len(self.order))


def _grad_source(gb):
    """The flat buffer holding *gb*'s reduced gradients: its partition, or (stages 0-1)
    the full gradient buffer."""
    part = getattr(gb, "grad_part", None)
    return part if part is not None else gb.grad_buf


@dataclass
class Decision:
    """One update's decisions, as device tensors."""
    factor: torch.Tensor      # float32: gradients are multiplied by it (unscale × clip)
    found_inf: torch.Tensor   # float32: 1.0 skips the update in the kernels
    overflow: torch.Tensor    # bool: non-finite gradients (the fp16 scaler's input)
    values: torch.Tensor      # float64: FIELDS without underflow


def decide(stats: torch.Tensor, *, world_size: int, check_batches: bool,
           skip_nonfinite: bool, scale, postscale: float, clip: float) -> Decision:
    """*stats*: the all-reduced ``[squared norm, Σn, Σn²]`` (step_stats.py); *scale*: the
    fp16 loss scale (float or 0-dim tensor)."""
    sumsq = stats[0]
    nonfinite = ~torch.isfinite(sumsq)
    differ = batches_differ(stats, world_size) if check_batches else torch.zeros_like(nonfinite)
    skip = (nonfinite | differ) if skip_nonfinite else differ
    # the order of operations is the host formula's: the same rounding
    norm = sumsq.sqrt() * postscale / scale
    factor = postscale / scale if isinstance(scale, torch.Tensor) \
        else torch.full_like(sumsq, postscale / scale)
    if clip > 0:  # torch.nn.utils.clip_grad_norm_'s coefficient, for a finite norm
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        factor = factor * torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    flags = torch.stack([skip, nonfinite, differ]).to(torch.float64)
    values = torch.cat([torch.stack([sumsq, norm, factor.to(torch.float64)]), flags])
    return Decision(factor=factor.to(torch.float32), found_inf=skip.to(torch.float32),
                    overflow=nonfinite, values=values)


class Verdict:
    """One update's decisions on their way to the host: a non-blocking copy into pinned
    memory and an event after it (on the CPU, the values themselves)."""

    #: the landing buffer is host memory by design (zero_core/testing/device_audit.py)
    HOST_ATTRS = ("_host",)

    def __init__(self, step: int, samples: int, values: torch.Tensor, norms: torch.Tensor,
                 accelerator, stepped: bool):
        self.step = step
        self.samples = samples        # this rank's, to name them if the ranks' differ
        self.norms = norms            # per-piece norms, read only to name a bad parameter
        self.stepped = stepped        # the kernels ran (with found_inf) before the host knew
        self._values = None
        if values.device.type == "cpu":
            self._host, self._event = values, None
        else:
            self._host = accelerator.pin_memory(torch.empty(values.numel(), dtype=torch.float64))
            self._host.copy_(values, non_blocking=True)
            self._event = accelerator.record_event()

    def read(self) -> dict:
        """The values (waiting for the copy only if an event query says it has not
        landed: the one synchronization this can cost)."""
        if self._values is None:
            if self._event is not None and not self._event.query():
                self._event.synchronize()
            self._values = dict(zip(FIELDS, self._host.tolist()))
        return self._values


class UpdateStep:
    """Runs the update at each boundary and keeps the host's books of past ones."""

    def __init__(self, engine):
        self.engine = engine
        self.pieces = GradPieces(engine.module, engine.sharding.rank)
        self.pending: list[Verdict] = []      # not yet taken into the books
        #: the last update's global norm as a 0-dim device tensor (inf when it was skipped)
        self.last_norm: torch.Tensor | None = None
        self.unreported: list[Verdict] = []   # in the books; warnings/errors still to come

    # ---- the update -----------------------------------------------------------------------
    def run(self) -> None:
        e = self.engine
        # the previous update's books first: the LR schedule may advance before this one
        self.settle(collective=True)
        e.reducer.flush()
        e.reducer.wait_all()
        present = [gb for gb in e.parts.buffers if gb is not None]
        self._reduce_across_replicas(present)
        norms = self.pieces.norms(present)
        local = norms.double().square().sum()
        if e.sharding.num_replicas > 1:
            # every copy holds the same reduced gradients: the world's sum counts each R times
            local = local / e.sharding.num_replicas
        check = e.config.safety.check_batch_sizes and e.world_size > 1
        stats = all_reduce_step_stats(
            e.comm, local, e._window_samples, e.world_size,
            reduce_norm=(e.stage > 0 or e.optimizer.local_gradients) and e.world_size > 1,
            check_batches=check)
        scaler = e.loss_scaler
        d = decide(stats, world_size=e.world_size, check_batches=check, skip_nonfinite=scaler is not None
                   or e._nonfinite.action != "ignore",
                   scale=scaler.current if scaler is not None else 1.0,
                   postscale=e._postscale, clip=e.config.gradient_clipping)
        if scaler is not None:  # d.factor already holds the scale this step's gradients carry
            scaler.update_on_device(d.overflow)
        underflow = (scaler.underflow if scaler is not None and scaler.underflow is not None
                     else torch.zeros((), dtype=torch.float64, device=d.values.device))
        values = torch.cat([d.values, underflow.reshape(1).to(d.values.device)])
        self.last_norm = torch.where(d.found_inf > 0, torch.full_like(d.values[1], math.inf),
                                     d.values[1])
        opt = e.optimizer
        on_device = opt.skips_on_device
        # issued before the kernels: the copy lands while the optimizer still runs
        verdict = Verdict(e.global_steps, e._window_samples, values, norms,
                          e.runtime.accelerator, on_device)
        self.pending.append(verdict)
        if on_device:
            opt.grad_factor, opt.found_inf = d.factor, d.found_inf
            opt.step()
        else:  # the host decides: read the verdict now (a synchronization)
            v = verdict.read()
            if not v["skip"]:
                opt.grad_factor, opt.found_inf = v["factor"], None
                opt.step()
            self.settle(collective=True)
        e.zero_grad()
        e._window_samples = 0
        e.global_steps += 1
        now = e.comm.ledger.snapshot()
        e._last_comm = CommLedger.difference(now, e._comm_mark)
        e._comm_mark = now

    def _reduce_across_replicas(self, present: list) -> None:
        """MiCS: sum each rank's reduced gradient partition over its replica group (the
        ranks holding the same partition in the other shard groups), once per step."""
        e = self.engine
        group = e.sharding.replicas
        if group is None or e.sharding.replicas_in_reduce:
            return
        handles = [e.comm.all_reduce(t, "sum", group=group, async_op=True)
                   for gb in present for t in gb.reduced_grad_tensors()]
        for h in handles:
            h.wait()

    # ---- the host's books --------------------------------------------------------------------
    def settle(self, collective: bool) -> None:
        """Take every pending verdict into the books (counters, LR schedule, norm report,
        monitor); with *collective* (every rank calls this at the same point), also raise
        or warn about the verdicts that call for it."""
        e = self.engine
        while self.pending:
            verdict = self.pending.pop(0)
            v = verdict.read()
            if v["skip"]:
                if verdict.stepped:
                    e.optimizer.undo_step()
                e._skipped_steps += 1
                e._global_grad_norm = float("inf")
            else:
                if e.lr_scheduler is not None:
                    e.lr_scheduler.step()
                e._global_grad_norm = v["norm"]
            if v["nonfinite"] or v["differ"] or v["underflow"]:
                self.unreported.append(verdict)
            elif e.loss_scaler is None:
                e._nonfinite.consecutive = 0
            self._write_monitor()
            e.wall_clock.progress(verdict.step + 1)   # steps_per_print (engine/timers.py)
        if collective:
            self._report()

    def _write_monitor(self) -> None:
        e = self.engine
        if e.monitor.enabled and e.global_rank == 0:
            # what DeepSpeed 0.19.8 writes at each optimizer step, skipped steps included
            events = [("Train/Samples/lr", float(e.optimizer.param_groups[0]["lr"]),
                       e.global_samples)]
            if e.loss_scaler is not None:
                events.append(("Train/Samples/loss_scale", e.loss_scale, e.global_samples))
            e.monitor.write_events(events)

    def _report(self) -> None:
        """Collective: the errors and warnings of settled verdicts, in step order."""
        e = self.engine
        while self.unreported:
            verdict = self.unreported.pop(0)
            v = verdict.read()
            if v["differ"]:
                self.unreported.clear()
                e._drop_window()
                raise_batch_mismatch(e.comm, verdict.samples, e.world_size, verdict.step)
            if v["underflow"]:
                self.unreported.clear()
                e._drop_window()
                raise LossScaleUnderflowError(underflow_message(e.loss_scaler.min_scale,
                                                                verdict.step))
            if e.loss_scaler is None:
                try:
                    e._nonfinite.should_skip(False, verdict.step, v["sumsq"],
                                             lambda: self._first_nonfinite_name(verdict),
                                             e.global_rank)
                except NonFiniteGradientError:
                    self.unreported.clear()
                    e._drop_window()
                    raise

    def _first_nonfinite_name(self, verdict: Verdict) -> str | None:
        """Collective: the first parameter (``named_parameters`` order) whose reduced
        gradient held inf/NaN on any rank at *verdict*'s step."""
        e = self.engine
        first = self.pieces.first_nonfinite(verdict.norms.tolist())
        if e.world_size > 1:
            t = torch.tensor([first], dtype=torch.int64)
            e.comm.all_reduce(t, "min")
            first = int(t)
        names = list(self.pieces.order)
        return names[first] if first < len(names) else None
