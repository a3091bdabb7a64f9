#!/usr/bin/env python
"""Count the collectives one ZeRO-3 training step issues, per phase: DeepSpeed's and zero-core's.

The emulated-cluster benchmark (ci/bench/cluster.py) showed DeepSpeed's ZeRO-3 putting fewer
bytes on the inter-node link than zero-core's with the same stage-3 settings. This script
says why, by counting: it trains the cluster worker's model (ci/bench/workers/zeropp_engine.py:
the ``bench`` GPT, bf16, AdamW, persistence threshold 1e5) on 4 local ranks (2 per node), one
warm-up step and one counted step, and prints per phase (forward, backward, step) the calls
and input bytes of every collective on rank 0:

* ``deepspeed-3``: DeepSpeed's ZeRO-3 (reuse distance 0), its ``torch.distributed`` calls
  counted by wrapping them before DeepSpeed is imported (needs the benchmark environment with
  deepspeed, found as ci/bench/engine.py finds it; skipped with the reason otherwise);
* ``zero-core, reuse 0`` and ``zero-core, reuse 1e9``: zero-core's ZeRO-3, from its ledger.

    python ci/tools/count_collectives.py            # about 4 minutes on 2 cores
    python ci/tools/count_collectives.py --max-live 5000000   # the live window below the model
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))  # this file is ci/tools/count_collectives.py
COUNTED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather",
           "broadcast", "all_to_all_single", "reduce_scatter")
PHASES = ("forward", "backward", "step")


def count_deepspeed_calls(counts: dict, phase: list) -> None:
    """Wrap torch.distributed's collectives so that each call adds (1, input bytes) to
    ``counts[(phase[0], name)]``; must run before deepspeed is imported."""
    import torch
    import torch.distributed as dist

    def wrap(name):
        original = getattr(dist, name)

        def counted(*args, **kwargs):
            tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
            # (output, input) for the *_tensor collectives; the one tensor otherwise
            sent = tensors[1] if name.endswith("_tensor") and len(tensors) > 1 else (
                tensors[0] if tensors else None)
            entry = counts[(phase[0], name)]
            entry[0] += 1
            entry[1] += 0 if sent is None else sent.numel() * sent.element_size()
            return original(*args, **kwargs)
        setattr(dist, name, counted)

    for name in COUNTED:
        if hasattr(dist, name):
            wrap(name)


def rank_main(variant: str, max_reuse: int, max_live: int) -> None:
    """One rank: build the worker's engine, step twice, report rank 0's counts."""
    import argparse as ap
    counts: dict = collections.defaultdict(lambda: [0, 0])
    phase = ["init"]
    if variant == "deepspeed-3":
        count_deepspeed_calls(counts, phase)
    sys.path.insert(0, os.path.join(HERE, "..", "bench", "workers"))
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import zeropp_engine as worker
    from gpt import build_model, lm_loss
    from text_data import GlobalBatchSampler, load_stdlib_text
    from zero_core.testing.ranks import report
    a = ap.Namespace(model="bench", micro=2, seq=None, lr=1e-3, max_reuse=max_reuse,
                     persistence=100_000, max_live=max_live)
    model = build_model(a.model, seed=1234)
    if variant == "deepspeed-3":
        engine = worker.DeepSpeedRun(model, a)
    else:
        import zero_core
        engine, *_ = zero_core.initialize(model=model, config=worker.engine_config("stage3", a, 2))
    sampler = GlobalBatchSampler(load_stdlib_text(max_bytes=4 << 20).train,
                                 model.cfg.block_size, a.micro, engine.world_size, seed=0)
    ledger = {}

    def run_phase(name, fn):
        """Run one phase of the step, attributing DeepSpeed's calls (via *phase*) or the
        ledger's difference (zero-core) to *name*."""
        phase[0] = name
        mark = engine.comm.ledger.snapshot() if variant != "deepspeed-3" else None
        out = fn()
        if mark is not None:
            ledger[name] = engine.comm.ledger.difference(engine.comm.ledger.snapshot(), mark)
        return out

    for i in range(2):  # a warm-up step, then the counted one
        counts.clear()
        x, y = sampler.rank_batch(i, engine.global_rank)
        loss = run_phase("forward", lambda: lm_loss(engine(x), y))
        run_phase("backward", lambda: engine.backward(loss))
        run_phase("step", engine.step)
    if variant == "deepspeed-3":
        rows = {f"{p}|{n}": v for (p, n), v in counts.items()}
    else:
        rows = {f"{p}|{op}": [r["calls"], r["payload_bytes"]]
                for p, diff in ledger.items() for op, r in diff["ops"].items()}
    report({"rank": engine.global_rank, "rows": rows})


def describe(rows: dict) -> dict:
    """``phase -> "2 all_gather (9.9 MB), ..."`` from ``{"phase|op": [calls, bytes]}``."""
    out = {p: [] for p in PHASES}
    for key, (calls, nbytes) in sorted(rows.items()):
        p, op = key.split("|")
        if p in out and calls:
            out[p].append(f"{calls} × {op} ({nbytes / 1e6:.2f} MB in)")
    return {p: ", ".join(v) or "—" for p, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-live", type=int, default=10**9,
                   help="stage3_max_live_parameters for every variant (default 1e9; the "
                        "model's 20M elements fit)")
    p.add_argument("--rank-worker", nargs=2, metavar=("VARIANT", "MAX_REUSE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        rank_main(args.rank_worker[0], int(args.rank_worker[1]), args.max_live)
        return 0
    sys.path.insert(0, os.path.join(HERE, "..", "bench"))
    import engine as be
    from zero_core.testing.ranks import run_ranks
    # every variant under one interpreter: the benchmark environment's when deepspeed is there
    skip_deepspeed = be.deepspeed_or_reexec(__file__, sys.argv[1:])
    env = {"DS_ACCELERATOR": "cpu", "ZERO_CORE_RANKS_PER_NODE": "2", "ZERO_CORE_COMM": "gloo",
           "OMP_NUM_THREADS": "1"}
    print("| per step, rank 0 | forward | backward | step |\n|---|---|---|---|")
    for label, variant, reuse in (("DeepSpeed ZeRO-3, reuse distance 0", "deepspeed-3", 0),
                                  ("zero-core ZeRO-3, reuse distance 0", "stage3", 0),
                                  ("zero-core ZeRO-3, reuse distance 1e9", "stage3", 10**9)):
        if variant == "deepspeed-3" and skip_deepspeed:
            print(f"| {label} | skipped: {skip_deepspeed} | | |", flush=True)
            continue
        results = run_ranks(os.path.abspath(__file__), 4, "torchrun",
                            args=["--rank-worker", variant, reuse, "--max-live", args.max_live],
                            env=env, timeout=900)
        cells = describe(results[0].report["rows"])
        print(f"| {label} | {cells['forward']} | {cells['backward']} | {cells['step']} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
