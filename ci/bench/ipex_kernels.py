"""IPEX's fused CPU Adam against zero-core's cpu kernel set and DeepSpeedCPUAdam.

Run in an environment with torch 2.8 and intel-extension-for-pytorch 2.8 (ci/torch_range.sh's
``ipex`` leg builds one)::

    python ci/bench/ipex_kernels.py              # 16M-element fp32 partition
    python ci/bench/ipex_kernels.py --n 50000000 --reps 9

What is compared, on one flat fp32 partition, step by step, interleaved (so that other jobs
on a shared machine slow all of them alike):

* Adam with L2 weight decay: zero-core's ``optim_cpu.adam_step(adamw=False)`` (torch's fused
  CPU op) against IPEX's ``torch.ops.torch_ipex.adam_fused_step`` (the op behind
  ``ipex.optim`` and ``ipex.optimize``; IPEX 2.8's CPU build has no AdamW op);
* AdamW: zero-core's ``adam_step(adamw=True)`` against DeepSpeedCPUAdam (adamw_mode, in a
  child process: ci/bench/kernels.py's ``deepspeed_cpu_adam_row``).

Before timing, three steps of each Adam are checked against a float64 evaluation of the same
recurrence on the same inputs. Best and median of --reps runs are printed, with the
bandwidth of the 28 bytes per element an Adam step must move, and the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels  # noqa: E402  (the DeepSpeedCPUAdam child process)
from zero_core.accel_kernels import optim_cpu  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def reference64(p, g, m, v, step, adamw):
    """One Adam/AdamW step in float64 (torch.optim's formulas), in place."""
    h = HYPER
    if adamw:
        p.mul_(1 - h["lr"] * h["weight_decay"])
    else:
        g = g + h["weight_decay"] * p
    m.mul_(h["beta1"]).add_(g, alpha=1 - h["beta1"])
    v.mul_(h["beta2"]).addcmul_(g, g, value=1 - h["beta2"])
    denom = (v / (1 - h["beta2"] ** step)).sqrt_().add_(h["eps"])
    p.addcdiv_(m, denom, value=-h["lr"] / (1 - h["beta1"] ** step))


def zero_core_adam(adamw):
    def step(p, g, m, v, t):
        optim_cpu.adam_step(p, g, m, v, step=t, adamw=adamw, **HYPER)
    return step


def ipex_adam(p, g, m, v, t):
    empty = torch.Tensor()
    h = HYPER
    torch.ops.torch_ipex.adam_fused_step(p, m, v, empty, g, empty, False, float(t), h["beta1"],
                                         h["beta2"], h["lr"], h["weight_decay"], h["eps"])


def check(name, fn, adamw, n=100_000):
    torch.manual_seed(1)
    bufs = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
    ref = [b.double() for b in bufs]
    for t in (1, 2, 3):
        bufs[1], ref[1] = torch.randn(n), None
        ref[1] = bufs[1].double()
        fn(*bufs, t)
        reference64(*ref, t, adamw)
    err = float((bufs[0].double() - ref[0]).abs().max())
    print(f"{name}: max |p - float64 reference| after 3 steps = {err:.2e}")
    if err > 1e-6:
        raise SystemExit(f"{name} disagrees with the float64 reference")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16_000_000)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import intel_extension_for_pytorch as ipex
    print(f"torch {torch.__version__}, IPEX {ipex.__version__} (import {time.perf_counter() - t0:.1f} s), "
          f"{torch.get_num_threads()} threads, n = {args.n:,}")
    check("zero-core cpu Adam", zero_core_adam(False), False)
    check("IPEX adam_fused_step", ipex_adam, False)
    check("zero-core cpu AdamW", zero_core_adam(True), True)
    contenders = {"Adam (L2), zero-core cpu (torch fused)": zero_core_adam(False),
                  "Adam (L2), IPEX adam_fused_step": ipex_adam,
                  "AdamW, zero-core cpu (torch fused)": zero_core_adam(True)}
    n = args.n
    bufs = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
    times = {k: [] for k in contenders}
    for rep in range(args.reps + 1):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn(*bufs, rep + 1)
            if rep:  # the first round is the warm-up
                times[name].append(time.perf_counter() - start)
    print("\n| step | best ms | median ms | GB/s (28 B/element) |\n|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts) * 1e3:.1f} | {statistics.median(ts) * 1e3:.1f} | "
              f"{28 * n / min(ts) / 1e9:.1f} |")
    row, why = kernels.deepspeed_cpu_adam_row(n, args.reps)
    if row:
        print(f"| AdamW, {row['optimizer']} | {row['best_ms']:.1f} | {row['median_ms']:.1f} | "
              f"{28 * n / row['best_ms'] / 1e6:.1f} |")
    else:
        print(why)
    print(f"\nload average during the run: {os.getloadavg()[0]:.1f} (cores: {os.cpu_count()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
