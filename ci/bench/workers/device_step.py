"""One rank of ci/bench/device.py (never run by hand): the demo GPT trained by zero-core on
the accelerator of ZERO_CORE_ACCELERATOR, timing each optimizer step and counting the
bytes that crossed between host and device in it.

Usage: ``device_step.py <stage> <preset> <warmup> <steps>``. Reports per-step wall times
(this rank; the driver takes the slowest rank's), host->device and device->host bytes from
the device's own counters (vdev's allocator; zero on the CPU, where nothing crosses), the
ledger's staged bytes and staging seconds, and the bytes sent on the wire.
"""
from __future__ import annotations

import os
import sys
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "examples"))
from gpt import build_model, lm_loss  # noqa: E402
from text_data import GlobalBatchSampler, load_stdlib_text  # noqa: E402

import zero_core  # noqa: E402
from zero_core.runtime.context import shutdown  # noqa: E402
from zero_core.testing.ranks import report  # noqa: E402

MICRO, SEQ = 4, 128


def counters(engine) -> tuple[int, int]:
    mod = getattr(torch, engine.device.type, None)
    if engine.device.type == "cpu" or not hasattr(mod, "memory_stats"):
        return 0, 0
    stats = mod.memory_stats(engine.device)
    return stats.get("h2d_bytes", 0), stats.get("d2h_bytes", 0)


def main():
    stage, preset, warmup, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model = build_model(preset, seed=1234)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    sampler = GlobalBatchSampler(load_stdlib_text(max_bytes=2 << 20).train, SEQ, MICRO,
                                 engine.world_size, seed=0)
    rows = []
    for step in range(warmup + steps):
        x, y = sampler.rank_batch(step, engine.global_rank)
        h2d0, d2h0 = counters(engine)
        ledger0 = engine.comm.ledger.snapshot()
        t0 = time.perf_counter()
        loss = lm_loss(engine(x), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        engine.runtime.accelerator.synchronize()
        elapsed = time.perf_counter() - t0
        h2d1, d2h1 = counters(engine)
        wire = engine.comm.ledger.difference(engine.comm.ledger.snapshot(), ledger0)
        if step >= warmup:
            rows.append({"time": elapsed, "h2d": h2d1 - h2d0, "d2h": d2h1 - d2h0,
                         "staged": wire["staged_bytes"], "staging_s": wire["staging_s"],
                         "sent": wire["sent_bytes"], "loss": float(loss.detach())})
    report({"params": n_params, "device": str(engine.device), "rows": rows,
            "peak": engine.runtime.accelerator.max_memory_allocated()})
    engine.destroy()
    shutdown()


if __name__ == "__main__":
    main()
