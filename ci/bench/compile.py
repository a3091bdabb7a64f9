"""torch.compile on the CPU: compiled against eager, zero-core against FSDP2 + compile,
fp32 and bf16, side by side in one run (2 ranks, gloo, the demo GPT).

    python ci/bench/compile.py [--model small] [--steps 8] [--json docs/images/compile.json]

Each variant is a fresh 2-rank launch of ci/bench/workers/compile_step.py; the table shows
the median measured step in ms, each compiled variant's ratio to its own eager run, and
the warm-up (the first steps, where compilation happens). The load average is printed
before and after, as every benchmark here does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from zero_core.testing.ranks import run_ranks  # noqa: E402

WORKER = os.path.join(HERE, "workers", "compile_step.py")
IMPLS = (("zc2", "zero-core stage 2"), ("zc3", "zero-core stage 3"), ("fsdp2", "FSDP2"))


def run(impl: str, dtype: str, compiled: bool, a) -> dict:
    args = ["--impl", impl, "--dtype", dtype, "--compile", str(int(compiled)),
            "--model", a.model, "--steps", str(a.steps), "--micro", str(a.micro)]
    res = run_ranks(WORKER, 2, "torchrun", args=args, env={"ZERO_CORE_COMM": "gloo",
                                                           "ZERO_CORE_QUIET": "1"},
                    timeout=1800)
    rep = res[0].report
    rep["median_ms"] = 1000 * statistics.median(rep["step_times_s"])
    return rep


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for dtype in ("fp32", "bf16"):
        for impl, label in IMPLS:
            eager = run(impl, dtype, False, a)
            comp = run(impl, dtype, True, a)
            rows.append({"impl": label, "dtype": dtype, "eager_ms": eager["median_ms"],
                         "compiled_ms": comp["median_ms"],
                         "ratio": comp["median_ms"] / eager["median_ms"],
                         "warmup_s": comp["warmup_s"], "eager_warmup_s": eager["warmup_s"],
                         "graph_breaks": comp.get("compile", {}).get("graph_breaks")})
            print(f"{label} {dtype}: eager {eager['median_ms']:.1f} ms, compiled "
                  f"{comp['median_ms']:.1f} ms", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print("\n| implementation | dtype | eager ms | compiled ms | compiled / eager | "
          "compile warm-up s | graph breaks |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        gb = "" if r["graph_breaks"] is None else r["graph_breaks"]
        print(f"| {r['impl']} | {r['dtype']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
              f"{r['ratio']:.2f} | {r['warmup_s']:.0f} | {gb} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "micro": a.micro, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
