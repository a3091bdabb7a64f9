"""One rank of ci/bench/validate_plan.py: train the example GPT with one ZeRO configuration and
report what `zero-core plan` predicts, measured: the peak of this process's resident memory
during training above its size before the model existed, and the median step time.

    python plan_check.py --preset bench --config '<the planner's DeepSpeed-style config>'

Memory: the resident-set peak (VmHWM) is reset (``/proc/self/clear_refs``) after the
engine is built, so the one-time peak of building the full model on every rank before
partitioning is not counted (the planner predicts training, and zero_core.Init avoids that
peak); the baseline is VmRSS right after the runtime started, before the model was built.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples"))

import zero_core  # noqa: E402
from gpt import build_model, lm_loss  # noqa: E402
from zero_core.testing.ranks import leave_rank, report  # noqa: E402


def status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")   # resets VmHWM to the current VmRSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def warm_up_torch() -> None:
    """One plain-torch training step of the tiny GPT, thrown away: the libraries torch
    loads and the pools it sets up on first use (oneDNN, the autograd engine's threads)
    are then part of the baseline, not of the configuration measured."""
    import gc
    model = build_model("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.block_size + 1))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    del model, opt, x
    gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--config", required=True, help="the config, as JSON (planner.ds_config)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()

    config = dict(json.loads(a.config), safety={"launcher_notice": False})
    micro = config["train_micro_batch_size_per_gpu"]
    zero_core.init_distributed()
    warm_up_torch()
    baseline_kib = status_kib("VmRSS")
    model = build_model(a.preset, seed=1234)
    engine, *_ = zero_core.initialize(model=model, config=config)
    del model
    seq, vocab = engine.module.cfg.block_size, engine.module.cfg.vocab_size
    gen = torch.Generator().manual_seed(engine.global_rank)
    batches = [torch.randint(0, vocab, (micro, seq + 1), generator=gen)
               for _ in range(a.warmup + a.steps)]
    reset = reset_peak()
    times = []
    for i, batch in enumerate(batches):
        engine.comm.barrier()
        start = time.perf_counter()
        loss = lm_loss(engine(batch[:, :-1]), batch[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.comm.barrier()
        if i >= a.warmup:
            times.append(time.perf_counter() - start)
    ledger = engine.memory_report()["ledger"]
    report({"rank": engine.global_rank, "world_size": engine.world_size,
            "num_parameters": sum(p.numel() for p in engine.module.parameters()),
            "baseline_bytes": baseline_kib * 1024,
            "peak_bytes": status_kib("VmHWM") * 1024, "peak_reset": reset,
            "ledger_model_states": ledger["model_states"], "ledger": ledger,
            "step_s": times, "median_step_s": statistics.median(times),
            "loss_last": float(loss)})
    engine.destroy()
    leave_rank()


if __name__ == "__main__":
    main()
