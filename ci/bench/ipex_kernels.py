"""The ipex kernel set against zero-core's cpu kernel set and DeepSpeedCPUAdam, one table.

Run in an environment with torch 2.8 and intel-extension-for-pytorch 2.8 (ci/torch_range.sh's
``ipex`` leg builds one; here /tmp/venv_t280)::

    python ci/bench/ipex_kernels.py                          # 16M elements, 3 rounds
    python ci/bench/ipex_kernels.py --n 50000000 --rounds 5 --reps 5

What is timed, on one flat fp32 partition, as the engine calls the kernels:

* zero-core's ``cpu`` set (``optim_cpu``: torch's fused ops) and ``ipex`` set (``optim_ipex``:
  IPEX's fused ops, see its docstring), in this process, interleaved step by step;
* DeepSpeedCPUAdam (DeepSpeed's own AVX kernel) in a child process of another environment
  (``--ds-python``, default /tmp/dsvenv/bin/python; DeepSpeed 0.19.8 on torch 2.13 there,
  ``DS_ACCELERATOR=cpu``); the child runs between the rounds of this process, so load changes
  reach both alike;
* four updates: Adam with L2 decay, AdamW, Adam (L2) writing a bf16 copy of the parameters
  (``param_lowp``; DeepSpeed: its step then ``copy_`` into a bf16 tensor, as its step has no
  low-precision output), and SGD with momentum (no DeepSpeed CPU SGD exists);
* for reference only, IPEX's one-pass bf16 path: ``adam_fused_step`` with a bf16 *gradient*
  writes the bf16 copy in the same pass. The kernel interface has fp32 gradients (the op
  ignores the copy then), so no kernel set can use it; the row shows what it would save.

Before timing every contender's parameters after 3 steps are compared with a float64
evaluation (and the bf16 copy with the nearest-even rounding of the fp32 result). Printed:
best and median ms over all rounds x reps, the ratio to the cpu set's (>1: slower), and the
load average at the start and end (``uptime``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SGD = dict(lr=0.01, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False)
UPDATES = ("Adam (L2)", "AdamW", "Adam (L2) + bf16 copy", "SGD momentum")


# ---- float64 references -------------------------------------------------------------------
def adam64(p, g, m, v, step, adamw):
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


def sgd64(p, g, buf, step):
    d = g + SGD["weight_decay"] * p
    if step == 1:
        buf.copy_(d)
    else:
        buf.mul_(SGD["momentum"]).add_(d)
    p.sub_(SGD["lr"] * buf)


# ---- contenders in this process -----------------------------------------------------------
def contenders():
    """{(update, who): step(bufs, t)} for zero-core's sets and IPEX's one-pass bf16 path."""
    from zero_core.accel_kernels import optim_cpu, optim_ipex

    def adam(mod, adamw, lowp=False):
        def step(b, t):
            mod.adam_step(b["p"], b["g"], b["m"], b["v"], step=t, adamw=adamw,
                          param_lowp=b["lowp"] if lowp else None, **HYPER)
        return step

    def sgd(mod):
        def step(b, t):
            mod.sgd_step(b["p"], b["g"], b["buf"], first_step=t == 1, **SGD)
        return step

    def ipex_bf16_grad(b, t):
        h = HYPER
        torch.ops.torch_ipex.adam_fused_step(b["p"], b["m"], b["v"], torch.empty(0), b["g16"],
                                             b["lowp"], False, float(t), h["beta1"], h["beta2"],
                                             h["lr"], h["weight_decay"], h["eps"])

    out = {}
    for who, mod in (("zero-core cpu", optim_cpu), ("zero-core ipex", optim_ipex)):
        out[("Adam (L2)", who)] = adam(mod, False)
        out[("AdamW", who)] = adam(mod, True)
        out[("Adam (L2) + bf16 copy", who)] = adam(mod, False, lowp=True)
        out[("SGD momentum", who)] = sgd(mod)
    out[("Adam (L2) + bf16 copy", "IPEX one-pass, bf16 grad (not the interface)")] = ipex_bf16_grad
    return out


def buffers(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b = {"p": torch.randn(n, generator=gen), "g": torch.randn(n, generator=gen),
         "m": torch.zeros(n), "v": torch.zeros(n), "buf": torch.zeros(n),
         "lowp": torch.zeros(n, dtype=torch.bfloat16)}
    b["g16"] = b["g"].bfloat16()
    return b


def check(fns, n=100_003):
    """Every contender against float64 after 3 steps; returns {key: max abs error}."""
    errs = {}
    for (update, who), fn in fns.items():
        b = buffers(n, seed=7)
        ref = {k: v.double() for k, v in b.items() if k in ("p", "m", "v", "buf")}
        for t in (1, 2, 3):
            g = b["g16"].float() if "bf16 grad" in who else b["g"]
            fn(b, t)
            if update.startswith("SGD"):
                sgd64(ref["p"], g.double(), ref["buf"], t)
            else:
                adam64(ref["p"], g.double(), ref["m"], ref["v"], t, update == "AdamW")
        err = float((b["p"].double() - ref["p"]).abs().max())
        if "bf16 copy" in update and not torch.equal(b["lowp"], b["p"].bfloat16()):
            raise SystemExit(f"{who}, {update}: the bf16 copy is not the rounded parameter")
        if err > 1e-6:
            raise SystemExit(f"{who}, {update}: differs from float64 by {err:.2e}")
        errs[(update, who)] = err
    return errs


def time_round(fns, b, reps, times, t0):
    """reps interleaved steps of every contender; appends seconds to times[key]."""
    for rep in range(reps):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn(b, t0 + rep)
            times.setdefault(key, []).append(time.perf_counter() - start)


# ---- DeepSpeedCPUAdam child -----------------------------------------------------------------
def ds_child(n: int, reps: int, threads: int) -> None:
    """Runs in DeepSpeed's environment: prints one JSON line of step times per update."""
    torch.set_num_threads(threads)
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    def make(adamw, size, seed):
        gen = torch.Generator().manual_seed(seed)
        p = torch.nn.Parameter(torch.randn(size, generator=gen))
        p.grad = torch.randn(size, generator=gen)
        opt = DeepSpeedCPUAdam([p], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                               eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                               adamw_mode=adamw)
        return p, opt

    errs = {}
    for update, adamw in (("Adam (L2)", False), ("AdamW", True)):
        p, opt = make(adamw, 100_003, 7)
        ref = [p.detach().double(), p.grad.double(), torch.zeros(p.numel(), dtype=torch.float64),
               torch.zeros(p.numel(), dtype=torch.float64)]
        for t in (1, 2, 3):
            opt.step()
            adam64(ref[0], ref[1], ref[2], ref[3], t, adamw)
        errs[update] = float((p.detach().double() - ref[0]).abs().max())
    times = {}
    for update, adamw, lowp in (("Adam (L2)", False, False), ("AdamW", True, False),
                                ("Adam (L2) + bf16 copy", False, True)):
        p, opt = make(adamw, n, 0)
        copy = torch.zeros(n, dtype=torch.bfloat16)
        opt.step()  # warm-up (state allocation)
        for _ in range(reps):
            start = time.perf_counter()
            opt.step()
            if lowp:
                copy.copy_(p.detach())
            times.setdefault(update, []).append(time.perf_counter() - start)
        del p, opt
    print(json.dumps({"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                      "errs": errs, "times": times}))


def run_ds_child(python, n, reps, threads):
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.abspath(__file__)),
                                                    env.get("PYTHONPATH")) if p)
    proc = subprocess.run([python, os.path.abspath(__file__), "--ds-child", str(n), str(reps),
                           str(threads)], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"DeepSpeedCPUAdam child failed in {python}: {tail}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


# ---- main ---------------------------------------------------------------------------------
def _err(errs, update, who) -> str:
    """The float64 check's error of a row ("as Adam (L2)" for DeepSpeed's step + copy)."""
    if (update, who) in errs:
        return f"{errs[(update, who)]:.1e}"
    base = update.replace(" + bf16 copy", "")
    return f"{errs[(base, who)]:.1e} (as {base})" if (base, who) in errs else "-"


def load() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16_000_000, help="elements (default 16M)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each this process then "
                    "DeepSpeed's child (default 3)")
    ap.add_argument("--reps", type=int, default=5, help="steps per contender per round")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads here and in the child (default: torch's)")
    ap.add_argument("--ds-python", default="/tmp/dsvenv/bin/python",
                    help="python of an environment with DeepSpeed ('' skips it)")
    ap.add_argument("--ds-child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ds_child:
        ds_child(*args.ds_child)
        return 0
    load_start = load()
    t0 = time.perf_counter()
    import intel_extension_for_pytorch as ipex
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, IPEX {ipex.__version__} (import "
          f"{time.perf_counter() - t0:.1f} s), {threads} threads, n = {args.n:,}, "
          f"{args.rounds} rounds x {args.reps} steps, load at start {load_start}")
    fns = contenders()
    errs = check(fns)
    from zero_core.accel_kernels import optim_ipex
    print(f"optim_ipex paths: {optim_ipex.status()}")
    b = buffers(args.n)
    time_round(fns, b, 1, {}, 1)  # warm-up
    times: dict = {}
    ds_info, ds_why = None, "skipped (--ds-python '')"
    for r in range(args.rounds):
        time_round(fns, b, args.reps, times, 2 + r * args.reps)
        if args.ds_python:
            res, ds_why = run_ds_child(args.ds_python, args.n, args.reps, threads)
            if res is not None:
                ds_info = res
                for update, ts in res["times"].items():
                    times.setdefault((update, f"DeepSpeedCPUAdam {res['deepspeed']}"), []).extend(ts)
                for update, err in res["errs"].items():
                    errs[(update, f"DeepSpeedCPUAdam {res['deepspeed']}")] = err
    load_end = load()
    print("\n| update | kernels | best ms | median ms | best / cpu set | median / cpu set | "
          "max err vs float64 (3 steps) |\n|---|---|---:|---:|---:|---:|---:|")
    for update in UPDATES:
        base = times[(update, "zero-core cpu")]
        for (u, who), ts in times.items():
            if u != update:
                continue
            print(f"| {update} | {who} | {min(ts) * 1e3:.1f} | {statistics.median(ts) * 1e3:.1f} | "
                  f"{min(ts) / min(base):.2f} | {statistics.median(ts) / statistics.median(base):.2f}"
                  f" | {_err(errs, u, who)} |")
    if ds_info is None:
        print(f"\n{ds_why}")
    else:
        print(f"\nDeepSpeed {ds_info['deepspeed']} on torch {ds_info['torch']} ({args.ds_python})")
    print(f"load average (1, 5, 15 min): start {load_start}, end {load_end}; "
          f"{os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
