"""Multi-rank worker for tests/test_nothing_silent.py: faults injected into real 2-rank jobs.

Usage: ``python nothing_silent.py`` on every rank (ZERO_CORE_COMM picks gloo or mpi). Runs
every scenario in one launch (engines are cheap, launches are not) and reports one dict
per scenario; the test checks them. Scenarios:

* non-finite gradients: at one step, rank 1 poisons the gradient of one parameter only
  (``l2.weight``) with inf or NaN, in fp32 and bf16, at stages 1-3, under each
  ``safety.nonfinite_gradients`` action; plus the consecutive-skip limit;
* ranks that disagree at initialize (stage 2 vs 3, stage 1 vs 2, fp32 vs bf16, a model
  with an extra layer) and micro-batch sizes that differ at a step;
* misuse: step() without backward(); backward() twice on one graph.
"""
from __future__ import annotations

import logging
import time

import torch

import zero_core
from zero_core.testing.ranks import leave_rank, report

SEED = 20261125


class PoisonGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by *value* (inf or NaN)."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.value, None


class Net(torch.nn.Module):
    def __init__(self, extra: bool = False):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)
        if extra:
            self.l3 = torch.nn.Linear(4, 4)
        self.poison = None  # set to inf/NaN for one step: only l2.weight's gradient is hit

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        w = self.l2.weight if self.poison is None else PoisonGrad.apply(self.l2.weight, self.poison)
        return torch.nn.functional.linear(h, w, self.l2.bias)


def config(stage=2, precision="fp32", micro=4, **safety):
    cfg = {"train_micro_batch_size_per_gpu": micro, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "safety": {"launcher_notice": False, **safety}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(cfg, extra=False):
    torch.manual_seed(SEED)
    model = Net(extra)
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    return engine, model


def train_step(engine, model, rank, step, poison=None, batch=4, backward_twice=False):
    g = torch.Generator().manual_seed(SEED + 97 * step + rank)
    x = torch.randn(batch, 8, generator=g).to(engine.compute_dtype)
    model.poison = poison if rank == 1 else None
    loss = engine(x).float().pow(2).mean()
    model.poison = None
    if backward_twice:
        engine.backward(loss, retain_graph=True)
    engine.backward(loss)
    engine.step()


def state(engine) -> list[torch.Tensor]:
    """Clones of everything an update changes on this rank: parameters (this rank's
    partition at stage 3), fp32 master, optimizer states, step counts (host books: taken
    up to date first, as every report of the engine does)."""
    engine.get_global_grad_norm()
    out = []
    for j, gb in enumerate(engine.parts.buffers):
        if gb is None:
            continue
        out.append(gb.param_buf.data.clone())
        if gb.master is not None:
            out.append(gb.master.data.clone())
        out += [fb.data.clone() for fb in engine.optimizer.flat_state[j].values()]
    out.append(torch.tensor(engine.optimizer.step_counts))
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def finite(tensors) -> bool:
    return all(bool(torch.isfinite(t.float()).all()) for t in tensors)


def error_of(fn, *args, **kwargs) -> str | None:
    """``"<Type>: <message>"`` of the ZeroCoreError *fn* raised, or None."""
    try:
        fn(*args, **kwargs)
    except zero_core.ZeroCoreError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def nonfinite(rank, stage, precision, poison_name, action):
    poison = {"inf": float("inf"), "nan": float("nan")}[poison_name]
    engine, model = build(config(stage, precision, nonfinite_gradients=action))
    log = Captured()
    logging.getLogger("zero_core.engine").addHandler(log)
    try:
        for step in range(2):
            train_step(engine, model, rank, step)
        before = state(engine)
        out = {"scenario": "nonfinite", "stage": stage, "precision": precision,
               "poison": poison_name, "action": action,
               "error": error_of(train_step, engine, model, rank, 2, poison=poison)}
        after = state(engine)
        out.update(unchanged=same(before, after), finite_after=finite(after),
                   skipped=engine.skipped_steps, global_steps=engine.global_steps,
                   norm=engine.get_global_grad_norm())
        # the step was decided on the device; its warning or error comes with the next
        # update, where every rank reads the verdict (engine/update.py)
        out["error"] = out["error"] or error_of(train_step, engine, model, rank, 3)
        out["logged"] = list(log.lines)
        train_step(engine, model, rank, 4)  # training goes on after a skip (or a caught raise)
        healthy = state(engine)
        out.update(moved_after=not same(after, healthy), finite_later=finite(healthy))
        return out
    finally:
        logging.getLogger("zero_core.engine").removeHandler(log)
        engine.destroy()


def consecutive_limit(rank):
    engine, model = build(config(2, "fp32", max_consecutive_skips=2))
    out = {"scenario": "consecutive", "errors": []}
    try:
        train_step(engine, model, rank, 0)
        for step in (1, 2, 3):  # two poisoned steps; the second one's verdict comes at step 3
            out["errors"].append(error_of(train_step, engine, model, rank, step,
                                          poison=float("nan") if step < 3 else None))
        out["skipped"] = engine.skipped_steps
        return out
    finally:
        engine.destroy()


def disagree(rank, name, cfgs, extras=(False, False)):
    """Each rank initializes with its own config/model: expect one named error everywhere."""
    t0 = time.monotonic()
    error = error_of(lambda: build(cfgs[rank], extras[rank])[0].destroy())
    return {"scenario": "disagree", "name": name, "error": error,
            "seconds": time.monotonic() - t0}


def batch_mismatch(rank):
    engine, model = build(config(2, "fp32"))
    out = {"scenario": "batch_mismatch"}
    try:
        train_step(engine, model, rank, 0)
        before = state(engine)
        out["error"] = error_of(train_step, engine, model, rank, 1, batch=4 if rank == 0 else 3)
        out["unchanged"] = same(before, state(engine))
        # named at the next update, where every rank reads the step's verdict
        out["error"] = out["error"] or error_of(train_step, engine, model, rank, 2)
        train_step(engine, model, rank, 3)  # equal sizes again: trains
        out["global_steps"] = engine.global_steps
        return out
    finally:
        engine.destroy()


def step_without_backward(rank):
    engine, model = build(config(3, "fp32"))
    out = {"scenario": "no_backward"}
    try:
        train_step(engine, model, rank, 0)
        before = state(engine)
        out["error"] = error_of(engine.step)
        out["unchanged"] = same(before, state(engine))
        out["global_steps"] = engine.global_steps
        return out
    finally:
        engine.destroy()


def backward_twice(rank, stage):
    """retain_graph=True then a second backward accumulates the gradient twice, as torch
    does: the update equals one backward of 2 × loss. Without retain_graph, torch's own
    error, and the engine trains on afterwards."""
    results = []
    for twice in (True, False):
        engine, model = build(config(stage, "fp32"))
        try:
            g = torch.Generator().manual_seed(SEED + rank)
            x = torch.randn(4, 8, generator=g)
            loss = engine(x).pow(2).mean()
            if twice:
                engine.backward(loss, retain_graph=True)
                engine.backward(loss)
            else:
                engine.backward(2 * loss)
            engine.step()
            results.append(state(engine))
        finally:
            engine.destroy()
    engine, model = build(config(stage, "fp32"))
    error = None
    try:
        loss = engine(torch.randn(4, 8)).pow(2).mean()
        engine.backward(loss)
        try:
            engine.backward(loss)
        except RuntimeError as exc:
            error = f"{type(exc).__name__}: {exc}"
        engine.step()
        train_step(engine, model, rank, 1)
        trains_on = engine.global_steps == 2
    finally:
        engine.destroy()
    return {"scenario": "backward_twice", "stage": stage, "twice_equals_double":
            same(results[0], results[1]), "second_error": error, "trains_on": trains_on}


def main():
    engine, _ = build(config(0, "fp32"))  # starts the runtime
    rank = engine.global_rank
    engine.destroy()
    out = []
    for precision in ("fp32", "bf16"):
        for stage in (1, 2, 3):
            for poison in ("inf", "nan"):
                out.append(nonfinite(rank, stage, precision, poison, "skip"))
        out.append(nonfinite(rank, 3, precision, "nan", "raise"))
        out.append(nonfinite(rank, 2, precision, "inf", "ignore"))
    out.append(consecutive_limit(rank))
    out.append(disagree(rank, "stage 2 vs 3", [config(2), config(3)]))
    out.append(disagree(rank, "stage 1 vs 2", [config(1), config(2)]))
    out.append(disagree(rank, "fp32 vs bf16", [config(2, "fp32"), config(2, "bf16")]))
    out.append(disagree(rank, "model", [config(2), config(2)], extras=(False, True)))
    out.append(batch_mismatch(rank))
    out.append(step_without_backward(rank))
    for stage in (0, 1, 2, 3):
        out.append(backward_twice(rank, stage))
    report(out)
    leave_rank()


if __name__ == "__main__":
    main()
