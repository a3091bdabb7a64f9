#!/usr/bin/env python
"""1-bit Adam, 0/1 Adam and 1-bit LAMB against plain Adam and ZeRO++'s qgZ on the emulated
two-node cluster: bytes sent and step time at a slow link (default 100 Mbit/s each way), side
by side in one run.

Variants, all training the example GPT (examples/gpt.py, preset ``bench`` by default) in
bf16 on the demo's text with the same seeds and batches:

  adam        stage 0, config "Adam": every step all-reduces the bf16 gradients
  onebit      stage 0, config "OneBitAdam" with freeze_step = the untimed warm-up steps, so
              every timed step is a compressed one (1-bit momentum all-reduce, optim/onebit.py)
  zeroone     stage 0, config "ZeroOneAdam" with var_freeze_step = warm-up steps - 1 and
              DeepSpeed's other defaults: every timed step is a local step, synchronized
              (local_step_interval 1 until local_step_scaler = 32678 steps) by a 1-bit
              all-reduce of the accumulated update
  onebitlamb  stage 0, config "OneBitLamb" with freeze_step = the warm-up steps (1-bit
              all-reduce of all momenta at once, frozen Lamb coefficients)
  zeropp-qgz  stage 3 with zero_quantized_gradients (qgZ: int4 two-hop gradient
              reduce-scatter), AdamW; its parameter all-gathers stay bf16

The driver runs ci/bench/cluster.py with this file as its rank worker (its worker protocol:
``step_times_s``, ``ledger``, ``link_tx_bytes``), prints cluster.py's table, then the
ratios to the first variant and the machine's load average before and after; numbers go to
--json (default docs/images/onebit.json). Needs root (network namespaces, tc):

    python ci/bench/onebit.py                          # 100mbit, 1 rank per node
    python ci/bench/onebit.py --rates 1gbit,100mbit --steps 5

As a rank worker (what cluster.py starts): ``onebit.py --variant NAME --steps S --warmup W``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
VARIANTS = ("adam", "onebit", "zeroone", "onebitlamb", "zeropp-qgz")


def engine_config(variant: str, a) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1,
           "bf16": {"enabled": True}, "steps_per_print": 10 ** 9}
    if variant == "adam":
        cfg.update(optimizer={"type": "Adam", "params": {"lr": a.lr}},
                   zero_optimization={"stage": 0})
    elif variant == "onebitlamb":
        cfg.update(optimizer={"type": "OneBitLamb", "params": {"lr": a.lr,
                                                               "freeze_step": a.warmup}},
                   zero_optimization={"stage": 0})
    elif variant == "zeroone":
        # frozen after step var_freeze_step + 1 (DeepSpeed's rule): the timed steps are local
        cfg.update(optimizer={"type": "ZeroOneAdam", "params": {
            "lr": a.lr, "var_freeze_step": max(a.warmup - 1, 0)}},
                   zero_optimization={"stage": 0})
    elif variant == "onebit":
        cfg.update(optimizer={"type": "OneBitAdam", "params": {"lr": a.lr,
                                                               "freeze_step": a.warmup}},
                   zero_optimization={"stage": 0})
    else:
        cfg.update(optimizer={"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.0}},
                   zero_optimization={"stage": 3, "zero_quantized_gradients": True,
                                      "stage3_param_persistence_threshold": 100_000})
    return cfg


def worker(argv) -> None:
    """One rank: train *a.warmup* untimed and *a.steps* timed steps, report (cluster.py's
    protocol, timed by ci/bench/workers/zeropp_engine.py's ``time_steps``)."""
    sys.path.insert(0, os.path.join(HERE, "workers"))
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import zero_core
    from gpt import build_model
    from zero_core.runtime.context import shutdown
    from zero_core.testing.ranks import report
    from zeropp_engine import time_steps
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--model", default="bench")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    model = build_model(a.model, seed=1234)
    engine, *_ = zero_core.initialize(model=model, config=engine_config(a.variant, a))
    comm = engine.comm
    timed = time_steps(engine, a, model.cfg.block_size, comm, comm.barrier)
    report({"rank": engine.global_rank, "variant": a.variant, "model": a.model,
            "params": engine.num_parameters, "world_size": engine.world_size, **timed,
            "by_op": timed["ledger"]["ops"]})
    engine.destroy()
    shutdown()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--variant" in argv:
        worker(argv)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="100mbit")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--launcher", choices=("torchrun", "mpirun"), default="torchrun")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--worker-args", default="--model bench --micro 2")
    p.add_argument("--json", default=os.path.join(REPO, "docs", "images", "onebit.json"))
    a = p.parse_args(argv)
    sys.path.insert(0, HERE)
    import cluster
    load_before = os.getloadavg()
    rc = cluster.main(["--worker", os.path.abspath(__file__), "--rates", a.rates,
                       "--variants", a.variants, "--ranks-per-node", str(a.ranks_per_node),
                       "--launcher", a.launcher, "--steps", str(a.steps),
                       "--warmup", str(a.warmup), "--worker-args", a.worker_args,
                       "--json", a.json, "--plot", os.path.splitext(a.json)[0] + ".png"])
    load_after = os.getloadavg()
    with open(a.json) as fh:
        result = json.load(fh)
    rows = [r for r in result["rows"] if "error" not in r]
    print("ratios to the first variant at each rate (step time, ledger inter-node bytes):")
    for rate in dict.fromkeys(r["rate"] for r in rows):
        same = [r for r in rows if r["rate"] == rate]
        base = same[0]
        for r in same:
            b0 = base["ledger_inter_node_bytes_per_rank_step"]
            b1 = r["ledger_inter_node_bytes_per_rank_step"]
            ratio = f"{b1 / b0:.4f}" if b0 and b1 is not None else "n/a"
            print(f"  {rate} {r['variant']}: time "
                  f"{r['step_s_median'] / base['step_s_median']:.3f}, bytes {ratio}")
    load = {"loadavg_1m_before": load_before[0], "loadavg_1m_after": load_after[0],
            "cpus": os.cpu_count()}
    print(f"machine load (1-minute load average): {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after, on {os.cpu_count()} CPUs")
    result["machine_load"] = load
    with open(a.json, "w") as fh:
        json.dump(result, fh, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
