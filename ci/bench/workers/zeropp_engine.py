"""One rank of the emulated-cluster benchmark with the real stage-3 engine: ZeRO-3 against
ZeRO-3 + ZeRO++ (qwZ + hpZ + qgZ) training the example GPT (examples/gpt.py).

    python ci/bench/cluster.py --worker ci/bench/workers/zeropp_engine.py \\
        --variants stage3,stage3-zeropp --worker-args "--model bench --micro 2"

Variants: ``stage3`` (plain stage 3), ``stage3-gloo`` (plain stage 3 with gloo's own
all_gather and reduce_scatter instead of zero-core's direct exchanges, GlooCommunicator's
comparison switches: how the collectives' shape, not their count, sets the bytes that cross
the node boundary) and ``stage3-zeropp`` (zero_quantized_weights,
zero_hpz_partition_size = ranks per node, zero_quantized_gradients), and ``deepspeed-3``
(DeepSpeed's ZeRO-3 with the same stage-3 settings, DS_ACCELERATOR=cpu, gloo, torch's AdamW;
needs the benchmark environment with deepspeed: ci/bench/cluster.py re-runs itself there). All
train in bf16 with AdamW on the demo's text (examples/text_data.py), same seeds and batches.
DeepSpeed has no zero-core ledger: its rows report the bytes that crossed the link only.

``stage3_max_reuse_distance`` defaults to 0 here: with DeepSpeed's default (1e9) and a
model that fits the live window, stage 3 keeps every unit gathered from forward to
backward, so neither scheme re-gathers in backward; ZeRO++ targets models too large for
that, which reuse distance 0 emulates (only a unit used again immediately stays).

Reports, in the protocol of ci/bench/cluster.py: ``step_times_s`` (timed steps, each
started after a barrier, so that a step's time is the slowest rank's), ``ledger`` (zero-core
ledger difference over the timed steps), ``link_tx_bytes`` on local rank 0 (the node's
veth counter over the timed steps), plus the losses, parameter count and the memory
report's ZeRO++ section.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples"))

import zero_core  # noqa: E402
from comm_volume import link_tx_bytes  # noqa: E402
from gpt import build_model, lm_loss  # noqa: E402
from text_data import GlobalBatchSampler, load_stdlib_text  # noqa: E402
from zero_core.runtime.context import shutdown  # noqa: E402
from zero_core.testing.ranks import report  # noqa: E402

VARIANTS = ("stage3", "stage3-gloo", "stage3-zeropp", "deepspeed-3")


def engine_config(variant: str, a, ranks_per_node: int) -> dict:
    zero = {"stage": 3, "stage3_max_reuse_distance": a.max_reuse,
            "stage3_param_persistence_threshold": a.persistence,
            "stage3_max_live_parameters": a.max_live}
    if variant == "stage3-zeropp":
        zero.update(zero_quantized_weights=True, zero_hpz_partition_size=ranks_per_node,
                    zero_quantized_gradients=True)
    return {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.0}},
            "zero_optimization": zero}


class DeepSpeedRun:
    """DeepSpeed's ZeRO-3 engine behind the few calls this worker makes of zero-core's."""

    def __init__(self, model, a):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        import torch.distributed as dist
        deepspeed.init_distributed(dist_backend="gloo")
        config = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1,
                  "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": a.max_reuse,
                                        "stage3_param_persistence_threshold": a.persistence,
                                        "stage3_max_live_parameters": a.max_live},
                  # torch's AdamW, as in the other benchmarks (DeepSpeed's needs a C++ build)
                  "zero_allow_untested_optimizer": True,
                  "gradient_clipping": 0.0, "steps_per_print": 10**9}
        optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.dist = dist
        self.world_size, self.global_rank = dist.get_world_size(), dist.get_rank()
        self.num_parameters = sum(p.ds_numel for p in model.parameters())

    def __call__(self, x):
        return self.engine(x)

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def barrier(self):
        self.dist.barrier()


def time_steps(engine, a, seq: int, comm, barrier) -> dict:
    """``a.warmup`` untimed steps, then ``a.steps`` timed ones, each started after a barrier
    (so a step's time is the slowest rank's), on the demo's text: the protocol's numbers —
    step and phase times, losses, zero-core's ledger difference (*comm* None: a peer without
    one) and the node's veth bytes on local rank 0."""
    tokens = load_stdlib_text(max_bytes=4 << 20).train
    sampler = GlobalBatchSampler(tokens, seq, a.micro, engine.world_size, seed=0)
    phases = {"forward": [], "backward": [], "step": []}   # seconds per timed step

    def step(i: int) -> float:
        x, y = sampler.rank_batch(i, engine.global_rank)
        t0 = time.perf_counter()
        loss = lm_loss(engine(x), y)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        if i >= a.warmup:
            for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(seconds)
        return float(loss)

    losses = [step(i) for i in range(a.warmup)]
    barrier()
    ledger0 = comm.ledger.snapshot() if comm is not None else None
    link0 = link_tx_bytes()
    times = []
    for i in range(a.warmup, a.warmup + a.steps):
        barrier()
        start = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - start)
    barrier()
    link1 = link_tx_bytes()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return {"step_times_s": times, "phase_times_s": phases, "losses": losses,
            "ledger": (comm.ledger.difference(comm.ledger.snapshot(), ledger0)
                       if comm is not None else None),
            "link_tx_bytes": (link1 - link0 if link0 is not None and link1 is not None
                              and local_rank == 0 else None)}


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The model, batch, stage-3 and timing options every engine worker on the cluster shares
    (ci/bench/workers/multinode_engine.py too)."""
    p.add_argument("--model", default="bench", help="examples/gpt.py preset (default bench)")
    p.add_argument("--micro", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default: the model's context length)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-reuse", type=int, default=0, help="stage3_max_reuse_distance")
    p.add_argument("--persistence", type=int, default=100_000,
                   help="stage3_param_persistence_threshold")
    p.add_argument("--max-live", type=int, default=10**9,
                   help="stage3_max_live_parameters (elements gathered at once; below the "
                        "model's size every engine must release and gather again)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS, required=True)
    add_training_args(p)
    a = p.parse_args()

    ranks_per_node = int(os.environ.get("ZERO_CORE_RANKS_PER_NODE") or
                         os.environ.get("LOCAL_WORLD_SIZE", "1"))
    model = build_model(a.model, seed=1234)
    if a.variant == "deepspeed-3":
        engine = DeepSpeedRun(model, a)
        comm, barrier = None, engine.barrier
    else:
        if a.variant == "stage3-gloo":
            from zero_core.backends.comm.torch_dist import GlooCommunicator
            GlooCommunicator.all_gather_via_p2p = False
            GlooCommunicator.reduce_scatter_via_all_to_all = False
        engine, *_ = zero_core.initialize(model=model,
                                          config=engine_config(a.variant, a, ranks_per_node))
        comm = engine.comm
        barrier = comm.barrier
    timed = time_steps(engine, a, a.seq or model.cfg.block_size, comm, barrier)
    report({"rank": engine.global_rank, "variant": a.variant, "model": a.model,
            "params": engine.num_parameters, "world_size": engine.world_size,
            "ranks_per_node": ranks_per_node, **timed,
            "zeropp": engine.memory_report().get("zeropp") if comm is not None else None})
    if comm is not None:
        engine.destroy()
        shutdown()
    else:
        engine.dist.destroy_process_group()


if __name__ == "__main__":
    main()
