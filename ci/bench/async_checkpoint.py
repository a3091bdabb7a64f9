"""Asynchronous checkpoints: how long a save stops training, zero-core against FSDP2 with
PyTorch DCP's ``save`` / ``async_save``, side by side in one run (2 ranks, gloo).

    python ci/bench/async_checkpoint.py [--json docs/images/async_checkpoint.json] [--quick]

Each contender is a fresh 2-rank launch of ci/bench/workers/async_checkpoint_rank.py: the demo's
bench GPT (20M parameters) at zero-core stages 2 and 3 and under FSDP2, fp32 and bf16, and
a 101M-parameter GPT with zero-core's optimizer offloaded to host memory next to FSDP2. The
table gives the normal step, the synchronous save's time (the stall it causes), the stall of
an asynchronous save (the call; the second of two saves, as periodic saving repeats: the
first one also allocates its host buffers, shown in the JSON), the ratio of the two (goal <=
10%), the slowest step while the background write runs against a normal step (goal <=
1.2x), and the time until the checkpoint is complete. Load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from zero_core.testing.ranks import run_ranks  # noqa: E402

WORKER = os.path.join(HERE, "workers", "async_checkpoint_rank.py")
CONTENDERS = [  # label, worker arguments
    ("zero-core stage 2, fp32", ["--impl", "zc", "--stage", "2", "--dtype", "fp32"]),
    ("zero-core stage 3, fp32", ["--impl", "zc", "--stage", "3", "--dtype", "fp32"]),
    ("FSDP2 + DCP, fp32", ["--impl", "fsdp2", "--dtype", "fp32"]),
    ("zero-core stage 2, bf16", ["--impl", "zc", "--stage", "2", "--dtype", "bf16"]),
    ("zero-core stage 3, bf16", ["--impl", "zc", "--stage", "3", "--dtype", "bf16"]),
    ("FSDP2 + DCP, bf16", ["--impl", "fsdp2", "--dtype", "bf16"]),
    ("zero-core stage 2, offload cpu, 101M", ["--impl", "zc", "--stage", "2", "--offload",
                                              "--model", "large"]),
    ("FSDP2 + DCP, 101M", ["--impl", "fsdp2", "--model", "large"]),
]


def run(args: list, work: str) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    res = run_ranks(WORKER, 2, "torchrun", args=args + ["--dir", work],
                    env={"ZERO_CORE_COMM": "gloo", "ZERO_CORE_QUIET": "1"}, timeout=1800)
    shutil.rmtree(work, ignore_errors=True)
    return res[0].report


def summarize(label: str, rep: dict) -> dict:
    last = rep["async"][-1]
    return {"contender": label, "step_ms": 1000 * rep["normal_step_s"],
            "sync_save_ms": 1000 * rep["sync_save_s"], "async_stall_ms": 1000 * last["call_s"],
            "first_async_stall_ms": 1000 * rep["async"][0]["call_s"],
            "stall_ratio": last["call_s"] / rep["sync_save_s"],
            "slowest_during_ratio": max(last["during_steps_s"]) / rep["normal_step_s"],
            "commit_s": last["commit_s"], "raw": rep}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="the tiny model, the first two contenders (a smoke run)")
    a = ap.parse_args()
    contenders = CONTENDERS[:3] if a.quick else CONTENDERS
    extra = ["--model", "tiny", "--steps", "2", "--saves", "1"] if a.quick else []
    work = tempfile.mkdtemp(prefix="zc-ckpt-bench-")
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for label, args in contenders:
        rows.append(summarize(label, run(args + extra, os.path.join(work, "ck"))))
        r = rows[-1]
        print(f"{label}: step {r['step_ms']:.0f} ms, sync save {r['sync_save_ms']:.0f} ms, "
              f"async stall {r['async_stall_ms']:.0f} ms", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print("\n| contender | step ms | sync save ms | async stall ms | stall / sync | "
          "slowest step while writing / step | complete after s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['contender']} | {r['step_ms']:.0f} | {r['sync_save_ms']:.0f} | "
              f"{r['async_stall_ms']:.0f} | {r['stall_ratio']:.0%} | "
              f"{r['slowest_during_ratio']:.2f}x | {r['commit_s']:.2f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
