"""Multi-rank worker for tests/test_offload_*.py.

Usage: ``python offload_train.py '<json list of tasks>' <scratch dir>`` on every rank;
each rank reports a list with one result per task. Tasks:

* ``["train", name, stage, precision, opt_device, param_device]`` — train STEPS optimizer
  steps (gradient accumulation 2, clipping active, two parameter groups, a frozen layer)
  (at stage 3 a weight is modified under GatheredParameters halfway) and report the
  loss curve and every parameter's final values (gathered at stage 3),
  the swap directories used, and the offload report.
* ``["resume", stage, opt_device, param_device]`` — train 3 steps, save a checkpoint, train
  3 more (run A); build a fresh engine, load, train 3 (run B); report both.
* ``["memory", numel, sub_group_size, buffer_count, device]`` — one rank, offload of a
  model with *numel* parameters to *device*: the resident set before the first step, its
  peak during that step (a whole pass over the states) and after, and the store's report.
"""
from __future__ import annotations

import json
import os
import sys

import torch

import zero_core
from zero_core.offload import cleanup
from zero_core.stage3 import GatheredParameters
from zero_core.testing.ranks import report

STEPS, GAS, MICRO, DIM = 4, 2, 3, 24


class Net(torch.nn.Module):
    """~3.6k parameters: embedding, a frozen layer, LayerNorm, two linears, biases."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, DIM)
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.l1 = torch.nn.Linear(DIM, 48)
        self.ln = torch.nn.LayerNorm(48)
        self.l2 = torch.nn.Linear(48, DIM)

    def forward(self, idx):
        x = self.frozen(self.emb(idx))
        return self.l2(torch.nn.functional.gelu(self.ln(self.l1(x))))


def config(stage, precision, opt_device, param_device, scratch, world):
    zo = {"stage": stage, "reduce_bucket_size": 700, "sub_group_size": 1100,
          "stage3_param_persistence_threshold": 40, "stage3_prefetch_bucket_size": 600,
          "stage3_max_live_parameters": 2000}
    if opt_device != "none":
        zo["offload_optimizer"] = {"device": opt_device, "nvme_path": scratch,
                                   "buffer_count": 3}
    if param_device != "none":
        zo["offload_param"] = {"device": param_device, "nvme_path": scratch,
                               "buffer_count": 3, "buffer_size": 2000, "max_in_cpu": 300}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "gradient_clipping": 0.05, "zero_optimization": zo,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "weight_decay": 0.1}}}
    if precision in ("bf16", "bf16m"):
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(stage, precision, opt_device, param_device, scratch):
    """*precision* ``bf16m``: bf16 training of a model whose values are bf16 numbers: the
    runs without parameter offload hold them in fp32, the ones with it build the model in
    bf16 and partition it with Init (no host fp32 master at build: the optimizer reads it
    from the parameter store), which must not change a bit."""
    torch.manual_seed(1234)
    model = Net()
    if precision == "bf16m":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
        if param_device != "none":
            model.to(torch.bfloat16)
    groups = [{"params": [model.emb.weight, model.l1.weight, model.l2.weight]},
              {"params": [model.l1.bias, model.l2.bias, model.ln.weight, model.ln.bias],
               "weight_decay": 0.0, "lr": 1e-2}]
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    cfg = config(stage, precision, opt_device, param_device, scratch, world)
    if precision == "bf16m" and param_device != "none":
        zero_core.Init(module=model, config=cfg)
    engine, *_ = zero_core.initialize(model=model, model_parameters=groups, config=cfg)
    return engine, model


def batch(step, micro, rank):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    idx = torch.randint(0, 16, (MICRO, 5), generator=g)
    target = torch.randn(MICRO, 5, DIM, generator=g)
    return idx, target


def train(engine, first, count):
    losses = []
    for step in range(first, first + count):
        for micro in range(GAS):
            idx, target = batch(step, micro, engine.global_rank)
            loss = ((engine(idx).float() - target) ** 2).mean()
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    return losses


def values(engine, model):
    params = list(model.parameters())
    ctx = GatheredParameters(params) if engine.stage == 3 else None
    if ctx is not None:
        ctx.__enter__()
    try:
        return {n: p.detach().float().reshape(-1).tolist() for n, p in model.named_parameters()}
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


def modify_in_place(engine, model):
    """Stage 3: change a weight outside the optimizer (GatheredParameters with a modifier
    rank), which must reach wherever the master weights and partitions are stored."""
    with torch.no_grad(), GatheredParameters([model.l1.weight], modifier_rank=0):
        if engine.global_rank == 0:
            model.l1.weight.mul_(0.5)


def task_train(scratch, name, stage, precision, opt_device, param_device):
    engine, model = build(stage, precision, opt_device, param_device, scratch)
    losses = train(engine, 0, STEPS // 2)
    if stage == 3:
        modify_in_place(engine, model)
    losses += train(engine, STEPS // 2, STEPS - STEPS // 2)
    rep = engine.memory_report().get("offload")
    # which way the fp32 master was made at build (offloaded stage 3 only)
    from_store = [getattr(gb, "_master_from_store", None) for gb in engine.parts.buffers
                  if gb is not None]
    return {"name": name, "losses": losses, "values": values(engine, model),
            "master_from_store": from_store,
            "dirs": cleanup.registered(), "offload": rep,
            "grad_norm": engine.get_global_grad_norm()}


def task_resume(scratch, stage, opt_device, param_device):
    ckpt = os.path.join(scratch, f"ckpt_{stage}_{opt_device}_{param_device}")
    engine, model = build(stage, "fp32", opt_device, param_device, scratch)
    train(engine, 0, 3)
    engine.save_checkpoint(ckpt, tag="t3")
    train(engine, 3, 3)
    first = values(engine, model)
    engine.destroy()
    engine, model = build(stage, "fp32", opt_device, param_device, scratch)
    train(engine, 0, 1)   # different state, overwritten by the load
    engine.load_checkpoint(ckpt, tag="t3")
    train(engine, 3, 3)
    return {"a": first, "b": values(engine, model)}


def task_memory(scratch, numel, sub_group_size, buffer_count, device="nvme"):
    from zero_core.backends.accelerators.cpu import peak_rss_bytes, reset_peak_rss, rss_bytes
    width = int((numel / 2) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False),
                                torch.nn.Linear(width, width, bias=False))
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 1 << 18,
                                 "sub_group_size": sub_group_size,
                                 "offload_optimizer": {"device": device, "nvme_path": scratch,
                                                       "buffer_count": buffer_count}}}
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    x = torch.randn(2, width)
    engine.backward(engine(x).square().mean())   # gradients in place before measuring
    before = rss_bytes()
    why = reset_peak_rss()
    engine.step()   # one whole pass over the swapped states, nothing else allocating
    peak = peak_rss_bytes()
    rep = engine.memory_report()["offload"]
    return {"before": before, "peak": peak, "reset_failed": why, "offload": rep,
            "rss_after": rss_bytes(),
            "num_parameters": engine.num_parameters}


def main():
    tasks = json.loads(sys.argv[1])
    scratch = sys.argv[2]
    out = []
    for task in tasks:
        action, *args = task
        fn = {"train": task_train, "resume": task_resume, "memory": task_memory}[action]
        out.append(fn(scratch, *args))
    report(out)
    zero_core.runtime.context.shutdown()


if __name__ == "__main__":
    main()
