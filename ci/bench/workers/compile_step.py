"""One rank of ci/bench/compile.py: the demo GPT's training step, eager or compiled, with
zero-core (stage 2 or 3) or FSDP2 (fully_shard per block), fp32 or bf16.

    python -m torch.distributed.run --nproc-per-node 2 ci/bench/workers/compile_step.py \\
        --impl zc3 --dtype bf16 --compile 1

Every variant trains the same model from the same seed on the same random batches with
AdamW. The first ``--warmup`` steps (where torch.compile traces and compiles) are timed
apart from the ``--steps`` measured ones; each measured step starts after a barrier, so a
step's time is the slowest rank's. Reports (zero_core.testing.ranks.report): step times,
the warm-up time, the last loss, and for zero-core the graph breaks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "examples"))
import gpt  # noqa: E402

from zero_core.testing.ranks import report  # noqa: E402


def zero_core_model(model, stage: int, dtype: str, micro: int, compiled: bool):
    import zero_core
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zero_core.initialize(model=model, config=config)
    if compiled:
        engine.compile()

    def step(idx):
        loss = gpt.lm_loss(engine(idx[:, :-1]), idx[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss
    return step, engine


def fsdp2_model(model, dtype: str, compiled: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bf16" else None,
                              reduce_dtype=torch.float32)
    for block in model.blocks:
        if compiled:
            block.compile()
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(idx):
        loss = gpt.lm_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=["zc2", "zc3", "fsdp2"], required=True)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--compile", type=int, default=0)
    ap.add_argument("--model", default="small")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(1)   # two ranks on two cores
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig.preset(a.model))
    engine = None
    if a.impl == "fsdp2":
        dist.init_process_group("gloo")
        step = fsdp2_model(model, a.dtype, bool(a.compile))
    else:
        step, engine = zero_core_model(model, int(a.impl[-1]), a.dtype, a.micro, bool(a.compile))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model.cfg
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, cfg.vocab_size, (a.micro, cfg.block_size + 1), generator=g)
               for _ in range(a.warmup + a.steps)]
    t0 = time.perf_counter()
    for idx in batches[:a.warmup]:
        step(idx)
    dist.barrier()
    warmup_s = time.perf_counter() - t0
    times = []
    for idx in batches[a.warmup:]:
        dist.barrier()
        t = time.perf_counter()
        loss = step(idx)
        dist.barrier()
        times.append(time.perf_counter() - t)
    out = {"step_times_s": times, "warmup_s": warmup_s, "loss": float(loss.detach()),
           "world": world}
    if engine is not None:
        out["compile"] = {k: v for k, v in engine.compile_report().items()
                          if k in ("compiled", "graph_breaks", "graphs")}
        engine.destroy()
    report(out)


if __name__ == "__main__":
    main()
