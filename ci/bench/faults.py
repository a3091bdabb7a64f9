"""What a lost rank costs: the demo GPT under torchrun's elastic agent, one rank SIGKILLed.

    python ci/bench/faults.py [--model small] [--steps 60] [--interval 20] [--kill-at 50]

For each way of saving (synchronous, asynchronous) it runs examples/train_gpt.py on 2
ranks (gloo) with ``--save-dir`` / ``--save-interval`` (``checkpoint.resume`` does the
restart), kills rank 1 when rank 0 has logged step ``--kill-at``, and measures: the step
the restart resumed from, the steps redone, the recovery time (from the kill to the first
step of the restarted job: the agent noticing, new processes, imports, initialize, the
resume load, that step), and the whole run against an uninterrupted run of the same
command. The load average is printed before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..")
sys.path.insert(0, REPO)

from zero_core.testing.elastic import kill, kill_tree, read_json_lines, start_elastic  # noqa: E402
from zero_core.testing.ranks import free_port  # noqa: E402

DEMO = os.path.join(REPO, "examples", "train_gpt.py")


def run(a, work: str, mode: str | None) -> dict:
    """One elastic run of the demo; *mode* "sync"/"async" kills a rank, None does not."""
    save_dir, log = os.path.join(work, "ck"), os.path.join(work, "steps.jsonl")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    args = ["--model", a.model, "--steps", str(a.steps), "--comm", "gloo", "--quiet",
            "--val-sequences", "4", "--save-dir", save_dir, "--save-interval", str(a.interval),
            "--step-log", log] + (["--async-save"] if mode == "async" else [])
    t0 = time.monotonic()
    job = start_elastic(DEMO, args, os.path.join(work, "out"), free_port())
    killed = None
    try:
        while job.poll() is None:
            time.sleep(0.01)
            lines = read_json_lines(log)
            if mode and killed is None and lines and lines[-1]["step"] >= a.kill_at:
                victims = [p for p in _workers(job.pid) if p != lines[-1]["pid"]]
                kill(victims[:1])
                killed = {"time": time.time(), "step": lines[-1]["step"]}
        rc = job.wait()
    finally:
        kill_tree(job.pid)
    total = time.monotonic() - t0
    if rc != 0:
        with open(os.path.join(work, "out")) as fh:
            raise SystemExit(f"the {mode or 'uninterrupted'} run failed:\n{fh.read()[-3000:]}")
    out = {"mode": mode or "none", "total_s": total}
    if killed:
        lines = read_json_lines(log)
        after = [x for x in lines if x["time"] > killed["time"]]
        resumed = after[0]["step"] - 1
        out.update(killed_at=killed["step"], resumed_from=resumed,
                   redone=killed["step"] - resumed,
                   recovery_s=after[0]["time"] - killed["time"])
    return out


def _workers(agent: int) -> list[int]:
    """The agent's worker processes (its children)."""
    from zero_core.testing.elastic import process_tree
    tree = process_tree(agent)
    return [p for p in tree if p != agent]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--interval", type=int, default=20)
    ap.add_argument("--kill-at", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="zc-faults-")
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    base = run(a, os.path.join(work, "none"), None)
    rows = [run(a, os.path.join(work, m), m) for m in ("sync", "async")]
    print(f"load after: {os.getloadavg()[0]:.2f}")
    step_s = base["total_s"] / a.steps  # whole-run seconds per step, start-up included
    print(f"\nuninterrupted: {base['total_s']:.1f} s for {a.steps} steps "
          f"(model {a.model}, 2 ranks, save every {a.interval} steps)\n")
    print("| saves | killed at step | resumed from | steps redone | recovery s | "
          "run s (vs uninterrupted) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['killed_at']} | {r['resumed_from']} | {r['redone']} | "
              f"{r['recovery_s']:.1f} | {r['total_s']:.1f} ({r['total_s'] / base['total_s']:.2f}x) |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"uninterrupted": base, "runs": rows, "step_s": step_s}, fh, indent=1)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
