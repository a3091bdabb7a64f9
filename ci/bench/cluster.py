#!/usr/bin/env python
"""Step time and inter-node bytes of a training worker on an emulated two-node cluster,
for several link rates.

For each rate (default 10gbit, 1gbit, 100mbit, each direction of the link) and each
variant, the worker runs on 2 nodes x ``--ranks-per-node`` ranks in the emulated cluster
of zero_core/testing/emulated_cluster.py (network namespaces joined by a tbf-shaped veth; traffic
between ranks of one node is not shaped). The table shows, per (rate, variant):

  step ms      median over timed steps of the slowest rank's step time, and p10-p90
  ledger MB    inter-node bytes per rank and step, from zero-core's communication ledger
               (bytes of collectives on groups that span nodes, by the ledger's convention)
  link MB      bytes that really crossed the veth per rank and step (node counters, with
               TCP/IP headers), when the worker reports them
  link-bound   the step time the link alone would impose: the busier direction's bytes per
               step divided by the rate
  speed-up     the first variant's median step time over this one's, at the same rate
  fwd/bwd/opt  median over timed steps of the ranks' mean forward, backward and optimizer
               step seconds, when the worker reports ``phase_times_s``
  peak RSS     the largest rank's peak resident set in MB, when the worker reports
               ``peak_rss_mb``

Worker protocol (how the real engine worker plugs in): the worker is a Python file run
on every rank with ``--variant NAME --steps S --warmup W`` plus ``--worker-args``; it
calls ``zero_core.testing.ranks.report({...})`` once with at least ``step_times_s`` (a list of
the timed steps' durations in seconds) and ``ledger`` (``CommLedger.difference`` over the
timed steps), and may add ``link_tx_bytes`` on local rank 0 (its node's veth counter
difference over the timed steps; see ci/bench/workers/comm_volume.py) and ``peak_rss_mb``.
A variant that cannot run here (a peer without the feature) reports ``{"error": REASON}``
instead: its row says "did not run: REASON" and the others still run. The default worker,
ci/bench/workers/comm_volume.py, times only the collectives of ZeRO-3 and of ZeRO++
(qwZ + hpZ + qgZ) for ``--params`` parameters. Once the stage-3 engine exists:

    python ci/bench/cluster.py --worker ci/bench/workers/<engine worker>.py \\
        --variants stage3,stage3-zeropp --worker-args "--model small"

The multi-node comparison (node-aware ZeRO-3, MiCS, ZeRO++, FSDP2 hybrid sharding,
DeepSpeed ZeRO-3 and MiCS; ci/bench/workers/multinode_engine.py), results beside the
others' rather than over docs/images/cluster.json:

    python ci/bench/cluster.py --worker ci/bench/workers/multinode_engine.py \\
        --variants zero3,zero3-nodeaware,mics,mics-zeropp,zeropp,fsdp2-hsdp,\\
deepspeed-3,deepspeed-mics --worker-args "--model bench --micro 2" \\
        --json docs/images/multinode.json

Needs root (network namespaces, tc). Examples:

    python ci/bench/cluster.py                                  # defaults, ~1-2 minutes
    python ci/bench/cluster.py --rates 1gbit,100mbit --steps 5 --json out.json
    python ci/bench/cluster.py --worker-args "--params 16000000"
    python ci/bench/cluster.py --replot docs/images/cluster.json   # redraw the chart only

The table goes to stdout, every number to --json and the chart to --plot (default
docs/images/cluster.json and .png; ci/bench/plots.py; --plot names the PNG, --json the JSON).
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_core.testing.emulated_cluster import (DEFAULT_SUBNET, NUM_NODES,  # noqa: E402
                                                ClusterError, EmulatedCluster, format_rate,
                                                parse_rate)
from zero_core.testing.ranks import run_ranks  # noqa: E402

import plots  # noqa: E402  (JSON and PNG beside the table)

DEFAULT_WORKER = os.path.join(REPO, "ci", "bench", "workers", "comm_volume.py")
DEFAULT_RATES = "10gbit,1gbit,100mbit"
DEFAULT_VARIANTS = "zero3,zeropp"
MB = 1e6


def percentile(values: list[float], q: float) -> float:
    """The *q* quantile (0..1) of *values*, linearly interpolated."""
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(reports: list[dict], rate_bps: int | None) -> dict:
    """One table row's numbers from every rank's report (see the worker protocol)."""
    world = len(reports)
    if any(r is None for r in reports):
        raise ValueError("a rank reported nothing")
    steps = min(len(r["step_times_s"]) for r in reports)
    if steps == 0:
        raise ValueError("the worker reported no timed steps")
    slowest = [max(r["step_times_s"][i] for r in reports) for i in range(steps)]
    # a peer without zero-core's ledger (DeepSpeed) reports ledger None: link bytes only
    has_ledger = all(r.get("ledger") is not None for r in reports)
    link = [r.get("link_tx_bytes") for r in reports if r.get("link_tx_bytes") is not None]
    row = {
        "steps": steps,
        "step_s_median": statistics.median(slowest),
        "step_s_p10": percentile(slowest, 0.1),
        "step_s_p90": percentile(slowest, 0.9),
        "step_s": slowest,
        "ledger_inter_node_bytes_per_rank_step": statistics.mean(
            r["ledger"]["inter_node_bytes"] / steps for r in reports) if has_ledger else None,
        "ledger_intra_node_bytes_per_rank_step": statistics.mean(
            r["ledger"]["intra_node_bytes"] / steps for r in reports) if has_ledger else None,
        "link_bytes_per_rank_step": sum(link) / steps / world if len(link) == NUM_NODES else None,
        "link_bound_s": (max(link) / steps / (rate_bps / 8)
                         if len(link) == NUM_NODES and rate_bps else None),
        "phase_s_median": ({name: statistics.median(
            statistics.mean(r["phase_times_s"][name][i] for r in reports) for i in range(steps))
            for name in reports[0]["phase_times_s"]}
            if all(r.get("phase_times_s") for r in reports) else None),
        "peak_rss_mb_max": (max(r["peak_rss_mb"] for r in reports)
                            if all(r.get("peak_rss_mb") is not None for r in reports) else None),
    }
    return row


def did_not_run(reports: list) -> str | None:
    """The reason a rank gave for not running the variant (``{"error": ...}``), if any, on
    one line and without the table's column bars."""
    for r in reports:
        if isinstance(r, dict) and r.get("error"):
            return " ".join(str(r["error"]).split()).replace("|", "/")
    return None


def markdown(rows: list[dict]) -> str:
    """The results as a markdown table (rows in run order)."""
    head = ("| rate | variant | step ms (median) | p10-p90 ms | inter-node MB/rank/step (ledger) "
            "| link MB/rank/step (veth) | link-bound ms | speed-up | fwd/bwd/opt s "
            "| peak RSS MB (max rank) |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    base = {}
    for row in rows:
        key = row["rate"]
        if "error" in row:
            what = ("did not run: " + row["error"][:300] if row.get("did_not_run")
                    else "failed: " + row["error"][:80])
            lines.append(f"| {row['rate']} | {row['variant']} | {what} | | | | | | | |")
            continue
        base.setdefault(key, row["step_s_median"])
        link = row["link_bytes_per_rank_step"]
        bound = row["link_bound_s"]
        ledger = row["ledger_inter_node_bytes_per_rank_step"]
        phases = row.get("phase_s_median")
        rss = row.get("peak_rss_mb_max")
        lines.append(
            f"| {row['rate']} | {row['variant']} | {row['step_s_median'] * 1e3:.1f} "
            f"| {row['step_s_p10'] * 1e3:.1f}-{row['step_s_p90'] * 1e3:.1f} "
            f"| {'n/a' if ledger is None else f'{ledger / MB:.2f}'} "
            f"| {'n/a' if link is None else f'{link / MB:.2f}'} "
            f"| {'n/a' if bound is None else f'{bound * 1e3:.1f}'} "
            f"| {base[key] / row['step_s_median']:.2f}x "
            f"| {'n/a' if not phases else '/'.join(f'{v:.2f}' for v in phases.values())} "
            f"| {'n/a' if rss is None else f'{rss:.0f}'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default=DEFAULT_RATES,
                   help=f"comma-separated link rates per direction (default {DEFAULT_RATES})")
    p.add_argument("--delay", default=None, help="one-way link delay, e.g. 1ms (needs netem)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="comma-separated values passed to the worker as --variant; the first "
                        "is the speed-up baseline")
    p.add_argument("--worker", default=DEFAULT_WORKER,
                   help="rank program (see 'Worker protocol'); default: the collectives-only "
                        "stand-in ci/bench/workers/comm_volume.py")
    p.add_argument("--worker-args", default="", help="extra arguments for the worker, one string")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--launcher", choices=("torchrun", "mpirun"), default="torchrun",
                   help="start ranks torchrun-style or as one Open MPI job across both nodes "
                        "(with the stand-in worker, add --worker-args '--comm mpi' to carry "
                        "the collectives over MPI too)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per worker run")
    p.add_argument("--subnet", default=DEFAULT_SUBNET)
    p.add_argument("--prefix", default="zc")
    plots.add_arguments(p, "cluster")
    a = p.parse_args(argv)
    if a.plot and a.plot.endswith(".json"):
        p.error(f"--plot names the chart (PNG); for the results use --json {a.plot} "
                f"(the PNG goes next to it)")
    meta = plots.start(a, "cluster", __file__, sys.argv[1:] if argv is None else argv)

    rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    try:
        for r in rates:
            parse_rate(r)
    except ClusterError as exc:
        p.error(str(exc))
    if not os.path.exists(a.worker):
        p.error(f"worker {a.worker} does not exist")
    if any(v.startswith("deepspeed") for v in variants):
        import engine as be  # the benchmark environment that has deepspeed
        reason = be.deepspeed_or_reexec(__file__, sys.argv[1:] if argv is None else argv)
        if reason is not None:
            print(f"bench/cluster.py: DeepSpeed variants skipped: {reason}", file=sys.stderr)
            variants = [v for v in variants if not v.startswith("deepspeed")]

    rows = []
    started = time.time()
    try:
        with EmulatedCluster(rate=rates[0], delay=a.delay, subnet=a.subnet,
                             prefix=a.prefix) as cluster:
            print(f"# emulated cluster: {cluster.describe()}", file=sys.stderr, flush=True)
            for rate in rates:
                cluster.set_rate(rate, a.delay)
                for variant in variants:
                    args = ["--variant", variant, "--steps", a.steps, "--warmup", a.warmup,
                            *shlex.split(a.worker_args)]
                    t0 = time.time()
                    row = {"rate": format_rate(cluster.rate_bps), "variant": variant}
                    try:
                        results = run_ranks(a.worker, a.ranks_per_node * NUM_NODES,
                                            launcher=a.launcher, args=args,
                                            timeout=a.timeout, cluster=cluster)
                        reason = did_not_run([r.report for r in results])
                        if reason is not None:
                            row.update(error=reason, did_not_run=True)
                            print(f"# {rate} {variant}: did not run: {reason}",
                                  file=sys.stderr)
                        else:
                            row.update(summarize([r.report for r in results],
                                                 cluster.rate_bps))
                    except Exception as exc:  # one failing run must not lose the others
                        row["error"] = f"{type(exc).__name__}: {exc}"
                        print(row["error"][-3000:], file=sys.stderr)
                    rows.append(row)
                    print(f"# {rate} {variant}: done in {time.time() - t0:.1f} s",
                          file=sys.stderr, flush=True)
    except ClusterError as exc:
        print(f"bench/cluster.py: {exc}", file=sys.stderr)
        return 2

    table = markdown(rows)
    result = {
        "benchmark": "emulated two-node cluster",
        "worker": os.path.relpath(a.worker, REPO),
        "worker_args": a.worker_args,
        "nodes": NUM_NODES, "ranks_per_node": a.ranks_per_node, "launcher": a.launcher,
        "steps": a.steps, "warmup": a.warmup, "delay": a.delay,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "kernel": platform.release()},
        "wall_s": round(time.time() - started, 1),
        "rows": rows,
    }
    print(table)
    print()
    plots.finish(a, "cluster", result, meta)
    # a peer that reported it cannot run here is a row of the table, not a failure
    return 1 if any("error" in r and not r.get("did_not_run") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
