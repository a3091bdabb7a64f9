"""Multi-rank worker for tests/test_sync_free_step.py: host-device synchronizations per
steady-state training step, counted by the vdev device, across the engine matrix.

Usage: ``python sync_count.py <scenario>[,<scenario>...] <scratch dir>`` on every rank, with
ZERO_CORE_ACCELERATOR=vdev, the device-aware transport (ZERO_CORE_COMM=vdev-gloo: nothing
is staged through the host, as with nccl on a GPU) and vdev's asynchronous mode
(VDEV_ASYNC=1). Each scenario (tests/workers/device_matrix.py's configurations, plus a step
with a non-finite gradient and the optimizers that decide on the host) trains WARMUP
optimizer steps, then COUNTED more with vdev's counters reset; it reports the
synchronizations per step by kind and, for each one, the engine line that made it (vdev's
sync debug mode "warn" turns each into a warning whose stack names it).
"""
from __future__ import annotations

import collections
import os
import sys
import traceback
import warnings

import torch

import zero_core
from zero_core.runtime.context import shutdown
from zero_core.testing.ranks import report

sys.path.insert(0, os.path.dirname(__file__))
from device_matrix import GAS, SEED, build, scenario_config  # noqa: E402
from stage3_train import MICRO, ce, global_batch  # noqa: E402

WARMUP, COUNTED = 2, 2
EXTRA = ("lamb", "torch_opt", "nonfinite_skip", "progress_every_step", "wall_clock_on")


def extra_config(name: str, scratch: str) -> tuple[dict, dict]:
    cfg, opts = scenario_config("s2", scratch)
    if name == "lamb":
        cfg["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-2}}
    if name == "progress_every_step":  # steps_per_print's line at every step (engine/timers.py)
        cfg["steps_per_print"] = 1
    if name == "wall_clock_on":  # the breakdown synchronizes at each phase, by design
        cfg["steps_per_print"], cfg["wall_clock_breakdown"] = 1, True
    if name == "torch_opt":  # a torch.optim optimizer: the host must decide before it steps
        del cfg["optimizer"]
        opts = {**opts, "optimizer": lambda params: torch.optim.RMSprop(params, lr=1e-3)}
    return cfg, opts


def train_step(engine, model, step: int) -> None:
    """One optimizer step as a GPU training loop runs it: batches in pinned memory (a
    DataLoader with pin_memory=True), moved without blocking, the loss not read."""
    rank, world = engine.global_rank, engine.world_size
    ids, tgt = global_batch(SEED, step, MICRO * GAS * world)
    for m in range(GAS):
        rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
        x, y = ids[rows].pin_memory(), tgt[rows].pin_memory()
        loss = ce(engine(x), y.to(engine.device, non_blocking=True))
        engine.backward(loss)
        engine.step()


def poisoned_step(engine, model, step: int) -> None:
    """A step whose gradient is inf on one parameter (every rank): skipped on the device."""
    model.poison_grad = True
    try:
        train_step(engine, model, step)
    finally:
        model.poison_grad = False


def _where_it_synced(sites: collections.Counter):
    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f"{os.path.relpath(f.filename)}:{f.lineno}" for f in traceback.extract_stack()
                 if "zero_core" in f.filename and "testing" not in f.filename]
        what = str(message).split("synchronizing operation:", 1)[-1].split("(Triggered")[0]
        sites[f"{what.strip()} at {' <- '.join(reversed(stack[-6:])) or filename}"] += 1
    return show


def count(name: str, scratch: str) -> dict:
    cfg, opts = (extra_config(name, scratch) if name in EXTRA
                 else scenario_config(name, scratch))
    engine, model = build(cfg, opts)
    if name == "nonfinite_skip":
        hook = model.mix.weight.register_hook(
            lambda g: torch.full_like(g, float("inf")) if getattr(model, "poison_grad", False)
            else g)
    for s in range(WARMUP):
        train_step(engine, model, s)
    engine.get_lr()  # the warm-up's books settled before counting
    torch.vdev.reset_transfer_stats()
    sites: collections.Counter = collections.Counter()
    torch.vdev.set_sync_debug_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _where_it_synced(sites)
        each = []  # the synchronizations of each counted step
        for s in range(WARMUP, WARMUP + COUNTED):
            before = torch.vdev.sync_stats()["total"]
            if name == "nonfinite_skip" and s == WARMUP:
                poisoned_step(engine, model, s)
            else:
                train_step(engine, model, s)
            each.append(torch.vdev.sync_stats()["total"] - before)
    torch.vdev.set_sync_debug_mode("default")
    stats = torch.vdev.sync_stats()
    out = {"per_step": {k: v / COUNTED for k, v in stats.items()}, "sites": dict(sites),
           "each_step": each,
           "async": torch.vdev.is_async(), "skipped": engine.skipped_steps,
           "gas": GAS, "device": str(engine.device)}
    if name == "nonfinite_skip":
        hook.remove()
    engine.destroy()
    return out


def main():
    names, scratch = sys.argv[1].split(","), sys.argv[2]
    zero_core.init_distributed()
    report({name: count(name, scratch) for name in names})
    shutdown()


if __name__ == "__main__":
    main()
