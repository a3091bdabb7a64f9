"""A training script as the README's "When a rank dies" shows it, for the fault tests.

Usage: ``python resume_train.py '<json options>'`` on every rank, under run_ranks, mpirun or
torchrun's elastic agent (a restart runs it again; ``checkpoint.resume`` does the rest).

Options (all optional): ``save_dir``; ``steps`` (optimizer steps to reach); ``interval``
(checkpoint.save_interval_steps); ``async`` (checkpoint.async_save); ``keep_last``;
``resume`` ("auto"); ``resume_batch``; ``stage``; ``micro``; ``train_batch`` (or ``gas``);
``samples`` (dataset size); ``log`` (a file every rank appends one JSON line to per
micro-step: attempt, rank, world, pid, micro-step, step, sample ids); ``final`` (rank 0
writes the final parameters there, torch.save); ``slow_write`` (seconds every shard write
sleeps first: a slow disk, so that a kill lands during an async save); ``step_sleep``
(seconds after every micro-step: time for a kill to land); ``width``; ``lr``;
``bf16``; ``dataset_samples`` (override the dataset size the sampler sees: the mismatch
test). Reports ``{"start_step", "end_step", "resumed_client_state"}`` or the error.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

import zero_core
from zero_core.checkpoint import store
from zero_core.testing.ranks import leave_rank, report


def main(opts: dict) -> None:
    if opts.get("slow_write"):
        original = store.write_safetensors

        def slow(*args, **kwargs):
            time.sleep(float(opts["slow_write"]))
            return original(*args, **kwargs)
        store.write_safetensors = slow

    width = int(opts.get("width", 32))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 1))
    g = torch.Generator().manual_seed(1)
    n = int(opts.get("samples", 96))
    xs, ws = torch.randn(n, 8, generator=g), torch.randn(8, 1, generator=g)
    ys = torch.sin(xs @ ws)
    ids = torch.arange(n)
    dataset = torch.utils.data.TensorDataset(xs, ys, ids)
    if opts.get("dataset_samples"):
        dataset = torch.utils.data.TensorDataset(xs[:opts["dataset_samples"]],
                                                 ys[:opts["dataset_samples"]],
                                                 ids[:opts["dataset_samples"]])
    config = {
        "train_micro_batch_size_per_gpu": int(opts.get("micro", 4)),
        "optimizer": {"type": "AdamW", "params": {"lr": float(opts.get("lr", 3e-3))}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5,
                                                      "warmup_max_lr": float(opts.get("lr", 3e-3))}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": int(opts.get("stage", 2))},
        "checkpoint": {"save_dir": opts.get("save_dir"),
                       "save_interval_steps": opts.get("interval"),
                       "async_save": bool(opts.get("async", False)),
                       "keep_last": opts.get("keep_last"),
                       "resume": opts.get("resume", "auto"),
                       "resume_batch": opts.get("resume_batch", "keep_global")},
    }
    if opts.get("save_dir") is None:
        del config["checkpoint"]
    if opts.get("train_batch"):
        config["train_batch_size"] = int(opts["train_batch"])
    else:
        config["gradient_accumulation_steps"] = int(opts.get("gas", 1))
    if opts.get("bf16"):
        config["bf16"] = {"enabled": True}
    engine, _, loader, _ = zero_core.initialize(model=model, model_parameters=model.parameters(),
                                                config=config, training_data=dataset)
    start = engine.global_steps
    steps = int(opts.get("steps", 12))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log = open(opts["log"], "a") if opts.get("log") else None
    sampler = loader.sampler
    while engine.global_steps < steps:
        for _epoch in range(sampler.epoch, sampler.epoch + 1):
            for x, y, idx in loader:
                loss = torch.nn.functional.mse_loss(engine(x), y.to(engine.device))
                engine.backward(loss)
                engine.step()
                time.sleep(float(opts.get("step_sleep", 0)))
                if log is not None:
                    log.write(json.dumps({"attempt": int(attempt), "rank": engine.global_rank,
                                          "world": engine.world_size, "pid": os.getpid(),
                                          "micro": engine.micro_steps,
                                          "step": engine.global_steps,
                                          "ids": idx.tolist(), "time": time.time()}) + "\n")
                    log.flush()
                if engine.global_steps >= steps and not engine.micro_steps % \
                        engine.gradient_accumulation_steps:
                    break
    engine.wait_for_checkpoint()
    state = engine.module_state_dict(rank0_only=True)
    if engine.global_rank == 0 and opts.get("final"):
        torch.save({k: v.detach().clone() for k, v in state.items()}, opts["final"])
    report({"start_step": start, "end_step": engine.global_steps,
            "resumed_client_state": engine.resumed_client_state,
            "gas": engine.gradient_accumulation_steps})
    engine.destroy()
    leave_rank()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
