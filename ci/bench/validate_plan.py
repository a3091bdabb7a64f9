#!/usr/bin/env python3
"""`zero-core plan`'s predictions against measured runs on this machine (issue 17 §3).

    python ci/bench/validate_plan.py                                   # bench GPT, 2 ranks, 5 configs
    python ci/bench/validate_plan.py --configs s3-fp32,s2-fp32-cpu --micro 8 --json out.json

For each configuration it asks the planner (``zero_core.plan.planner.evaluate`` on the
``this-machine`` cluster, rates timed first by ``zero-core plan --measure``'s code) for
the memory per rank and the step time, then trains the example GPT with that configuration
on real ranks (``ci/bench/workers/plan_check.py``), with the config the planner itself
prints for that candidate (``planner.ds_config``), and measures both: the peak resident
memory per rank during training above the process's size before the model was built (the
CPU "device" is host memory), and the median step time. The table puts them side by side
with the ratio measured / predicted; the goals are ±15 % (memory) and ±30 % (time).

Configurations are named s<stage>-<precision>[-<offload>]: s3-fp32, s2-fp32-cpu, ...
(fp32 only by default: the measured FLOP rate is float32's, and bf16 matmuls on a CPU run
at another rate the measurement does not time).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "plan_check.py")
DEFAULT_CONFIGS = "s0-fp32,s1-fp32,s2-fp32,s3-fp32,s2-fp32-cpu"
COMM = {"torchrun": "gloo", "mpirun": "mpi"}


def parse_config(name: str) -> tuple[int, str, str]:
    parts = name.split("-")
    if len(parts) not in (2, 3) or not parts[0].startswith("s") or not parts[0][1:].isdigit():
        raise SystemExit(f"validate_plan: configuration {name!r} is not s<stage>-<precision>"
                         f"[-<offload>], e.g. s3-fp32 or s2-fp32-cpu")
    stage, precision = int(parts[0][1:]), parts[1]
    offload = parts[2] if len(parts) == 3 else "none"
    if stage not in range(4) or precision not in ("fp32", "bf16") or \
            offload not in ("none", "cpu", "nvme") or (stage == 0 and offload != "none"):
        raise SystemExit(f"validate_plan: configuration {name!r}: stage 0-3, precision fp32 "
                         f"or bf16, offload cpu or nvme (not at stage 0)")
    return stage, precision, offload


def run_config(args, config: dict) -> dict:
    """Train with *config* (the planner's own DeepSpeed-style config of the candidate) on
    real ranks; nvme swap files go to a temporary directory removed afterwards."""
    from zero_core.testing.ranks import run_ranks
    env = {"ZERO_CORE_COMM": COMM[args.launcher],
           # freed large blocks go back to the OS, so the resident peak is what was live
           "MALLOC_MMAP_THRESHOLD_": "1048576"}
    with tempfile.TemporaryDirectory(prefix="zero_core_plan_nvme_") as scratch:
        for key in ("offload_optimizer", "offload_param"):
            where = config["zero_optimization"].get(key)
            if where and where["device"] == "nvme":
                where["nvme_path"] = scratch
        wargs = ["--preset", args.preset, "--config", json.dumps(config),
                 "--steps", args.steps, "--warmup", args.warmup]
        results = run_ranks(WORKER, args.ranks, args.launcher, args=wargs, env=env,
                            timeout=args.timeout)
    reps = [r.report for r in results]
    return {"ranks": reps,
            "memory_bytes": max(r["peak_bytes"] - r["baseline_bytes"] for r in reps),
            "step_s": max(r["median_step_s"] for r in reps),
            "peak_reset": all(r["peak_reset"] for r in reps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench", help="examples/gpt.py preset (default bench)")
    p.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--launcher", choices=tuple(COMM), default="torchrun")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--measurement", help="rates saved by `zero-core plan --measure "
                                         "--save-measurement FILE` (default: measure now)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="also write predictions and measurements here")
    args = p.parse_args(argv)
    configs = [(name, *parse_config(name)) for name in args.configs.split(",")]

    from zero_core.plan.cluster import this_machine
    from zero_core.plan.measure import measure
    from zero_core.plan.model import from_preset
    from zero_core.plan.planner import ds_config, evaluate

    load_before = os.getloadavg()
    spec = from_preset(args.preset)
    if args.measurement:
        with open(args.measurement) as fh:
            rates = json.load(fh)
    else:
        print("[validate_plan] measuring this machine's rates (zero-core plan --measure) ...",
              file=sys.stderr, flush=True)
        rates = measure(args.ranks, block=(spec.hidden, spec.n_head, spec.seq, args.micro))
    cluster = this_machine(rates, args.ranks)
    rows = []
    for name, stage, precision, offload in configs:
        # scaled_dot_product_attention on the CPU keeps no s x s attention matrix
        cand = evaluate(spec, cluster, args.micro, precision, stage, offload,
                        flash_attention=True)
        print(f"[validate_plan] {name}: training {args.warmup} + {args.steps} steps on "
              f"{args.ranks} ranks ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        got = run_config(args, ds_config(cand, args.micro, precision, cluster.ranks_per_node))
        mem = cand.memory
        rows.append({"config": name, "stage": stage, "precision": precision, "offload": offload,
                     "predicted_bytes": mem["device_total"] + mem["host"],
                     "predicted_parts": {"model_states_device": mem["device_model_states"],
                                         "host": mem["host"],
                                         "activations": mem["activations"]["total"],
                                         "buffers": mem["buffers"]["total"]},
                     "measured_bytes": got["memory_bytes"],
                     "predicted_s": cand.time["total"], "predicted_time": cand.time,
                     "measured_s": got["step_s"], "peak_reset": got["peak_reset"],
                     "wall_s": time.perf_counter() - t0, "ranks_reports": got["ranks"]})
    load_after = os.getloadavg()

    print(f"# zero-core plan vs measured: GPT '{args.preset}' ({spec.num_parameters:,} "
          f"parameters), {args.micro} x {spec.seq} tokens per rank, {args.ranks} ranks "
          f"({args.launcher}, {COMM[args.launcher]}), {args.warmup} warm-up + {args.steps} timed "
          f"steps; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"# rates: training {rates['train_flops'] / 1e9:.1f} GFLOP/s per rank (matmul "
          f"{rates['flops'] / 1e9:.1f}), Adam {rates['optimizer_rate'] / 1e6:.0f} M elements/s, "
          f"collectives "
          f"{rates['intra_bandwidth'] / 1e9:.2f} GB/s, memcpy "
          f"{rates['memcpy_bandwidth'] / 1e9:.1f} GB/s, disk {rates['disk_bandwidth'] / 1e9:.2f} GB/s")
    print("| config | predicted GB/rank | measured GB/rank | measured/predicted | "
          "predicted s/step | measured s/step | measured/predicted |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rm, rt = r["measured_bytes"] / r["predicted_bytes"], r["measured_s"] / r["predicted_s"]
        r["memory_ratio"], r["time_ratio"] = rm, rt
        r["memory_ok"], r["time_ok"] = abs(rm - 1) <= 0.15, abs(rt - 1) <= 0.30
        print(f"| {r['config']} | {r['predicted_bytes'] / 1e9:.3f} | "
              f"{r['measured_bytes'] / 1e9:.3f} | {rm:.2f}{'' if r['memory_ok'] else ' (off)'} | "
              f"{r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
              f"{rt:.2f}{'' if r['time_ok'] else ' (off)'} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"rates": rates, "cluster": cluster.describe(), "rows": rows,
                       "load": [load_before, load_after]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
