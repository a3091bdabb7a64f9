#!/usr/bin/env python
"""zero-core on the vdev device next to the same run on the CPU: step time and the bytes
that cross between host and device, for ZeRO stages 2 and 3.

vdev (examples/vdev) computes with the CPU's kernels on memory of its own, so the
difference between the two rows of a pair is what a real device pays that the CPU does
not: the device<->host copies of the staged collectives (gloo and MPI carry host memory),
the device's dispatch, and keeping every buffer on the right side. Per step the table shows
the median step time (slowest rank), its ratio to the CPU row, host->device and
device->host bytes counted by vdev's allocator, the ledger's staged bytes and the seconds
the staging copies took, and the staged bytes over the formula ``2 (1 + 1/N) x 4 Psi``: a
staged collective copies its input to the host and its output back, and a step has a
gradient reduce-scatter and a parameter all-gather of Psi fp32 elements. (Stage 3 has the
same two: with the default stage3_max_reuse_distance the backward does not gather again.)

    python ci/bench/device.py                       # small GPT, stages 2 and 3, gloo and MPI
    python ci/bench/device.py --preset bench --steps 10 --json out.json
    python ci/bench/device.py --replot docs/images/device.json   # redraw the chart only

The table goes to stdout, every number to --json and the chart to --plot (default
docs/images/device.json and .png; ci/bench/plots.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plots  # noqa: E402  (JSON and PNG beside the table)

WORKER = os.path.join(REPO, "ci", "bench", "workers", "device_step.py")
RANKS = 2
#: parameter-sized collectives per step: reduce-scatter + all-gather (stage 3's backward
#: re-gather is saved by the default reuse distance; the formula column shows if it is not)
COLLECTIVES_PER_STEP = 2


def run(stage, accelerator, launcher, preset, warmup, steps):
    from zero_core.testing.ranks import run_ranks
    env = {"ZERO_CORE_ACCELERATOR": accelerator,
           "ZERO_CORE_COMM": "gloo" if launcher == "torchrun" else "mpi"}
    results = run_ranks(WORKER, RANKS, launcher, args=[stage, preset, warmup, steps],
                        env=env, timeout=1800)
    reports = [r.report for r in results]
    times = [max(rep["rows"][i]["time"] for rep in reports) for i in range(steps)]
    rows = reports[0]["rows"]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"stage": stage, "accelerator": accelerator,
            "comm": env["ZERO_CORE_COMM"], "params": reports[0]["params"],
            "step_s": statistics.median(times), "h2d": med("h2d"), "d2h": med("d2h"),
            "staged": med("staged"), "staging_s": med("staging_s"), "sent": med("sent"),
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}


def formula_bytes(params, ranks=RANKS, elem=4):
    return COLLECTIVES_PER_STEP * (1 + 1 / ranks) * params * elem


def table(results) -> str:
    cpu = {(r["stage"], r["comm"]): r for r in results if r["accelerator"] == "cpu"}
    lines = ["| stage | comm | device | step (s) | vs cpu | H2D MB/step | D2H MB/step | "
             "staged MB/step | staged / 2(1+1/N)·4Ψ | staging s/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = cpu.get((r["stage"], r["comm"]))
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        formula = formula_bytes(r["params"])
        lines.append(
            f"| {r['stage']} | {r['comm']} | {r['accelerator']} | {r['step_s']:.3f} | {ratio} | "
            f"{r['h2d'] / 1e6:.2f} | {r['d2h'] / 1e6:.2f} | {r['staged'] / 1e6:.2f} | "
            f"{r['staged'] / formula:.2f} | {r['staging_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="examples/gpt.py preset (tiny, small, bench)")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--comms", default="gloo,mpi", help="gloo (torchrun) and/or mpi (mpirun)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    plots.add_arguments(p, "device")
    args = p.parse_args(argv)
    meta = plots.start(args, "device", __file__, sys.argv[1:] if argv is None else argv)
    launchers = {"gloo": "torchrun", "mpi": "mpirun"}
    results = []
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    for stage in (int(s) for s in args.stages.split(",")):
        for comm in args.comms.split(","):
            for acc in ("cpu", "vdev"):
                print(f"stage {stage} {comm} {acc} ...", flush=True)
                results.append(run(stage, acc, launchers[comm], args.preset, args.warmup,
                                   args.steps))
    print(f"load after: {os.getloadavg()[0]:.2f}  (1-minute average, {os.cpu_count()} cores)")
    print(f"{RANKS} ranks, preset {args.preset} ({results[0]['params'] / 1e6:.2f}M parameters), "
          f"fp32, median of {args.steps} steps after {args.warmup} warm-up")
    print(table(results))
    print()
    plots.finish(args, "device", {"benchmark": "device", "ranks": RANKS, "preset": args.preset,
                                  "warmup": args.warmup, "steps": args.steps,
                                  "results": results}, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
