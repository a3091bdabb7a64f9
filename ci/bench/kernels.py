"""CPU kernel benchmark: quantization and optimizer kernels against this machine's memory
bandwidth, and the optimizer step against torch's and DeepSpeed's CPU optimizers.

    python ci/bench/kernels.py                    # 50M-element optimizer, 50M quantization
    python ci/bench/kernels.py --quick            # small sizes, a smoke run
    python ci/bench/kernels.py --quant-only       # copy and quantization kernels only
    python ci/bench/kernels.py --json out.json

Bandwidth is the bytes a kernel must read plus the bytes it must write (no cache-line
write-allocate traffic), divided by the best time of several runs after a warm-up; the
same is measured for a torch fp32 copy in the same run, so "% of copy" compares each
kernel with what this machine's memory system gives a trivial streaming op. Best-of-N is
reported because other jobs share the CPU and only ever make a run slower; the median is
in the JSON. Quantization is timed twice: writing fresh output tensors (whose pages the
OS must fault in on first touch) and writing into reused buffers (``out=``), which is how
a training loop with constant-size communication buffers calls it. quant_cpu is timed on
both of its paths: "cpu native" (the C library compiled when zero-core is installed; the
header line says which instruction-set level runs, or why the library is not used) and
"cpu torch path" (its pure-torch fallback).

Peers for the Adam step (one 50M-element fp32 partition, AdamW, bias correction):
``torch.optim.AdamW`` with ``foreach=True`` and with ``fused=True``, and DeepSpeed's
``DeepSpeedCPUAdam`` (``DS_ACCELERATOR=cpu``; it compiles its C++ op at run time), run in
a child process under this interpreter if it has deepspeed, else under the benchmark
environment ci/bench/engine.py uses ($ZERO_CORE_BENCH_PYTHON, $ZERO_CORE_BENCH_VENV,
<repo>/.bench-venv), with the same thread count; skipped with the
reason if none has it. Tables go to stdout as markdown, numbers to --json, the chart to
--plot (docs/images/kernels.png by default; see ci/bench/plots.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plots  # noqa: E402  (JSON and PNG beside the table)
from zero_core.accel_kernels import (optim_cpu, optim_reference, quant_cpu,
                                     quant_reference)


def timed(fn, reps: int, warmup: int = 1) -> dict:
    """Best and median wall time of *fn* in seconds over *reps* runs after *warmup*."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"best_s": min(times), "median_s": statistics.median(times), "reps": reps}


def row(name: str, nbytes: int, t: dict, copy_gbs: float | None) -> dict:
    gbs = nbytes / t["best_s"] / 1e9
    return {"kernel": name, "bytes": nbytes, "best_ms": t["best_s"] * 1e3,
            "median_ms": t["median_s"] * 1e3, "GB_per_s": gbs,
            "pct_of_copy": None if copy_gbs is None else 100 * gbs / copy_gbs}


def bench_copy(n: int, reps: int) -> dict:
    """fp32 copy of n elements: read 4n bytes, write 4n. Timed 3x as often as the kernels
    (it is the yardstick, so one quiet moment must be caught)."""
    src = torch.randn(n)
    dst = torch.empty(n)
    return row("torch copy fp32 (reference bandwidth)", 8 * n,
               timed(lambda: dst.copy_(src), 3 * reps), None)


def quant_paths(with_reference: bool) -> list[tuple[str, object]]:
    """(label, module-like) of the quantization kernels to time: quant_cpu's compiled C
    library when it is loaded, quant_cpu's pure-torch path (the fallback, kept so that the
    gain is visible), and the reference."""
    torch_path = SimpleNamespace(
        quantize=quant_cpu.quantize_torch, dequantize=quant_cpu.dequantize_torch,
        dequantize_reduce_requantize=quant_cpu.dequantize_reduce_requantize_torch)
    paths = [("cpu native", quant_cpu)] if quant_cpu.native_in_use() else []
    paths.append(("cpu torch path", torch_path))
    if with_reference:
        paths.append(("reference", quant_reference))
    return paths


def bench_quant(n: int, block: int, reps: int, copy_gbs: float, with_reference: bool):
    rows = []
    x = torch.randn(n)
    nblocks = -(-n // block)
    for bits in (8, 4):
        pbytes = n if bits == 8 else (n + 1) // 2
        sbytes = 4 * nblocks
        payload, scales = quant_cpu.quantize(x, bits, block)
        out = (torch.empty_like(payload), torch.empty_like(scales))
        deq_out = torch.empty(n)
        k = 4
        p2 = torch.stack([payload] * k)
        s2 = torch.stack([scales] * k)
        for label, mod in quant_paths(with_reference):
            r = max(1, reps // 3) if mod is quant_reference else reps
            rows.append(row(f"quantize int{bits} fp32->q ({label}, fresh output)",
                            4 * n + pbytes + sbytes,
                            timed(lambda: mod.quantize(x, bits, block), r), copy_gbs))
            rows.append(row(f"quantize int{bits} fp32->q ({label}, out=)",
                            4 * n + pbytes + sbytes,
                            timed(lambda: mod.quantize(x, bits, block, out=out), r), copy_gbs))
            rows.append(row(f"dequantize int{bits} q->fp32 ({label}, fresh output)",
                            pbytes + sbytes + 4 * n,
                            timed(lambda: mod.dequantize(payload, scales, bits, block, n), r),
                            copy_gbs))
            rows.append(row(f"dequantize int{bits} q->fp32 ({label}, out=)",
                            pbytes + sbytes + 4 * n,
                            timed(lambda: mod.dequantize(payload, scales, bits, block, n,
                                                         out=deq_out), r), copy_gbs))
            rows.append(row(f"dequantize-reduce-requantize int{bits}, k={k} ({label}, out=)",
                            (k + 1) * (pbytes + sbytes),
                            timed(lambda: mod.dequantize_reduce_requantize(
                                p2, s2, bits, block, n, out=out), r), copy_gbs))
    return rows


ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def bench_optim_kernels(n: int, reps: int, copy_gbs: float, with_reference: bool):
    """GB/s of the flat optimizer kernels (Adam reads p, g, m, v and writes p, m, v)."""
    rows = []
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    lowp = torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def adam(mod, lp=None):
        step[0] += 1
        mod.adam_step(p, g, m, v, step=step[0], adamw=True, param_lowp=lp, **ADAM)

    mods = [("optim_cpu", optim_cpu)] + ([("optim_reference", optim_reference)]
                                         if with_reference else [])
    for label, mod in mods:
        r = max(1, reps // 3) if mod is optim_reference else reps
        rows.append(row(f"adam_step AdamW ({label})", 28 * n, timed(lambda: adam(mod), r),
                        copy_gbs))
        rows.append(row(f"adam_step AdamW + bf16 copy ({label})", 30 * n,
                        timed(lambda: adam(mod, lowp), r), copy_gbs))
    buf = torch.zeros(n)
    rows.append(row("sgd_step momentum+nesterov (optim_cpu)", 20 * n,
                    timed(lambda: optim_cpu.sgd_step(p, g, buf, lr=0.01, momentum=0.9,
                                                     dampening=0.0, weight_decay=1e-4,
                                                     nesterov=True, first_step=False),
                          reps), copy_gbs))
    del p, g, m, v, lowp, buf
    return rows


def bench_adam_peers(n: int, reps: int) -> tuple[list, list]:
    """Step time of one AdamW step on an n-element partition: ours vs torch (vs DeepSpeed)."""
    rows, skipped = [], []

    def torch_optim(**flags):
        param = torch.nn.Parameter(torch.randn(n))
        param.grad = torch.randn(n)
        opt = torch.optim.AdamW([param], lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]),
                                eps=ADAM["eps"], weight_decay=ADAM["weight_decay"], **flags)
        return opt.step

    def ours():
        p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
        step = [0]

        def run():
            step[0] += 1
            optim_cpu.adam_step(p, g, m, v, step=step[0], adamw=True, **ADAM)
        return run

    candidates = [("zero-core optim_cpu.adam_step", ours),
                  ("torch.optim.AdamW(fused=True)", lambda: torch_optim(fused=True)),
                  ("torch.optim.AdamW(foreach=True)", lambda: torch_optim(foreach=True))]
    ds_row, ds_skip = deepspeed_cpu_adam_row(n, reps)
    if ds_skip:
        skipped.append(ds_skip)
    for name, make in candidates:
        try:
            step_fn = make()
            t = timed(step_fn, reps)
        except Exception as exc:
            skipped.append(f"{name}: failed ({type(exc).__name__}: {exc})")
            continue
        rows.append({"optimizer": name, "numel": n, "best_ms": t["best_s"] * 1e3,
                     "median_ms": t["median_s"] * 1e3})
        del step_fn
    if ds_row:
        rows.append(ds_row)
    return rows, skipped


# DeepSpeed is not a dependency of zero-core, so its CPU Adam is timed in a child process:
# this interpreter if it has deepspeed, else a separate benchmark environment (the same
# places ci/bench/engine.py looks; same torch build there). Its C++ op is compiled at run
# time on first use (cached under ~/.cache/torch_extensions).
_DS_CHILD = r"""
import json, os, statistics, sys, time
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
n, reps, lr, b1, b2, eps, wd = int(sys.argv[1]), int(sys.argv[2]), *map(float, sys.argv[3:8])
if len(sys.argv) > 8:
    torch.set_num_threads(int(sys.argv[8]))
param = torch.nn.Parameter(torch.randn(n))
param.grad = torch.randn(n)
opt = DeepSpeedCPUAdam([param], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                       adamw_mode=True)
opt.step()
times = []
for _ in range(reps):
    t0 = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - t0)
import deepspeed
print(json.dumps({"best_s": min(times), "median_s": statistics.median(times),
                  "python": sys.executable, "deepspeed": deepspeed.__version__,
                  "torch": torch.__version__, "threads": torch.get_num_threads()}))
"""


def _bench_pythons() -> list[str]:
    """This Python, then the benchmark environment's (engine.find_bench_python)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import engine as bench_engine
    other = bench_engine.find_bench_python()
    return [sys.executable] + ([other] if other and other != sys.executable else [])


def deepspeed_cpu_adam_row(n: int, reps: int):
    """(row, None) with DeepSpeedCPUAdam's AdamW step time, or (None, why it was skipped)."""
    import subprocess
    tried = []
    for python in _bench_pythons():
        probe = subprocess.run([python, "-c", "import deepspeed"], capture_output=True,
                               text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
        if probe.returncode:
            tried.append(python)
            continue
        args = [str(n), str(reps), *(str(ADAM[k]) for k in ("lr", "beta1", "beta2", "eps",
                                                            "weight_decay")),
                str(torch.get_num_threads())]
        proc = subprocess.run([python, "-c", _DS_CHILD, *args], capture_output=True, text=True,
                              env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=1800)
        if proc.returncode:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            return None, f"DeepSpeedCPUAdam: failed in {python} ({tail})"
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        name = f"DeepSpeedCPUAdam (adamw_mode, deepspeed {res['deepspeed']}, child process)"
        return {"optimizer": name, "numel": n, "best_ms": res["best_s"] * 1e3,
                "median_ms": res["median_s"] * 1e3, "python": res["python"]}, None
    return None, (f"DeepSpeedCPUAdam: skipped, deepspeed is not importable in "
                  f"{', '.join(tried)}; create a benchmark environment with "
                  f"`python ci/bench/engine.py --setup-bench-venv`")


def markdown(rows: list, cols: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in cols:
            val = r.get(key)
            cells.append("-" if val is None else format(val, fmt))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=50_000_000,
                    help="elements of the optimizer partition (default 50M)")
    ap.add_argument("--quant-numel", type=int, default=50_000_000,
                    help="elements quantized (default 50M)")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the (slow) pure-torch reference kernels")
    ap.add_argument("--quick", action="store_true", help="1M elements, 3 repetitions")
    ap.add_argument("--quant-only", action="store_true",
                    help="only the copy yardstick and the quantization kernels")
    plots.add_arguments(ap, "kernels")
    args = ap.parse_args(argv)
    meta = plots.start(args, "kernels", __file__, sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.numel = args.quant_numel = 1_000_000
        args.reps = 3
    if args.threads:
        torch.set_num_threads(args.threads)
    with_ref = not args.no_reference

    copy_n = max(args.numel, args.quant_numel)
    copy = bench_copy(copy_n, args.reps)
    copy_gbs = copy["GB_per_s"]
    quant = bench_quant(args.quant_numel, args.block_size, args.reps, copy_gbs, with_ref)
    if args.quant_only:
        optim, peers, skipped = [], [], []
    else:
        optim = bench_optim_kernels(args.numel, args.reps, copy_gbs, with_ref)
        peers, skipped = bench_adam_peers(args.numel, args.reps)
    again = bench_copy(copy_n, args.reps)  # the machine may have been busier at the start
    if again["GB_per_s"] > copy_gbs:
        copy, copy_gbs = again, again["GB_per_s"]
        for r in quant + optim:
            r["pct_of_copy"] = 100 * r["GB_per_s"] / copy_gbs

    host = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_avg_at_end": os.getloadavg(), **quant_cpu.backend_info()}
    print(f"# CPU kernels — torch {host['torch']}, {host['threads']} threads, "
          f"load average at end {host['load_avg_at_end'][0]:.1f}\n")
    print(f"Quantization: {args.quant_numel:,} fp32 elements, block {args.block_size}; "
          f"optimizer kernels: {args.numel:,} elements. Best of {args.reps}.\n")
    print(f"quant_cpu: {host['quantize_path']}"
          + (f" — native library not used: {host['quantize_native_missing']}"
             if "quantize_native_missing" in host else "") + "\n")
    cols = [("kernel", "kernel", "s"), ("best_ms", "best ms", ".2f"),
            ("median_ms", "median ms", ".2f"), ("GB_per_s", "GB/s", ".1f"),
            ("pct_of_copy", "% of copy", ".0f")]
    print(markdown([copy] + quant + optim, cols))
    if peers:
        print(f"\nAdamW step on one {args.numel:,}-element fp32 partition:\n")
        print(markdown(peers, [("optimizer", "optimizer", "s"), ("best_ms", "best ms", ".1f"),
                               ("median_ms", "median ms", ".1f")]))
    for line in skipped:
        print(f"\n- {line}")
    result = {"host": host, "args": vars(args), "copy": copy, "quantization": quant,
              "optimizer_kernels": optim, "adam_step_peers": peers, "skipped": skipped}
    print()
    plots.finish(args, "kernels", result, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
