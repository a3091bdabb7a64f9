"""Multi-rank worker for tests/test_device_matrix.py: the engine's feature matrix on
whatever accelerator the launch selects (ZERO_CORE_ACCELERATOR: cpu or vdev).

Usage: ``python device_matrix.py <scenario>[,<scenario>...] <checkpoint dir>`` on every
rank. Each scenario trains stage3_train.Net (tied embedding/head, a frozen layer, a module
called twice, a parameter read outside its module) from the same seed on the same global
batches and reports, per scenario:

* ``fingerprint``: SHA-256 of every full parameter's bytes after training (gathered at
  stage 3) and ``losses``: the per-step losses as exact floats. The test compares them
  between a cpu launch and a vdev launch: they must be bit-identical;
* ``rel_diff`` against a single-process plain-torch reference (stages 0-3, no ZeRO++/
  quantization), so both accelerators are also right, not just equal;
* ``misplaced``: engine-owned tensors not where they belong (zero_core.testing.device_audit);
* ``transfer``: host<->device bytes of the last optimizer step, from vdev's allocator
  (device runs) and the ledger's staging counters, next to the ledger's wire bytes.

The ``ckpt`` scenario saves a checkpoint under ``<dir>/<accelerator>`` after 2 steps and
continues one step (an async save: written in the background while that step runs); then
a fresh engine loads ``<dir>/<load_from>`` (LOAD_FROM env var,
default: its own) and takes the same step: with identical state the result is identical.
``ckpt_off`` does the same with the optimizer state offloaded to host memory.
"""
from __future__ import annotations

import hashlib
import os
import sys

import torch

import zero_core
from zero_core import checkpointing
from zero_core.testing import device_audit
from zero_core.runtime.context import shutdown
from zero_core.testing.ranks import report

sys.path.insert(0, os.path.dirname(__file__))
from stage3_train import (MICRO, PENALTY, Net, ce, full_params, global_batch, groups_of,  # noqa: E402
                          make_model, penalty_param, rel_diff, stage3_config)

STEPS, GAS, SEED = 2, 2, 11
ZEROPP = {"qwz": {"zero_quantized_weights": True},
          "hpz": {"zero_hpz_partition_size": 2},
          "qgz": {"zero_quantized_gradients": True}}


def config(stage: int, precision="fp32", **zero) -> dict:
    cfg = stage3_config(precision, GAS, **zero)
    cfg["zero_optimization"]["stage"] = stage
    if stage < 3:
        for key in [k for k in cfg["zero_optimization"] if k.startswith("stage3_")]:
            del cfg["zero_optimization"][key]
    return cfg


def offload(device: str, scratch: str) -> dict:
    return {"device": device, "nvme_path": scratch, "buffer_count": 3}


def scenario_config(name: str, scratch: str) -> tuple[dict, dict]:
    """(config, options) of a scenario; options: init, ckpt (activation checkpointing)."""
    opts = {"init": False, "ckpt": False, "reference": True}
    if name in ("s0", "s1", "s2", "s3"):
        return config(int(name[1])), opts
    if name in ("s2_bf16", "s3_bf16", "s2_fp16", "s3_fp16"):
        return config(int(name[1]), name[3:]), opts
    if name == "s3_init":
        return config(3), {**opts, "init": True}
    if name == "s3_actckpt":
        cfg = config(3)
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True,
                                           "contiguous_memory_optimization": True,
                                           "number_checkpoints": 2}
        return cfg, {**opts, "ckpt": True}
    if name.startswith("zpp_"):
        return config(3, "bf16", **ZEROPP[name[4:]]), {**opts, "reference": False}
    if name == "off_opt_cpu":
        return config(2, offload_optimizer=offload("cpu", scratch)), opts
    if name == "off_opt_nvme":
        return config(2, "bf16", offload_optimizer=offload("nvme", scratch),
                      sub_group_size=1000), opts
    if name == "off_param_cpu":
        return config(3, offload_optimizer=offload("cpu", scratch),
                      offload_param=offload("cpu", scratch)), opts
    if name == "off_param_nvme":
        return config(3, "bf16", offload_optimizer=offload("nvme", scratch),
                      offload_param={**offload("nvme", scratch), "buffer_size": 2000},
                      sub_group_size=1000), opts
    if name == "off_ponly_cpu":   # offload_param alone: the optimizer stays on the device
        return config(3, offload_param=offload("cpu", scratch)), opts
    if name == "off_ponly_nvme":
        return config(3, "bf16", offload_param={**offload("nvme", scratch),
                                                "buffer_size": 2000}), opts
    raise SystemExit(f"unknown scenario {name!r}")


def build(cfg: dict, opts: dict):
    if opts["init"]:
        torch.manual_seed(SEED)
        with zero_core.Init(config=cfg):
            model = Net(opts["ckpt"])
        with torch.no_grad():
            model.gain.copy_(make_model(SEED).gain)
    else:
        model = make_model(SEED, opts["ckpt"])
    zero_core.register_external_parameter(model, model.mix.weight)
    if opts["ckpt"]:
        checkpointing.configure(None, deepspeed_config=cfg)
    engine, *_ = zero_core.initialize(model=model, config=cfg, optimizer=opts.get("optimizer"),
                                      model_parameters=groups_of(model))
    return engine, model


def train_step(engine, model, step: int) -> float:
    """One optimizer step (GAS micro-steps) on this rank's rows of the global batch."""
    rank, world = engine.global_rank, engine.world_size
    ids, tgt = global_batch(SEED, step, MICRO * GAS * world)
    for m in range(GAS):
        rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
        loss = ce(engine(ids[rows]), tgt[rows].to(engine.device))
        with zero_core.GatheredParameters([penalty_param(model)]):
            loss = loss + PENALTY * penalty_param(model).float().pow(2).sum()
        engine.backward(loss)
        engine.step()
    return float(loss.detach())


def fingerprint(model) -> str:
    h = hashlib.sha256()
    for t in full_params(model):
        h.update(t.cpu().numpy().tobytes())
    return h.hexdigest()


def reference_params(steps: int):
    """Plain torch, one process, the whole global batch: the parameters after *steps*."""
    world = zero_core.get_runtime().world_size
    ref = make_model(SEED)
    opt = torch.optim.AdamW(groups_of(ref), lr=1e-2)
    for step in range(steps):
        ids, tgt = global_batch(SEED, step, MICRO * GAS * world)
        opt.zero_grad()
        (ce(ref(ids), tgt) + PENALTY * penalty_param(ref).pow(2).sum()).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    return [p.detach().double() for p in ref.parameters()]


def device_counters(engine) -> dict:
    mod = getattr(torch, engine.device.type, None)
    if engine.device.type == "cpu" or not hasattr(mod, "memory_stats"):
        return {"h2d_bytes": 0, "d2h_bytes": 0}
    stats = mod.memory_stats(engine.device)
    return {"h2d_bytes": stats.get("h2d_bytes", 0), "d2h_bytes": stats.get("d2h_bytes", 0)}


def run_scenario(name: str, scratch: str) -> dict:
    cfg, opts = scenario_config(name, scratch)
    engine, model = build(cfg, opts)
    losses = [train_step(engine, model, s) for s in range(STEPS - 1)]
    before, comm_before = device_counters(engine), engine.comm.ledger.snapshot()
    losses.append(train_step(engine, model, STEPS - 1))
    after = device_counters(engine)
    wire = engine.comm.ledger.difference(engine.comm.ledger.snapshot(), comm_before)
    out = {"losses": losses, "misplaced": device_audit.misplaced(engine),
           "placement": device_audit.summary(engine),
           "transfer": {"h2d_bytes": after["h2d_bytes"] - before["h2d_bytes"],
                        "d2h_bytes": after["d2h_bytes"] - before["d2h_bytes"],
                        "staged_bytes": wire["staged_bytes"], "sent_bytes": wire["sent_bytes"],
                        "offload": wire["transfers"]},
           # this rank's partition of every group (elements) and the bytes per element of
           # gradients and parameters: the offloaded step's traffic formula
           "partition_numel": sum(gb.layout.partition_numel for gb in engine.parts.buffers
                                  if gb is not None),
           # the offloaded step's host gradient buffer is fp32 (the copy converts)
           "grad_bytes": 4,
           "param_bytes": next(gb.param_buf.dtype.itemsize for gb in engine.parts.buffers
                               if gb is not None),
           "device": str(engine.device), "skipped": engine.skipped_steps,
           "async": engine.device.type == "vdev" and torch.vdev.is_async(),
           "precision": ("bf16" if cfg.get("bf16", {}).get("enabled")
                         else "fp16" if cfg.get("fp16", {}).get("enabled") else "fp32")}
    out["fingerprint"] = fingerprint(model)
    if opts["reference"]:
        out["rel_diff"] = rel_diff(full_params(model), reference_params(STEPS))
    engine.destroy()
    if opts["ckpt"]:
        checkpointing.reset()
    return out


def run_checkpoint(scratch: str, offloaded: bool = False) -> dict:
    """Save after 2 steps on this accelerator; resume from LOAD_FROM's checkpoint (with
    *offloaded*, the optimizer state in host memory: ``ckpt_off``)."""
    suffix = "_off" if offloaded else ""   # one directory per (accelerator, scenario)
    acc = zero_core.get_runtime().accelerator.name
    cfg = config(2, offload_optimizer=offload("cpu", scratch)) if offloaded else config(2)
    opts = {"init": False, "ckpt": False}
    engine, model = build(cfg, opts)
    for s in range(2):
        train_step(engine, model, s)
    saved = fingerprint(model)
    # ckpt saves asynchronously: the device state is copied non-blocking into pinned host
    # memory and written by a thread after an event; step 2 changes the state meanwhile
    engine.save_checkpoint(os.path.join(scratch, acc + suffix), async_save=not offloaded)
    train_step(engine, model, 2)
    continued = fingerprint(model)
    engine.destroy()

    load_from = os.environ.get("LOAD_FROM", acc) + suffix
    engine, model = build(cfg, opts)
    engine.load_checkpoint(os.path.join(scratch, load_from))
    loaded = fingerprint(model)
    train_step(engine, model, 2)
    out = {"saved": saved, "continued": continued, "loaded": loaded,
           "resumed": fingerprint(model), "load_from": load_from,
           "misplaced": device_audit.misplaced(engine)}
    engine.destroy()
    return out


def main():
    names, scratch = sys.argv[1].split(","), sys.argv[2]
    zero_core.init_distributed()
    out = {}
    for name in names:
        if name.startswith("ckpt"):
            out[name] = run_checkpoint(scratch, offloaded=name == "ckpt_off")
        else:
            out[name] = run_scenario(name, scratch)
    report(out)
    shutdown()


if __name__ == "__main__":
    main()
