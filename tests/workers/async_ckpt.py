"""Multi-rank worker for tests/test_async_checkpoint.py.

Usage: ``python async_ckpt.py '<json list of tasks>'``; each task is ``[action, dir]`` and
the rank reports the list of results. Actions:

* ``snapshot`` (optional variant: VARIANTS) — train 3 steps; save synchronously (tag ``sync``) and asynchronously (tag
  ``async``, into another directory) at the same state; train 3 more steps (the async save
  commits at one of them); report whether every tensor of both shards is equal, and the
  step at which the async checkpoint appeared.
* ``failure`` — save ``good``; start an async save ``bad`` whose shard write fails on rank 1
  with ENOSPC (a full disk) in the writer thread; report the error the following steps
  raise, what is left on disk; then save ``good2`` asynchronously and wait.
* ``periodic`` — save every 2 steps (async, keep_last 2) for 9 steps; report the
  directory after engine.destroy(); then save every 0.001 minutes with 30 ms steps.
* ``resume_errors`` — checkpoint.resume "require" on an empty directory; a checkpoint of
  another model; a resume on a dataset of another size; a global batch that the new micro
  batch cannot keep.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import time

import torch

import zero_core
from zero_core.checkpoint import store
from zero_core.checkpoint.store import CheckpointError
from zero_core.errors import ConfigError
from zero_core.testing.ranks import leave_rank, report


VARIANTS = {  # zero_optimization (and precision) of the snapshot checks
    "s2": ({"stage": 2}, None),
    "s3_bf16": ({"stage": 3}, "bf16"),
    "s2_offload_cpu": ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, None),
    "s3_offload_nvme": ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": None},
                         "offload_param": {"device": "cpu"}}, None),
}


def build(save_dir=None, width=16, samples=64, variant="s2", nvme=None, **checkpoint):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(samples, 4, generator=g),
                                          torch.randn(samples, 1, generator=g))
    zero, precision = VARIANTS[variant]
    zero = json.loads(json.dumps(zero).replace("null", json.dumps(nvme)))
    cfg = {"train_micro_batch_size_per_gpu": checkpoint.pop("micro", 4),
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": zero}
    if precision:
        cfg[precision] = {"enabled": True}
    if save_dir is not None:
        cfg["checkpoint"] = {"save_dir": save_dir, **checkpoint}
    engine, _, loader, _ = zero_core.initialize(model=model, model_parameters=model.parameters(),
                                                config=cfg, training_data=data)
    return engine, loader


def train(engine, loader, steps, sleep=0.0):
    done = 0
    while done < steps:
        for x, y in loader:
            out = engine(x.to(engine.compute_dtype)).float()
            engine.backward(torch.nn.functional.mse_loss(out, y))
            engine.step()
            time.sleep(sleep)
            done += 1
            if done == steps:
                return


def shard_tensors(path):
    with store.SafetensorsReader(path) as r:
        return {name: r.read_tensor(name) for name in r.tensors}


def snapshot(d, variant="s2"):
    os.makedirs(os.path.join(d, "nvme"), exist_ok=True)
    engine, loader = build(variant=variant, nvme=os.path.join(d, "nvme"))
    train(engine, loader, 3)
    engine.save_checkpoint(os.path.join(d, "a"), tag="t", async_save=False)
    engine.save_checkpoint(os.path.join(d, "b"), tag="t", async_save=True)
    # the commit comes at the first step after every rank's writer finished; the writer runs
    # at the lowest priority, so on a loaded machine that can take a few dozen of these
    # millisecond steps (3 were too few under CI load): same count on every rank
    appeared = None
    for step in range(40):
        train(engine, loader, 1)
        if appeared is None and os.path.exists(os.path.join(d, "b", "t", store.METADATA)):
            appeared = step + 1
    engine.wait_for_checkpoint()
    name = store.shard_name(engine.global_rank)
    a, b = (shard_tensors(os.path.join(d, x, "t", name)) for x in "ab")
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with open(os.path.join(d, "b", store.LATEST)) as fh:
        latest = fh.read()
    engine.destroy()
    return {"equal": equal, "tensors": len(a), "appeared_after_steps": appeared,
            "latest": latest}


def failure(d):
    engine, loader = build()
    train(engine, loader, 2)
    engine.save_checkpoint(d, tag="good")
    original = store.write_safetensors

    def full_disk(path, *args, **kwargs):
        if engine.global_rank == 1 and "bad" in path:
            time.sleep(0.2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return original(path, *args, **kwargs)
    store.write_safetensors = full_disk
    engine.save_checkpoint(d, tag="bad", async_save=True)
    error, steps = None, 0
    while error is None and steps < 20:
        try:
            train(engine, loader, 1, sleep=0.05)
            steps += 1
        except CheckpointError as exc:
            error = str(exc)
    left = sorted(os.listdir(d))
    with open(os.path.join(d, store.LATEST)) as fh:
        latest = fh.read()
    train(engine, loader, 1)  # training goes on
    engine.save_checkpoint(d, tag="good2", async_save=True)
    engine.wait_for_checkpoint()
    with open(os.path.join(d, store.LATEST)) as fh:
        latest2 = fh.read()
    engine.destroy()
    return {"error": error, "steps": steps, "left": left, "latest": latest,
            "latest_after": latest2}


def periodic(d):
    engine, loader = build(os.path.join(d, "steps"), save_interval_steps=2, async_save=True,
                           keep_last=2)
    train(engine, loader, 9)
    engine.destroy()
    by_steps = sorted(os.listdir(os.path.join(d, "steps")))
    engine, loader = build(os.path.join(d, "minutes"), save_interval_minutes=0.001)
    train(engine, loader, 6, sleep=0.03)
    engine.destroy()
    return {"steps": by_steps, "minutes": sorted(os.listdir(os.path.join(d, "minutes")))}


def resume_errors(d):
    out = {}
    try:
        build(os.path.join(d, "empty"), resume="require")
    except CheckpointError as exc:
        out["require"] = str(exc)
    engine, loader = build(os.path.join(d, "saved"))
    train(engine, loader, 2)
    engine.save_checkpoint(os.path.join(d, "saved"))
    engine.destroy()
    for key, kwargs in (("model", {"width": 8}), ("data", {"samples": 48}),
                        ("batch", {"micro": 3})):
        try:
            build(os.path.join(d, "saved"), **kwargs)
            out[key] = None
        except (CheckpointError, ConfigError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    out["left"] = sorted(os.listdir(os.path.join(d, "saved")))
    return out


ACTIONS = {"snapshot": snapshot, "failure": failure, "periodic": periodic,
           "resume_errors": resume_errors}

if __name__ == "__main__":
    results = [ACTIONS[action](*args) for action, *args in json.loads(sys.argv[1])]
    report(results)
    leave_rank()
