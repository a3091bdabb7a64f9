"""One rank of one benchmark contender (launched by ci/bench/engine.py, never by hand).

Every contender trains the same model (examples/gpt.py's ``bench`` preset, ~20M parameters)
from the same initial weights on the same global batches (examples/text_data.py, 4 sequences
x 128 tokens per rank), in fp32 with AdamW, and times each optimizer step on this rank. The
rank hands back its step times, losses and peak RSS through ``zero_core.testing.ranks.report``.

Contenders: ``ddp`` (DistributedDataParallel), ``zero_redundancy`` (DDP +
torch.distributed.optim.ZeroRedundancyOptimizer), ``fsdp2`` (torch.distributed.fsdp.fully_shard,
each block then the root), ``deepspeed`` (ZeRO --stage 1/2), ``zero_core`` (--stage, --comm).
Peers get torch.optim.AdamW; zero-core gets the same hyper-parameters through its config.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "examples"))
from gpt import build_model, lm_loss  # noqa: E402
from text_data import GlobalBatchSampler, load_stdlib_text  # noqa: E402

from zero_core.runtime.launch import discover  # noqa: E402
from zero_core.testing.ranks import report  # noqa: E402

# identical hyper-parameters for every contender
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
TEXT_BYTES = 4 << 20  # the benchmark needs little text; less keeps RSS about the engines


def torch_adamw(params):
    return torch.optim.AdamW(params, **ADAMW)


def init_gloo(launch) -> None:
    """torch.distributed over gloo, rendezvous from the torchrun-style environment."""
    dist.init_process_group("gloo", rank=launch.rank, world_size=launch.world_size)


class TorchStep:
    """A step in three timed phases for contenders driven by a torch optimizer."""

    def __init__(self, module, optimizer):
        self.module = module
        self.optimizer = optimizer

    def forward(self, x, y):
        return lm_loss(self.module(x), y)

    def backward(self, loss):
        loss.backward()

    def update(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class EngineStep:
    """The same phases for DeepSpeed-style engines (engine(x), engine.backward, engine.step)."""

    def __init__(self, engine):
        self.engine = engine

    def forward(self, x, y):
        return lm_loss(self.engine(x), y)

    def backward(self, loss):
        self.engine.backward(loss)

    def update(self):
        self.engine.step()


def setup_ddp(model, args, launch):
    from torch.nn.parallel import DistributedDataParallel as DDP
    init_gloo(launch)
    ddp = DDP(model)
    return TorchStep(ddp, torch_adamw(ddp.parameters()))


def setup_zero_redundancy(model, args, launch):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    init_gloo(launch)
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    return TorchStep(ddp, opt)


def setup_fsdp2(model, args, launch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    init_gloo(launch)
    mesh = init_device_mesh("cpu", (launch.world_size,))
    # one FSDP unit per transformer block, the root holds embeddings (tied head) and final LN
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return TorchStep(model, torch_adamw(model.parameters()))


def setup_deepspeed(model, args, launch):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage},
              # torch's AdamW, as for the other peers (DeepSpeed's own Adam needs a C++ build)
              "zero_allow_untested_optimizer": True,
              # DeepSpeed clips at norm 1.0 unless told otherwise; no contender clips here
              "gradient_clipping": 0.0,
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch_adamw(model.parameters()),
                                      config=config)
    return EngineStep(engine)


def setup_zero_core(model, args, launch):
    import zero_core
    config = {"train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
              "zero_optimization": {"stage": args.stage},
              "comm_backend": args.comm}
    if args.bucket_elements:
        config["zero_optimization"]["reduce_bucket_size"] = args.bucket_elements
    engine, *_ = zero_core.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return EngineStep(engine)


def setup_compute_only(model, args, launch):
    """The lower bound of every data-parallel contender: each rank trains its own per-rank
    batch with no process group and no communication at all (both ranks still run side by
    side, so they compete for the cores as every other contender's ranks do)."""
    return TorchStep(model, torch_adamw(model.parameters()))


SETUPS = {"compute_only": setup_compute_only, "ddp": setup_ddp, "zero_redundancy": setup_zero_redundancy, "fsdp2": setup_fsdp2,
          "deepspeed": setup_deepspeed, "zero_core": setup_zero_core}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("contender", choices=sorted(SETUPS))
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--comm", default="gloo")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--bucket-elements", type=int, default=0)
    p.add_argument("--model", default="bench",
                   help="examples/gpt.py preset (the benchmarks use bench; smoke tests tiny)")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    launch = discover()
    model = build_model(args.model, seed=0)
    text = load_stdlib_text(max_bytes=TEXT_BYTES)
    sampler = GlobalBatchSampler(text.train, model.cfg.block_size, args.micro_batch,
                                 launch.world_size, seed=0)
    rss_before_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step = SETUPS[args.contender](model, args, launch)

    phases = ("forward", "backward", "update")
    wall = {ph: [] for ph in phases}
    cpu = {ph: [] for ph in phases}
    losses = []
    for i in range(args.warmup + args.steps):
        x, y = sampler.rank_batch(i, launch.rank)
        # CPU seconds of this process (all its threads) are less sensitive to other load than
        # wall time, but they count busy-waiting too (MPI polls while it waits)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step.forward(x, y)
        t1, c1 = time.perf_counter(), time.process_time()
        step.backward(loss)
        t2, c2 = time.perf_counter(), time.process_time()
        step.update()
        t3, c3 = time.perf_counter(), time.process_time()
        losses.append(loss.item())
        for ph, (ta, tb, ca, cb) in zip(phases, ((t0, t1, c0, c1), (t1, t2, c1, c2), (t2, t3, c2, c3))):
            wall[ph].append(tb - ta)
            cpu[ph].append(cb - ca)
    times = [sum(wall[ph][i] for ph in phases) for i in range(len(losses))]
    cpu_times = [sum(cpu[ph][i] for ph in phases) for i in range(len(losses))]
    out = {"rank": launch.rank, "world_size": launch.world_size,
           "step_s": times[args.warmup:], "warmup_s": times[:args.warmup], "losses": losses,
           "cpu_step_s": cpu_times[args.warmup:],
           "phase_wall_s": {ph: v[args.warmup:] for ph, v in wall.items()},
           "phase_cpu_s": {ph: v[args.warmup:] for ph, v in cpu.items()},
           # ru_maxrss is KiB on Linux: the peak resident set of this rank's process
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "rss_before_setup_bytes": rss_before_setup,
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.contender == "zero_core":
        out["memory_report"] = step.engine.memory_report()
        out["comm_report"] = step.engine.comm_report()
    report(out)
    # Tear down before the interpreter exits: a gloo process group still alive at exit can
    # abort the process ("terminate called without an active exception") while Python
    # finalizes, which would fail a job that has already reported.
    if args.contender == "zero_core":
        from zero_core.runtime.context import shutdown
        shutdown()
    elif dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
