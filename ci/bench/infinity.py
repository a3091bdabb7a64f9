#!/usr/bin/env python
"""ZeRO-Infinity at this machine's physical limit: the largest GPT that trains on 2 ranks
with parameters, fp32 master weights and Adam states on disk.

    python ci/bench/infinity.py                       # 20x4096 (4.03 B), 3 steps, both peers
    python ci/bench/infinity.py --layers 2 --width 512 --steps 2   # a quick smoke run
    python ci/bench/infinity.py --contenders zero_core --json out.json
    python ci/bench/infinity.py --replot docs/images/infinity.json   # redraw the chart only

What one run does, in this order:

1. ``df`` of ``--nvme-dir``: the disk space free, and the largest model it holds at 14
   bytes per parameter (bf16 parameter 2 + fp32 master 4 + Adam moments 8); the model
   must need no more than ``--max-disk-fraction`` of it (refused otherwise, before any
   work);
2. the disk's own sequential bandwidth, with ``dd`` and direct I/O (``oflag=direct`` /
   ``iflag=direct``, 16 MiB blocks, ``--dd-gib`` GiB) in the same directory, before and
   after the training (the slower of the two is the reference);
3. each contender trains ``--steps`` steps (ci/bench/workers/infinity_rank.py): bf16
   compute, fp32 master and AdamW states, offload_param + offload_optimizer to nvme,
   activation checkpointing per block, one fetch unit per block;
4. a table: per step, wall time and its split (forward, backward, optimizer step; for
   zero-core also the disk's busy time reading and writing and the training thread's
   stalls on the disk), bytes read and written against the formula, the bandwidth the
   offload achieved as a fraction of the disk's, and peak resident memory per rank;
   every number also goes to --json and a chart to --plot (default
   docs/images/infinity.json and .png; ci/bench/plots.py).

The formula, per rank and step (Ψ parameters, N ranks): the optimizer reads and writes
its fp32 master and two moments, 12Ψ/N each way; the parameters (bf16) are read once per
fetch — forward, then the checkpointed block's recompute, whose unit backward reuses
(``stage3_max_reuse_distance`` = one block) — 2 × 2Ψ/N, and written once after the step,
2Ψ/N.

"Achieved bandwidth" = (bytes read / dd read rate + bytes written / dd write rate) / step
time: the share of the step the disk would need at its own sequential speed to move what
the step moved; 1.0 is a step that is all disk at full speed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import engine as be  # noqa: E402  (the deepspeed environment)
from offload import approx_params  # noqa: E402  (examples/gpt.py's parameter count)
import plots  # noqa: E402  (JSON and PNG beside the table)
from zero_core.testing.ranks import run_ranks  # noqa: E402

WORKER = os.path.join(HERE, "workers", "infinity_rank.py")
GIB = 1 << 30
BYTES_PER_PARAM = 14   # bf16 parameter + fp32 master + two fp32 Adam moments
RANKS = 2


def dd_bandwidth(directory: str, gib: float) -> dict:
    """Sequential write then read of *gib* GiB with O_DIRECT, 16 MiB blocks (bytes/s)."""
    path = os.path.join(directory, "dd_probe.bin")
    count = max(1, int(gib * 64))
    out = {}
    try:
        for key, cmd in (("write", ["dd", "if=/dev/zero", f"of={path}", "bs=16M",
                                    f"count={count}", "oflag=direct", "conv=fsync"]),
                         ("read", ["dd", f"if={path}", "of=/dev/null", "bs=16M",
                                   "iflag=direct"])):
            t = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            out[key] = count * 16 * (1 << 20) / (time.perf_counter() - t)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return out


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_contender(name: str, args, nvme_dir: str) -> dict:
    settings = {"contender": name, "layers": args.layers, "width": args.width,
                "seq": args.seq, "micro": args.micro, "steps": args.steps,
                "nvme_dir": nvme_dir, "sub_group_size": args.sub_group_size,
                "buffer_count": args.buffer_count,
                "rss_limit": int(args.budget_gib * GIB / RANKS),
                "min_available": int(args.min_available_gib * GIB)}
    os.makedirs(nvme_dir, exist_ok=True)
    env = {"ZERO_CORE_COMM": "gloo", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    if name == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    t = time.perf_counter()
    load_before = load_average()
    try:
        results = run_ranks(WORKER, RANKS, "torchrun", args=[json.dumps(settings)], env=env,
                            timeout=args.timeout, check=False)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    reports = [r.report for r in results]
    row = {"contender": name, "wall_s": time.perf_counter() - t,
           "load_before": load_before, "load_after": load_average()}
    if not all(r is not None and r.get("ok") for r in reports):
        whys = sorted({(r or {}).get("why") or f"exit {res.returncode}"
                       for r, res in zip(reports, results)})
        row.update(ok=False, why="; ".join(whys), log_tail=results[0].log[-3000:])
        return row
    row.update(ok=True, reports=reports)
    return row


def summarize(reports: list, dd: dict) -> dict:
    """Per step, over both ranks: the slowest rank's times, the sum of bytes; *dd*: the
    disk's reference bandwidths (bytes/s)."""
    psi = reports[0]["num_parameters"]
    steps = []
    for i in range(len(reports[0]["steps"])):
        per = [r["steps"][i] for r in reports]
        st = {k: max(p[k] for p in per) for k in ("forward_s", "backward_s", "step_s", "wall_s")}
        st["loss"] = per[0]["loss"]
        # what reached the disk, both ranks (/proc/self/io: either contender)
        st["proc_read"] = sum(p["proc_io"]["read"] for p in per)
        st["proc_written"] = sum(p["proc_io"]["written"] for p in per)
        st["proc_achieved"] = (st["proc_read"] / dd["read"]
                               + st["proc_written"] / dd["write"]) / st["wall_s"]
        ios = [p["io"] for p in per]
        if all(io is not None for io in ios):
            tot = {k: sum(io[k] for io in ios) for k in ios[0]}
            read = tot["opt_read"] + tot["param_read"]
            written = tot["opt_written"] + tot["param_written"]
            disk_need = read / dd["read"] + written / dd["write"]
            st.update(io=tot, read_bytes=read, written_bytes=written,
                      achieved=disk_need / st["wall_s"],
                      # the rank's own view: its kernel I/O time and its stalls (max over ranks)
                      read_s=max(io["read_s"] for io in ios),
                      write_s=max(io["write_s"] for io in ios),
                      stall_s=max(io["wait_s"] for io in ios))
            st["compute_s"] = st["wall_s"] - st["stall_s"]
        steps.append(st)
    formula = {"opt_each_way": 12 * psi, "param_read": 2 * 2 * psi, "param_written": 2 * psi}
    return {"num_parameters": psi, "build_s": max(r["build_s"] for r in reports),
            "config": reports[0]["config"],
            "peak_rss_gib": [r["peak_rss"] / GIB for r in reports],
            "rss_after_build_gib": [r["rss_after_build"] / GIB for r in reports],
            "disk_bytes": sum(r.get("disk_bytes", 0) for r in reports),
            "host_store_bytes": [r.get("host_bytes") for r in reports],
            "steps": steps, "formula_all_ranks": formula}


def markdown(rows, dd_before, dd_after) -> str:
    out = [f"disk (dd, O_DIRECT, 16 MiB blocks): write {dd_before['write'] / 1e6:.0f} / "
           f"{dd_after['write'] / 1e6:.0f} MB/s, read {dd_before['read'] / 1e6:.0f} / "
           f"{dd_after['read'] / 1e6:.0f} MB/s (before / after)", "",
           "| contender | params | step | wall s | fwd / bwd / opt s | disk read s | "
           "disk write s | stalls s | read GB (formula) | written GB (formula) | "
           "achieved / disk | block-device read / written GB, achieved | peak RSS/rank GiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if not row["ok"]:
            out.append(f"| {row['contender']} | | | failed: {row['why'][:120]} "
                       "| | | | | | | | | |")
            continue
        s = row["summary"]
        f = s["formula_all_ranks"]
        for i, st in enumerate(s["steps"], 1):
            split = f"{st['forward_s']:.0f} / {st['backward_s']:.0f} / {st['step_s']:.0f}"
            if "io" in st:
                io = (f"{st['read_s']:.0f} | {st['write_s']:.0f} | {st['stall_s']:.0f} | "
                      f"{st['read_bytes'] / 1e9:.1f} ({(f['opt_each_way'] + f['param_read']) / 1e9:.1f}) | "
                      f"{st['written_bytes'] / 1e9:.1f} ({(f['opt_each_way'] + f['param_written']) / 1e9:.1f}) | "
                      f"{st['achieved']:.2f}")
            else:
                io = "— | — | — | — | — | —"
            proc = (f"{st['proc_read'] / 1e9:.1f} / {st['proc_written'] / 1e9:.1f}, "
                    f"{st['proc_achieved']:.2f}")
            out.append(f"| {row['contender']} | {s['num_parameters'] / 1e9:.2f} B | {i} | "
                       f"{st['wall_s']:.0f} | {split} | {io} | {proc} | "
                       f"{max(s['peak_rss_gib']):.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--contenders", default="zero_core,deepspeed")
    ap.add_argument("--nvme-dir", default="/work/infinity_swap")
    ap.add_argument("--sub-group-size", type=int, default=25_000_000,
                    help="elements per optimizer sub-group (each state slot: 4 B/element)")
    ap.add_argument("--buffer-count", type=int, default=4, help="optimizer swap slots")
    ap.add_argument("--dd-gib", type=float, default=4.0)
    ap.add_argument("--max-disk-fraction", type=float, default=0.85)
    ap.add_argument("--budget-gib", type=float, default=20.0,
                    help="resident memory of both ranks together")
    ap.add_argument("--min-available-gib", type=float, default=1.5)
    ap.add_argument("--timeout", type=float, default=3600)
    plots.add_arguments(ap, "infinity")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    meta = plots.start(args, "infinity", __file__, argv)

    os.makedirs(args.nvme_dir, exist_ok=True)
    free = shutil.disk_usage(args.nvme_dir).free
    psi = approx_params(args.layers, args.width, args.seq)
    need = BYTES_PER_PARAM * psi
    print(f"# ZeRO-Infinity bench: GPT {args.layers}x{args.width} = {psi / 1e9:.2f} B "
          f"parameters, {RANKS} ranks; disk free at {args.nvme_dir}: {free / 1e9:.1f} GB, "
          f"holds {free / BYTES_PER_PARAM / 1e9:.2f} B parameters at {BYTES_PER_PARAM} B each; "
          f"this model needs {need / 1e9:.1f} GB ({need / free:.0%} of free)", flush=True)
    if need > args.max_disk_fraction * free:
        sys.exit(f"bench/infinity.py: the model needs {need / 1e9:.1f} GB of swap, more than "
                 f"{args.max_disk_fraction:.0%} of the {free / 1e9:.1f} GB free at "
                 f"{args.nvme_dir}; pick fewer --layers / a smaller --width, or another "
                 f"--nvme-dir")
    contenders = args.contenders.split(",")
    if "deepspeed" in contenders:
        why = be.deepspeed_or_reexec(__file__, argv)
        if why:
            print(f"# deepspeed left out: {why}", flush=True)
            contenders.remove("deepspeed")
    dd_before = dd_bandwidth(args.nvme_dir, args.dd_gib)
    print(f"# dd before: {json.dumps({k: round(v / 1e6) for k, v in dd_before.items()})} MB/s",
          flush=True)
    rows = []
    for name in contenders:
        print(f"# {name}: training (load {load_average()})", flush=True)
        row = run_contender(name, args, os.path.join(args.nvme_dir, name))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("log_tail", "reports")}),
              flush=True)
        if not row["ok"]:
            print(row["log_tail"], flush=True)
    dd_after = dd_bandwidth(args.nvme_dir, args.dd_gib)
    # the slower measurement is the reference: achieved fractions are not flattered
    dd = {k: min(dd_before[k], dd_after[k]) for k in dd_before}
    for row in rows:
        if row["ok"]:
            row["summary"] = summarize(row.pop("reports"), dd)
    print(markdown(rows, dd_before, dd_after))
    print()
    plots.finish(args, "infinity", {"benchmark": "infinity", "dd_before": dd_before,
                                    "dd_after": dd_after, "rows": rows, "free_bytes": free,
                                    "params": psi, "args": vars(args)}, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
