"""What the engine prints while it trains, as DeepSpeed 0.19.8 prints it: the
``wall_clock_breakdown`` timers and the ``steps_per_print`` progress line (rank 0 only).
The phases are also where ``flops_profiler`` (engine/flops.py) times its one step: at that
step only, ``wall_clock(name)`` returns the profiler's phase around the timer's own.

**Progress** (``steps_per_print``, default 10; ``inf``: never). Every that many optimizer
steps, DeepSpeed's line ``[Rank 0] step=20, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]``
(``mom``: each group's ``betas``, else its ``momentum``, else 0.0). The host learns a step's
outcome one step later (engine/update.py), so the line for step N is printed when step N's
verdict is taken into the books — at the next update, or sooner when a report asks
(``get_lr()``, a checkpoint, ``destroy()``); ``skipped`` and ``lr`` are then exact, and
printing it waits for nothing.

**Wall-clock breakdown** (``wall_clock_breakdown: true``). DeepSpeed's global timers, each
summed over the micro-steps of an optimizer step: ``fwd`` (``engine(...)``; evaluation calls
between steps too, as in DeepSpeed), ``bwd`` (``engine.backward``), within it ``bwd_inner``
(autograd, with the gradient reductions the hooks launch meanwhile) and ``bwd_allreduce``
(launching the buckets left at its end), and ``step`` (the update at the boundary: waiting
for the reductions, the norm all-reduce, the optimizer, the all-gather of the new values).
``iteration`` is the wall time from the end of one optimizer step to the end of the next
(the gap to the phases' sum is time outside the engine: data, loss). Every
``steps_per_print`` optimizer steps (every step when that is ``inf``: DeepSpeed prints the
breakdown at each step whatever steps_per_print says) rank 0 prints the mean per optimizer
step since its last print, and the bytes this rank sent in the collectives each phase
launched (its share of ``engine.comm_report()``, the CommLedger); the progress line, if due,
comes just before (the device has just been synchronized, so the verdict is there)::

    [Rank 0] time (ms) | fwd: 3.21 | bwd: 8.40 | bwd_inner: 7.90 | bwd_allreduce: 0.45 | step: 2.10 | iteration: 14.02
    [Rank 0] comm (MB sent) | fwd: 0.000 | bwd: 1.230 | step: 0.620

``engine.get_wall_clock_timers()`` returns the last optimizer step's times (ms), and with a
monitor configured rank 0 writes DeepSpeed's ``Train/Samples/elapsed_time_ms_*`` events at
each optimizer step. DeepSpeed's per-micro-step line (``fwd_microstep``, ...) is not printed.

**Cost.** Off, a phase is a shared ``nullcontext``: no synchronization, no clock read. On,
every phase boundary synchronizes the device (``accelerator.synchronize()``, as DeepSpeed's
timers do) so that the device work a phase queued is counted in that phase: this removes the
host's run-ahead across phases and slows the step a little, which is why it is a diagnostic
switch. Collectives run asynchronously by a communicator's own threads finish where they are
waited for (``step``), not where they were launched.
"""
from __future__ import annotations

import contextlib
import time

import torch

from zero_core.engine.flops import build_profiler

#: DeepSpeed's global timer names, in its print order
PHASES = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
#: the phases whose communication is counted (the inner two are parts of bwd)
COMM_PHASES = ("fwd", "bwd", "step")
#: DeepSpeed's monitor events: Train/Samples/elapsed_time_ms_<name>
MONITOR_NAMES = {"fwd": "forward", "bwd": "backward", "bwd_inner": "backward_inner",
                 "bwd_allreduce": "backward_allreduce", "step": "step"}

#: what a phase is when the breakdown is off (or the phase is already running): nothing
OFF = contextlib.nullcontext()


class _Phase:
    """One timed phase: synchronize, read the clock and the ledger on entry and exit."""

    __slots__ = ("clock", "name", "t0", "sent0", "calls0", "steps0")

    def __init__(self, clock: WallClock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self):
        self.clock._enter(self)

    def __exit__(self, exc_type, exc, tb):
        self.clock._exit(self, failed=exc_type is not None)
        return False


class WallClock:
    """The engine's timers and progress line (``engine.wall_clock``). ``wall_clock(name)``
    is the context the engine runs phase *name* in."""

    def __init__(self, engine):
        config = engine.config
        self.engine = engine
        self.enabled = bool(config.wall_clock_breakdown)
        self.steps_per_print = config.steps_per_print          # None: never
        self.every = config.steps_per_print or 1               # the breakdown's cadence
        self.printer = engine.global_rank == 0
        self._sync = engine.runtime.accelerator.synchronize
        self._ledger = engine.comm.ledger
        self._running: set[str] = set()
        self._mark: float | None = None        # clock at the end of the last optimizer step
        self._step = self._zeros()             # this optimizer step so far
        self._window = self._zeros()           # the optimizer steps since the last print
        self._window_steps = 0
        #: the last optimizer step: ms per timer (and "iteration"), bytes sent per phase
        self.last: dict[str, float] = {}
        self.last_comm: dict[str, dict[str, int]] = {}
        #: flops_profiler on rank 0 (engine/flops.py): it times the phases of its one step
        self.flops = build_profiler(engine)

    @staticmethod
    def _zeros() -> dict:
        return {"ms": dict.fromkeys(PHASES, 0.0),
                "comm": {p: {"sent_bytes": 0, "calls": 0} for p in COMM_PHASES},
                "iteration": 0.0}

    def __call__(self, name: str):
        phase = OFF if not self.enabled or name in self._running else _Phase(self, name)
        if self.flops is not None and self.flops.due():
            return self.flops.phase(name, phase)
        return phase

    # ---- phases --------------------------------------------------------------------------
    def _ledger_now(self) -> tuple[int, int]:
        snap = self._ledger.snapshot()
        return snap["sent_bytes"], sum(d["calls"] for d in snap["ops"].values())

    def _enter(self, phase: _Phase) -> None:
        self._running.add(phase.name)
        self._sync()
        if phase.name in COMM_PHASES:
            phase.sent0, phase.calls0 = self._ledger_now()
        phase.steps0 = self.engine.global_steps
        phase.t0 = time.perf_counter()
        if self._mark is None:
            self._mark = phase.t0

    def _exit(self, phase: _Phase, failed: bool) -> None:
        self._sync()
        now = time.perf_counter()
        self._running.discard(phase.name)
        self._step["ms"][phase.name] += (now - phase.t0) * 1e3
        if phase.name in COMM_PHASES:
            sent, calls = self._ledger_now()
            c = self._step["comm"][phase.name]
            c["sent_bytes"] += sent - phase.sent0
            c["calls"] += calls - phase.calls0
        if phase.name == "step" and not failed and self.engine.global_steps != phase.steps0:
            self._optimizer_step_done(now)

    def _optimizer_step_done(self, now: float) -> None:
        step = self._step
        step["iteration"] = (now - self._mark) * 1e3
        self._mark = now
        self.last = {**step["ms"], "iteration": step["iteration"]}
        self.last_comm = {p: dict(c) for p, c in step["comm"].items()}
        w = self._window
        for name, ms in step["ms"].items():
            w["ms"][name] += ms
        for p, c in step["comm"].items():
            for k, v in c.items():
                w["comm"][p][k] += v
        w["iteration"] += step["iteration"]
        self._window_steps += 1
        self._step = self._zeros()
        e = self.engine
        if self.printer and e.monitor.enabled:
            e.monitor.write_events([(f"Train/Samples/elapsed_time_ms_{MONITOR_NAMES[n]}",
                                     self.last[n], e.global_samples) for n in PHASES])
        if e.global_steps % self.every == 0:
            # the device is idle (just synchronized): the verdict is there to read, so the
            # progress line comes before the breakdown at no extra cost
            e._settle()
            if self.printer:
                self._print_window()
            self._window, self._window_steps = self._zeros(), 0

    def _print_window(self) -> None:
        n = max(self._window_steps, 1)
        w = self._window
        times = " | ".join(f"{name}: {w['ms'][name] / n:.2f}" for name in PHASES)
        _print(f"time (ms) | {times} | iteration: {w['iteration'] / n:.2f}")
        sent = " | ".join(f"{p}: {w['comm'][p]['sent_bytes'] / n / 1e6:.3f}"
                          for p in COMM_PHASES)
        _print(f"comm (MB sent) | {sent}")

    # ---- the progress line ---------------------------------------------------------------
    def progress(self, step: int) -> None:
        """Optimizer step *step* (1-based) is in the host's books: DeepSpeed's progress
        line, on rank 0, every ``steps_per_print`` steps."""
        if (self.steps_per_print is None or step % self.steps_per_print
                or not self.printer or self.engine.optimizer is None):
            return
        e = self.engine
        groups = e.optimizer.param_groups
        lr = [_host_value(g.get("lr", 0.0)) for g in groups]
        mom = [_host_value(g["betas"] if "betas" in g else g.get("momentum", 0.0))
               for g in groups]
        _print(f"step={step}, skipped={e._skipped_steps}, lr={lr}, mom={mom}")


def _host_value(v):
    """A hyperparameter as DeepSpeed prints it; a tensor on the host as its number (one on
    a device is not read back: that would synchronize)."""
    if isinstance(v, torch.Tensor):
        return v.tolist() if v.device.type == "cpu" else f"<tensor on {v.device}>"
    if isinstance(v, (list, tuple)):
        return type(v)(_host_value(x) for x in v)
    return v


def _print(message: str) -> None:
    print(f"[Rank 0] {message}", flush=True)
