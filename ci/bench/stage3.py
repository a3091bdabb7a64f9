#!/usr/bin/env python
"""ZeRO stage 3: zero-core against DDP, FSDP2 and DeepSpeed ZeRO-3, side by side, in one run.

The same set-up as the stage 0-2 benchmark (ci/bench/engine.py), whose worker
(ci/bench/workers/contender.py) and summaries this script reuses: every contender trains the
~20M-parameter GPT (examples/gpt.py ``bench`` preset) from the same weights on the same global
batches (4 sequences x 128 tokens per rank, 2 ranks), fp32, AdamW, as its own multi-rank job:

  compute-only      the same per-rank batch with no communication: the lower bound
  ddp               DistributedDataParallel, gloo                     (torchrun-style)
  fsdp2             torch.distributed.fsdp.fully_shard per block+root (torchrun-style)
  deepspeed-3       DeepSpeed ZeRO-3, DS_ACCELERATOR=cpu, gloo        (torchrun-style)
  zero-core-3-gloo  zero-core stage 3, torch.distributed gloo         (torchrun-style)
  zero-core-3-mpi   zero-core stage 3, MPI through mpi4py             (mpirun)

Stage-3 settings are both engines' defaults (DeepSpeed's documented values, which zero-core
shares): prefetch 5e7 elements, persistence threshold 1e5, max live 1e9, reuse distance 1e9.

Reported per contender: median step time (slowest rank) and its ratio to DDP, the p10-p90
spread, CPU seconds per step and rank (steadier than wall time on a loaded machine), peak
resident memory of the largest rank, and first/last loss. zero-core's targets: <= 1.15x DDP
over MPI, <= 1.30x over gloo, and faster than FSDP2 and DeepSpeed ZeRO-3 in the same run.

DeepSpeed is found as ci/bench/engine.py finds it (a separate benchmark environment; this
script re-runs itself there); without it its row says why it was skipped.

    python ci/bench/stage3.py                     # 3 warm-up + 10 timed steps, 2 rounds
    python ci/bench/stage3.py --quick             # tiny model, 1 + 3 steps: a smoke run
    python ci/bench/stage3.py --wait-for-load 3   # first wait (<= 60 min) for a quiet machine
    python ci/bench/stage3.py --replot docs/images/stage3.json   # redraw the chart only

The table goes to stdout, every number to --json and the chart to --plot (default
docs/images/stage3.json and .png; ci/bench/plots.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import engine as be  # noqa: E402  (the stage 0-2 benchmark: worker, runner, tables)
import plots  # noqa: E402  (JSON and PNG beside the table)

RANKS = be.RANKS
# zero-core's stage-3 targets from the issue, as a ratio of median step time to DDP's
TARGETS = {"mpi": 1.15, "gloo": 1.30}
PEERS_TO_BEAT = ("fsdp2", "deepspeed-3")


def stage3_contenders(model: str) -> list[be.Contender]:
    """The stage-3 comparison, every worker told which model preset to train."""
    m = ["--model", model]
    return [be.Contender("compute-only", ["compute_only", *m]),
            be.Contender("ddp", ["ddp", *m]),
            be.Contender("fsdp2", ["fsdp2", *m]),
            be.Contender("deepspeed-3", ["deepspeed", "--stage", "3", *m],
                         env={"DS_ACCELERATOR": "cpu"}, needs="deepspeed"),
            be.Contender("zero-core-3-gloo", ["zero_core", "--stage", "3", "--comm", "gloo", *m]),
            be.Contender("zero-core-3-mpi", ["zero_core", "--stage", "3", "--comm", "mpi", *m],
                         launcher="mpirun")]


def wait_for_quiet(threshold: float, max_minutes: float, poll_s: float = 180.0) -> float:
    """Poll the 1-minute load average until it is below *threshold* or *max_minutes* have
    passed; return the load average when giving up or going ahead."""
    deadline = time.monotonic() + max_minutes * 60
    while True:
        load = os.getloadavg()[0]
        if load < threshold or time.monotonic() >= deadline:
            verdict = "quiet enough" if load < threshold else "still busy, running anyway"
            print(f"[bench] load average {load:.2f} (threshold {threshold}): {verdict}",
                  file=sys.stderr, flush=True)
            return load
        print(f"[bench] load average {load:.2f} >= {threshold}: waiting "
              f"{poll_s / 60:.0f} min", file=sys.stderr, flush=True)
        time.sleep(min(poll_s, max(1.0, deadline - time.monotonic())))


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)


# ---------------------------------------------------------------- verdicts

def stage3_verdicts(rows: list[dict]) -> list[str]:
    """zero-core's stage-3 rows against the targets: the DDP ratio per transport, and faster
    (median step) than each peer that ran."""
    by_name = {r["name"]: r for r in rows if r["status"] == "ok"}
    ddp = by_name.get("ddp")
    verdicts = []
    for comm in ("gloo", "mpi"):
        mine = by_name.get(f"zero-core-3-{comm}")
        if mine is None:
            continue
        if ddp is not None:
            ratio = mine["median_step_s"] / ddp["median_step_s"]
            verdicts.append(f"zero-core-3-{comm}: {ratio:.2f}× DDP (target ≤ {TARGETS[comm]:.2f}×) "
                            f"{'meets' if ratio <= TARGETS[comm] else 'MISSES'} the target")
        for peer in PEERS_TO_BEAT:
            other = by_name.get(peer)
            if other is None:
                verdicts.append(f"zero-core-3-{comm} vs {peer}: {peer} did not run")
                continue
            speedup = other["median_step_s"] / mine["median_step_s"]
            verdicts.append(f"zero-core-3-{comm} vs {peer}: {speedup:.2f}× as fast "
                            f"({'faster' if speedup > 1 else 'NOT faster'})")
        bound = by_name.get("compute-only")
        if bound is not None:
            ratio = mine["median_step_s"] / bound["median_step_s"]
            goal = (f"(goal over MPI ≤ {be.COMPUTE_ONLY_TARGET:.2f}×) "
                    f"{'meets' if ratio <= be.COMPUTE_ONLY_TARGET else 'MISSES'} it"
                    if comm == "mpi" else "(gloo: reported, no goal)")
            verdicts.append(f"zero-core-3-{comm}: {ratio:.2f}× compute-only {goal}")
    return verdicts


def memory_table(rows: list[dict]) -> str:
    """zero-core's own account of rank 0's memory (its ledger of model-state bytes, the stage-3
    live window) beside the process's peak RSS, which also holds torch, activations and text."""
    lines = ["| contender | model states (MiB, ledger / formula) | stage-3 live window peak (MiB) "
             "| fetch units (persistent) | unit gathers, all steps | peak RSS (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok" or not r["runs"][-1].get("memory_report"):
            continue
        rep = r["runs"][-1]["memory_report"][0]
        s3 = rep.get("stage3", {})
        lines.append(f"| {r['name']} | {rep['ledger']['model_states'] / 2**20:,.1f} / "
                     f"{rep['formula']['model_states'] / 2**20:,.1f} | "
                     f"{s3.get('live_window_peak', 0) / 2**20:,.1f} | "
                     f"{s3.get('fetch_units', '—')} ({s3.get('persistent_units', '—')}) | "
                     f"{s3.get('gathers', '—')} | {r['peak_rss_bytes'] / 2**20:,.0f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


# ---------------------------------------------------------------- main

def run_all(contenders, skipped, rounds, warmup, steps, timeout) -> dict:
    """Every contender's runs, rounds in alternating order so that load drifting during the
    run favours nobody; a contender that failed once is not repeated."""
    runs = {c.name: [] for c in contenders}
    active = [c for c in contenders if c.name not in skipped]
    for rnd in range(rounds):
        for c in (active if rnd % 2 == 0 else active[::-1]):
            if runs[c.name] and runs[c.name][-1]["status"] != "ok":
                continue
            print(f"[bench] round {rnd + 1}/{rounds}: {c.name} ({c.launcher}) ...",
                  file=sys.stderr, flush=True)
            run = be.run_contender(c, warmup, steps, timeout)
            runs[c.name].append(run)
            if run["status"] == "ok":
                print(f"[bench]   median {statistics.median(run['step_s']):.3f} s/step, "
                      f"CPU {statistics.median(run['cpu_step_s']):.3f} s/step/rank "
                      f"(load {run['loadavg_1min_before']:.1f} → {run['loadavg_1min_after']:.1f})",
                      file=sys.stderr, flush=True)
            else:
                print(f"[bench]   {run['status']}\n{run['reason']}", file=sys.stderr, flush=True)
    return runs


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=2,
                   help="run every contender this many times, alternating the order")
    p.add_argument("--model", default="bench", help="examples/gpt.py preset (default bench)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny model, 1 warm-up + 3 timed steps, 1 round")
    p.add_argument("--only", default="*", help="comma-separated contender names or globs")
    p.add_argument("--timeout", type=float, default=900, help="seconds per contender job")
    p.add_argument("--wait-for-load", type=float, default=0, metavar="LOAD",
                   help="first wait until the 1-minute load average is below LOAD")
    p.add_argument("--wait-max-min", type=float, default=60,
                   help="give up waiting after this many minutes and run anyway")
    plots.add_arguments(p, "stage3")
    args = p.parse_args(argv)
    meta = plots.start(args, "stage3", __file__, argv)
    if args.quick:
        args.model, args.warmup, args.steps, args.rounds = "tiny", 1, 3, 1
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    chosen = be.select(stage3_contenders(args.model), args.only)
    skip_reason = None
    if any(c.needs == "deepspeed" for c in chosen):
        skip_reason = be.deepspeed_or_reexec(__file__, argv)
    skipped = {c.name: skip_reason for c in chosen if c.needs == "deepspeed" and skip_reason}
    for name, reason in skipped.items():
        print(f"[bench] {name}: skipped ({reason})", file=sys.stderr, flush=True)
    if args.wait_for_load > 0:
        wait_for_quiet(args.wait_for_load, args.wait_max_min)

    import torch
    print(f"# zero-core vs peers: ZeRO stage 3, {RANKS} ranks, GPT '{args.model}' preset, fp32 "
          f"AdamW, 4 sequences per rank; {args.warmup} warm-up + {args.steps} timed steps x "
          f"{args.rounds} round(s)", flush=True)
    print(f"# python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, "
          f"{os.cpu_count()} cores, 1 thread per rank; load average now "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    runs = run_all(chosen, skipped, args.rounds, args.warmup, args.steps, args.timeout)
    rows = [{"name": c.name, "status": "skipped", "reason": skipped[c.name]} if c.name in skipped
            else be.summarize(c, runs[c.name]) for c in chosen]
    ddp = next((r for r in rows if r["name"] == "ddp" and r["status"] == "ok"), None)
    for r in rows:
        if ddp and r["status"] == "ok":
            r["vs_ddp"] = r["median_step_s"] / ddp["median_step_s"]
    verdicts = stage3_verdicts(rows)
    print()
    print(be.markdown_table(rows))
    print()
    print(be.phase_table(rows))
    print()
    for verdict in verdicts:
        print(f"- {verdict}")
    mem = memory_table(rows)
    if mem:
        print("\n" + mem)
    loads = [x for r in rows if r["status"] == "ok" for x in r["loadavg_1min"]]
    if loads:
        print(f"\n1-minute load average during the run: {min(loads):.2f}–{max(loads):.2f} "
              f"(2 ranks alone give ~2; more means other work shared the cores)")
    print()
    plots.finish(args, "stage3", {"benchmark": "stage3", "ranks": RANKS, "model": args.model,
                                  "warmup": args.warmup, "steps": args.steps,
                                  "rounds": args.rounds, "python": sys.executable,
                                  "torch": torch.__version__, "targets": TARGETS,
                                  "verdicts": verdicts, "results": rows}, meta)
    print("\n```json")
    print(json.dumps({r["name"]: {k: r.get(k) for k in (
        "status", "median_step_s", "vs_ddp", "median_cpu_step_s", "peak_rss_bytes",
        "first_loss", "last_loss", "reason")} for r in rows}))
    print("```")
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
