"""The checks of the GPU kit (ci/gpu_check.py runs them; this module only defines them).

Every check is a function ``check(ctx) -> dict`` registered in :data:`CHECKS` under a
name ``group/what``. It raises on an unexpected error (the runner records a failure with
the traceback's last lines) and otherwise returns::

    {"numbers": {...},          # what was measured (JSON-serializable)
     "failures": [str, ...],    # criteria that failed (empty/absent: pass)
     "status": "skip"|"refused" # optional: not run here / the engine refused the config
     "detail": "one line"}      # optional summary for the markdown table

A check runs in a worker process of its group (``conformance``, ``kernels``, ``engine``)
on the device of ``ctx.device`` ("cuda", or "cpu" for the dry run). Workers initialize
zero-core's process-wide runtime once (accelerator ``ctx.device``, communicator nccl or
gloo, world size 1); engines are built and destroyed per check.

Comparisons and their bounds are written next to each check. The plain-torch references
run on the same device as the engine, from a copy of the same initial model, on the same
batches.
"""
from __future__ import annotations

import copy
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections import deque
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

#: launcher variables a worker must not inherit: every check runs at world size 1
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK",
               "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID", "SLURM_NTASKS", "ZERO_CORE_REPORT_DIR",
               "ZERO_CORE_ACCELERATOR", "ZERO_CORE_COMM", "ZERO_CORE_RANKS_PER_NODE")


def clean_env(extra: dict | None = None) -> dict:
    """This process's environment without launcher variables (single-process runs)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def tail(text: str, lines: int = 15) -> str:
    return "\n".join((text or "").rstrip().splitlines()[-lines:])


@dataclass
class Ctx:
    """What every check gets: device ("cuda"/"cpu"), sizes (quick), a scratch directory
    (removed by the runner), the run's seed."""

    device: str
    quick: bool
    scratch: str
    seed: int
    profile: bool = False  # bench checks add a torch.profiler summary of two more steps

    @property
    def comm(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


# ============================================================================ helpers
def _torch():
    import torch
    return torch


def runtime(ctx: Ctx):
    """zero-core's runtime on ctx.device at world size 1 (initialized on first use)."""
    from zero_core.runtime.context import init_distributed
    return init_distributed(accelerator=ctx.device, comm_backend=ctx.comm)


def synchronize(ctx: Ctx) -> None:
    if ctx.cuda:
        _torch().cuda.synchronize()


def median_seconds(ctx: Ctx, fn, reps: int, warmup: int = 2) -> float:
    """Median wall time of *fn* in seconds: CUDA events on the GPU, perf_counter on CPU."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    synchronize(ctx)
    times = []
    if ctx.cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def same_bits(a, b) -> tuple[bool, int]:
    """(equal bit for bit, number of differing elements); NaNs count as equal to NaNs
    (their payload bits are not part of the format)."""
    torch = _torch()
    a, b = a.reshape(-1).cpu(), b.reshape(-1).cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, max(a.numel(), b.numel())
    if a.is_floating_point():
        int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        differ = (a.view(int_dtype) != b.view(int_dtype)) & ~(a.isnan() & b.isnan())
    else:
        differ = a != b
    n = int(differ.sum())
    return n == 0, n


def gpt_module():
    """examples/gpt.py (the model every benchmark of the project uses)."""
    path = os.path.join(REPO, "examples")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gpt
    return gpt


def learnable_batches(count: int, micro: int, seq: int, vocab: int, seed: int):
    """*count* micro-batches (ids, targets) on the CPU: each row counts upwards mod
    *vocab* from a random start with a random stride in {1, 2, 3, 5}, so the model can
    learn it and a loss curve means something."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    strides = torch.tensor([1, 2, 3, 5])
    out = []
    for _ in range(count):
        start = torch.randint(0, vocab, (micro, 1), generator=g)
        stride = strides[torch.randint(0, 4, (micro, 1), generator=g)]
        tokens = (start + stride * torch.arange(seq + 1)) % vocab
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def release_memory(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        _torch().cuda.empty_cache()


# ============================================================================ conformance
def _conformance_numbers(rep: dict) -> tuple[dict, list]:
    results = rep.get("results", {})
    # the suite's statuses: "pass", "FAIL", "unsupported", "skip"
    failed = sorted(n for n, r in results.items() if str(r.get("status")).lower() == "fail")
    numbers = {"counts": rep.get("counts"), "comm": rep.get("comm"),
               "accelerator": rep.get("accelerator"), "world_size": rep.get("world_size"),
               "seed": rep.get("seed"), "failed": failed,
               "failed_detail": {n: results[n].get("detail", "")[:300] for n in failed[:10]},
               "unsupported": sorted(n for n, r in results.items()
                                     if r.get("status") == "unsupported"),
               "not_available": rep.get("not_available")}
    failures = [f"conformance check {n} failed: {results[n].get('detail', '')[:200]}"
                for n in failed]
    if rep.get("aborted"):
        failures.append(f"suite aborted: {rep['aborted'][:300]}")
    if rep.get("ok") is False and not failures:
        failures.append("the suite's verdict is not ok")
    return numbers, failures


def check_conformance_cli(ctx: Ctx) -> dict:
    """``python -m zero_core.conformance --comm nccl --accelerator cuda`` as a user runs it
    (one process: torch.distributed's env:// rendezvous, a TCP store on localhost that
    zero-core sets up at world size 1). The suite's own JSON report is read back."""
    report_dir = tempfile.mkdtemp(prefix="conformance_", dir=ctx.scratch)
    cmd = [sys.executable, "-m", "zero_core.conformance", "--comm", ctx.comm,
           "--accelerator", ctx.device, "--timeout", "60"]
    # cwd: not the checkout, whose zero_core/ folder would shadow the installed package
    proc = subprocess.run(cmd, env=clean_env({"ZERO_CORE_REPORT_DIR": report_dir}),
                          capture_output=True, text=True, timeout=240, cwd=ctx.scratch)
    path = os.path.join(report_dir, "rank0.json")
    numbers = {"command": " ".join(cmd[1:]), "returncode": proc.returncode}
    if not os.path.exists(path):
        return {"numbers": numbers, "failures": [
            f"the suite wrote no report (exit {proc.returncode}): "
            f"{tail(proc.stdout + proc.stderr, 12)}"]}
    with open(path) as fh:
        rep = json.load(fh)
    more, failures = _conformance_numbers(rep)
    numbers.update(more)
    if proc.returncode != 0 and not failures:
        failures.append(f"exit status {proc.returncode}: {tail(proc.stderr, 8)}")
    c = rep.get("counts") or {}
    return {"numbers": numbers, "failures": failures,
            "detail": ", ".join(f"{v} {k}" for k, v in c.items())}


def check_conformance_preinit(ctx: Ctx) -> dict:
    """The suite through its Python API after torch.distributed was initialized by the
    caller from a FileStore with one backend per device type (``cpu:gloo,cuda:nccl``):
    the communicator under test then carries its traffic on an nccl group of its own and
    the suite's control plane (CPU tensors) runs on gloo. Separates a communicator problem
    from a control-plane one when the plain CLI run fails."""
    torch = _torch()
    import torch.distributed as dist
    store_path = os.path.join(ctx.scratch, "conformance_filestore")
    if os.path.exists(store_path):
        os.remove(store_path)
    store = dist.FileStore(store_path, 1)
    backend = "cpu:gloo,cuda:nccl" if ctx.cuda else "gloo"
    if ctx.cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    from zero_core.conformance import run_conformance
    from zero_core.runtime.context import get_runtime
    rep = run_conformance(comm=ctx.comm, accelerator=ctx.device, timeout=60.0, verbose=False)
    numbers, failures = _conformance_numbers(rep.to_json())
    numbers["torch_distributed_backend"] = str(dist.get_backend())
    numbers["comm_world_group_own"] = get_runtime().comm.world.handle is not None \
        if hasattr(get_runtime().comm, "world") else None
    c = numbers.get("counts") or {}
    return {"numbers": numbers, "failures": failures,
            "detail": f"backend {backend}: " + ", ".join(f"{v} {k}" for k, v in c.items())}


# ============================================================================ kernels
def _quant_input(kind: str, n: int, block: int, dtype, gen):
    """A CPU input of *n* elements: "normal" (block magnitudes spread over 1e-4..1e4),
    "edge" (a zero block, NaN / +inf / -inf blocks, an outlier, exact ties x/s = k+0.5),
    "tiny" (subnormal block scales)."""
    torch = _torch()
    x = torch.randn(n, generator=gen, dtype=torch.float32)
    nb = -(-n // block)
    mag = torch.exp(torch.empty(nb).uniform_(-9.0, 9.0, generator=gen))
    x = x * mag.repeat_interleave(block)[:n]
    if kind == "edge" and nb >= 6:
        x[0:block] = 0.0                                  # zero block: scale 0, exact zeros
        x[block + 3] = float("nan")                       # NaN poisons its block only
        x[2 * block + 1] = float("inf")
        x[3 * block + 2] = float("-inf")
        x[4 * block + 5] = 1e30                           # outlier coarsens its block only
        # ties: absmax 127 * 2**-3, so s = 2**-3 exactly and (k + 0.5) s / s = k + 0.5
        b5 = x[5 * block:min(6 * block, n)]
        k = torch.randint(-100, 100, (b5.numel(),), generator=gen).float()
        b5.copy_((k + 0.5) * 2.0 ** -3)
        b5[0] = 127 * 2.0 ** -3
    if kind == "tiny":
        x = x / x.abs().max().clamp_min(1e-30) * 1e-39   # scales below float32's normal range
    return x.to(dtype)


def _quant_cases(ctx: Ctx):
    """(bits, block, in_dtype, n, kind) for the bit-for-bit comparison. On the GPU: sizes
    from 1 to 16M, power-of-two and other block sizes, every input dtype; interpreted Triton
    (CPU dry run) gets the small sizes only, as tests/test_quant_kernels.py does."""
    torch = _torch()
    if ctx.cuda:
        sizes = [1, 7, 129, 250, 4099, (1 << 20) + 3, 1 << 24]
        few = [7, 4099, (1 << 20) + 3]
    else:
        sizes = [1, 7, 129, 250] if ctx.quick else [1, 7, 129, 250, 1030]
        few = [7, 250]
    cases = []
    for bits, blocks in ((8, (256, 100)), (4, (256, 250))):
        for block in blocks:
            for n in sizes if block == 256 else few:
                cases.append((bits, block, torch.float32, n, "normal"))
            cases.append((bits, block, torch.float32, 6 * block + 7, "edge"))
        for dtype in (torch.bfloat16, torch.float16):
            for n in few:
                cases.append((bits, 256, dtype, n, "normal"))
    return cases


def check_quant_triton(ctx: Ctx) -> dict:
    """The Triton quantization kernels (accel_kernels.quant_triton) bit for bit against
    accel_kernels.quant_reference, on fresh random inputs (seed recorded): quantize
    (payload and scales), dequantize into fp32/bf16/fp16, the fused
    dequantize-reduce-requantize with k = 2 and 4 senders, and the ``out=`` forms. The
    reference runs on the CPU (it is the definition); the Triton kernels on the GPU. On the
    CPU dry run they run under Triton's interpreter (TRITON_INTERPRET=1), small sizes only.
    Subnormal scales ("tiny" inputs) are counted separately and do not fail the check: the
    kernels' docstring claims equality only where the device divides as IEEE float32."""
    torch = _torch()
    from zero_core.accel_kernels import quant_reference as ref
    from zero_core.accel_kernels import quant_triton as tri
    if not ctx.cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return {"status": "skip", "detail": "needs a CUDA device (or TRITON_INTERPRET=1)"}
    tri.kernels()  # imports triton; ImportError says how to install it
    dev = ctx.device
    gen = torch.Generator().manual_seed(ctx.seed)
    compared = mismatched = 0
    first = []
    tiny_mismatch = 0

    def compare(what, got, want, tiny=False):
        nonlocal compared, mismatched, tiny_mismatch
        ok, n = same_bits(got, want)
        compared += 1
        if not ok:
            if tiny:
                tiny_mismatch += n
                return
            mismatched += 1
            if len(first) < 8:
                first.append(f"{what}: {n} element(s) differ")

    cases = _quant_cases(ctx)
    for bits, block, dtype, n, kind in cases:
        label = f"int{bits} block {block} {str(dtype)[6:]} n={n} {kind}"
        x = _quant_input(kind, n, block, dtype, gen)
        p_ref, s_ref = ref.quantize(x, bits, block)
        p_t, s_t = tri.quantize(x.to(dev), bits, block)
        compare(f"quantize {label} payload", p_t, p_ref)
        compare(f"quantize {label} scales", s_t, s_ref)
        out_dtypes = (torch.float32, torch.bfloat16, torch.float16) if (
            block == 256 and dtype == torch.float32 and kind == "normal" and n in (7, 4099, 250)
        ) else (torch.float32,)
        for odt in out_dtypes:
            d_ref = ref.dequantize(p_ref, s_ref, bits, block, n, odt)
            d_t = tri.dequantize(p_ref.to(dev), s_ref.to(dev), bits, block, n, odt)
            compare(f"dequantize {label} -> {str(odt)[6:]}", d_t, d_ref)
    # fused dequantize-reduce-requantize, k senders (the sum of senders may overflow: NaN)
    fused_sizes = [129, 4099, (1 << 20) + 3] if ctx.cuda else [129, 250]
    for bits, block in ((8, 256), (4, 256), (8, 100), (4, 250)):
        for k in (2, 4):
            for n in fused_sizes if block == 256 else fused_sizes[:1]:
                kind = "edge" if n >= 6 * block else "normal"
                pays, scs = [], []
                for _ in range(k):
                    p, s = ref.quantize(_quant_input(kind, n, block, torch.float32, gen),
                                        bits, block)
                    pays.append(p)
                    scs.append(s)
                want = ref.dequantize_reduce_requantize(pays, scs, bits, block, n)
                got = tri.dequantize_reduce_requantize([p.to(dev) for p in pays],
                                                       [s.to(dev) for s in scs], bits, block, n)
                compare(f"fused int{bits} block {block} k={k} n={n} payload", got[0], want[0])
                compare(f"fused int{bits} block {block} k={k} n={n} scales", got[1], want[1])
    # the out= forms the engine uses
    n = 4099 if ctx.cuda else 250
    x = _quant_input("normal", n, 256, torch.float32, gen)
    for bits in (8, 4):
        p_ref, s_ref = ref.quantize(x, bits, 256)
        out = (torch.empty_like(p_ref, device=dev), torch.empty_like(s_ref, device=dev))
        res = tri.quantize(x.to(dev), bits, 256, out=out)
        compare(f"quantize out= int{bits}", out[0], p_ref)
        compare(f"quantize out= int{bits} scales", out[1], s_ref)
        if res[0].data_ptr() != out[0].data_ptr():
            mismatched += 1
            first.append(f"quantize out= int{bits} did not return the out buffers")
        dout = torch.empty(n, dtype=torch.float32, device=dev)
        tri.dequantize(p_ref.to(dev), s_ref.to(dev), bits, 256, n, out=dout)
        compare(f"dequantize out= int{bits}", dout, ref.dequantize(p_ref, s_ref, bits, 256, n))
    # subnormal scales: informational
    for bits in (8, 4):
        x = _quant_input("tiny", 1000, 256, torch.float32, gen)
        p_ref, s_ref = ref.quantize(x, bits, 256)
        p_t, s_t = tri.quantize(x.to(dev), bits, 256)
        compare(f"tiny int{bits} payload", p_t, p_ref, tiny=True)
        compare(f"tiny int{bits} scales", s_t, s_ref, tiny=True)
    numbers = {"seed": ctx.seed, "cases": len(cases), "comparisons": compared,
               "mismatched_comparisons": mismatched, "first_mismatches": first,
               "subnormal_elements_differing": tiny_mismatch,
               "interpreted": not ctx.cuda, "max_size": max(c[3] for c in cases)}
    failures = [f"{mismatched} of {compared} comparisons differ from quant_reference: "
                + "; ".join(first)] if mismatched else []
    return {"numbers": numbers, "failures": failures,
            "detail": f"{compared} comparisons, {mismatched} differ (seed {ctx.seed})"
                      + (", Triton interpreter" if not ctx.cuda else "")}


def _kernel_set(ctx: Ctx):
    """The kernel set the accelerator of ctx.device uses, from the registry."""
    from zero_core.runtime import registry
    reg = registry.load()
    acc = reg.accelerator_class(ctx.device)
    return reg.kernel_set(acc.kernel_set)


def check_quant_bandwidth(ctx: Ctx) -> dict:
    """The accelerator kernel set's quantization kernels (cuda: Triton) as the engine calls
    them (``out=`` buffers), in GB/s of bytes read + written, against a device-to-device
    copy of the same number of bytes (copy GB/s = 2 x bytes / time). Median of CUDA-event
    timings. Reported, not judged, except that on cuda the set must be the Triton one."""
    torch = _torch()
    from zero_core.accel_kernels import quant_reference as ref
    ks = _kernel_set(ctx)
    module = ks.info.get("quantize", "?")
    failures = []
    if ctx.cuda and not module.endswith("quant_triton"):
        failures.append(f"the cuda kernel set quantizes with {module}, not quant_triton "
                        f"({ks.info.get('quantize_fallback_reason', 'is triton installed?')})")
    quantize, dequantize = ks.extra["quantize"], ks.extra["dequantize"]
    fused = ks.extra["dequantize_reduce_requantize"]
    n = 1 << 26 if ctx.cuda else (1 << 20 if ctx.quick else 1 << 23)
    reps = 20 if ctx.cuda else 3
    block, k = 256, 4
    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(ctx.seed)
    x = torch.randn(n, device=dev, generator=gen)
    rows = []
    copy_cache = {}

    def copy_time(nbytes):
        if nbytes not in copy_cache:
            src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            src.fill_(1)
            copy_cache[nbytes] = median_seconds(ctx, lambda: dst.copy_(src), reps)
            del src, dst
        return copy_cache[nbytes]

    def measure(name, fn, nbytes, check=None):
        t = median_seconds(ctx, fn, reps)
        tc = copy_time(nbytes // 2)
        row = {"kernel": name, "ms": round(t * 1e3, 4), "GBps": round(nbytes / t / 1e9, 2),
               "copy_GBps": round(nbytes / tc / 1e9, 2),
               "pct_of_copy": round(100 * tc / t, 1)}
        if check is not None:
            row["matches_reference_on_1M"] = check()
        rows.append(row)

    nbl = -(-n // block)
    for bits in (8, 4):
        pay_bytes = n if bits == 8 else n // 2
        p_out = torch.empty(pay_bytes, dtype=torch.int8 if bits == 8 else torch.uint8,
                            device=dev)
        s_out = torch.empty(nbl, dtype=torch.float32, device=dev)

        def check_q(bits=bits):
            xs = x[: 1 << 20]
            got = quantize(xs, bits, block)
            want = ref.quantize(xs.cpu(), bits, block)
            return same_bits(got[0], want[0])[0] and same_bits(got[1], want[1])[0]

        measure(f"quantize int{bits} (fp32 in)",
                lambda bits=bits, p=p_out, s=s_out: quantize(x, bits, block, out=(p, s)),
                n * 4 + pay_bytes + nbl * 4, check_q)
        if bits == 8:
            xb = x.to(torch.bfloat16)
            measure("quantize int8 (bf16 in)",
                    lambda p=p_out, s=s_out: quantize(xb, 8, block, out=(p, s)),
                    n * 2 + pay_bytes + nbl * 4)
            del xb
        quantize(x, bits, block, out=(p_out, s_out))
        d_out = torch.empty(n, dtype=torch.float32, device=dev)
        measure(f"dequantize int{bits} (fp32 out)",
                lambda bits=bits, p=p_out, s=s_out, d=d_out: dequantize(p, s, bits, block, n,
                                                                        out=d),
                pay_bytes + nbl * 4 + n * 4)
        del d_out
        pays = p_out.unsqueeze(0).repeat(k, 1)
        scs = s_out.unsqueeze(0).repeat(k, 1)
        p2, s2 = torch.empty_like(p_out), torch.empty_like(s_out)
        measure(f"dequantize-reduce-requantize int{bits} k={k}",
                lambda bits=bits, pays=pays, scs=scs, p2=p2, s2=s2: fused(
                    pays, scs, bits, block, n, out=(p2, s2)),
                (k + 1) * (pay_bytes + nbl * 4))
        del pays, scs, p2, s2, p_out, s_out
        release_memory(ctx)
    bad = [r["kernel"] for r in rows if r.get("matches_reference_on_1M") is False]
    if bad:
        failures.append(f"results differ from quant_reference: {bad}")
    return {"numbers": {"module": module, "elements": n, "block": block, "reps": reps,
                        "rows": rows},
            "failures": failures,
            "detail": f"{module.rsplit('.', 1)[-1]}, % of a copy of the same bytes: " + ", ".join(
                f"{r['kernel'].replace('dequantize-reduce-requantize', 'fused')} "
                f"{r['pct_of_copy']:.0f}%" for r in rows)}


def adam_error_bound(old: dict, grad, new: dict, *, ulps: float, lr: float, beta1: float,
                     beta2: float, eps: float, weight_decay: float, step: int, adamw: bool,
                     bias_correction: bool) -> dict:
    """Per-element bounds (float64) on how far a correct float32 Adam step may land from
    the reference *new* that started from *old*.

    * exp_avg, exp_avg_sq: *ulps* float32 ulps of the sum of the terms' magnitudes (a
      bound relative to the result itself is wrong wherever terms cancel, as g + wd * p
      does under L2 decay), plus the hyperparameters rounded to float32 before 1 - beta is
      formed (torch's CUDA kernels do that: 1 - float(0.999) is 1.3e-5 off 0.001, 110 ulps
      of every exp_avg_sq increment -- the first GPU run of the kit found it);
    * param: *ulps* ulps of |old| + |new|, plus those moment errors carried through
      m / (sqrt(v) / bc2 + eps) to first order, plus the bias corrections' share of the
      beta rounding.
    """
    torch = _torch()
    u, beta_err = ulps * 2.0 ** -23, 2.0 ** -23  # |float(beta) - beta| <= 2^-25 for beta in [0.5, 1)
    p0, m0, v0 = (old[k].double() for k in ("param", "exp_avg", "exp_avg_sq"))
    g_mag = grad.double().abs()
    if weight_decay and not adamw:
        g_mag = g_mag + weight_decay * p0.abs()
    dm = u * (beta1 * m0.abs() + (1 - beta1) * g_mag) + beta_err * (m0.abs() + g_mag)
    g_sq = g_mag * g_mag
    dv = u * (beta2 * v0 + (1 - beta2) * g_sq) + beta_err * (v0 + g_sq)
    if bias_correction:
        bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
        # d(beta^k) = k beta^k d(beta)/beta: the corrections' relative error from the rounding
        bc_rel = beta_err * step * (beta1 ** step / bc1 + beta2 ** step / bc2)
    else:
        bc1, bc2, bc_rel = 1.0, 1.0, 0.0
    bc2_sqrt = math.sqrt(bc2)
    m, v, p = (new[k].double() for k in ("exp_avg", "exp_avg_sq", "param"))
    root = v.sqrt()
    # d sqrt(v) <= dv / (2 sqrt(v)), and never more than sqrt(dv) (v near 0)
    d_root = torch.minimum(dv / (2 * root).clamp_min(1e-300), dv.sqrt())
    denom = root / bc2_sqrt + eps
    step_size = lr / bc1
    d_update = step_size * (dm / denom + m.abs() * (d_root / bc2_sqrt) / denom ** 2
                            + bc_rel * m.abs() / denom)
    return {"param": u * (p0.abs() + p.abs()) + d_update, "exp_avg": dm, "exp_avg_sq": dv}


def check_optim_fused(ctx: Ctx) -> dict:
    """The fused optimizer kernels of the accelerator's kernel set (cuda: Triton if
    present, else torch's fused ops) against accel_kernels.optim_reference on the same
    device: Adam/AdamW with and without bias correction and weight decay, with bf16/fp16
    parameter copies; SGD plain, with momentum + dampening, Nesterov. Each of 10 steps
    starts both from the kernel's own state (errors are not compounded). Per element the
    difference must stay within a forward-error bound of 64 float32 ulps of the magnitudes
    involved (Adam: adam_error_bound, which also allows float32 hyperparameters; SGD:
    |old| + |new|). The low-precision copy must equal the kernel's fp32 result rounded."""
    torch = _torch()
    from zero_core.accel_kernels import optim_reference as ref
    ks = _kernel_set(ctx)
    dev = ctx.device
    sizes = [1, 7, 4099, (1 << 20) + 3] if ctx.cuda else [1, 7, 4099]
    steps = 10 if not ctx.quick else 4
    gen = torch.Generator(device=dev).manual_seed(ctx.seed)
    scale_gen = torch.Generator().manual_seed(ctx.seed)
    ulp = 2.0 ** -23
    rows, failures = [], []

    def rnd(n, scale=1.0):
        return torch.randn(n, device=dev, generator=gen) * scale

    adam_variants = []
    for adamw in (True, False):
        for bc in (True, False):
            for wd in (0.0, 0.1):
                adam_variants.append(dict(adamw=adamw, bias_correction=bc, weight_decay=wd,
                                          lowp=None))
    adam_variants += [dict(adamw=True, bias_correction=True, weight_decay=0.1, lowp=lp)
                      for lp in (torch.bfloat16, torch.float16)]
    sgd_variants = [dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, lowp=None),
                    dict(momentum=0.9, dampening=0.1, nesterov=False, weight_decay=0.05, lowp=None),
                    dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.05, lowp=None),
                    dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0,
                         lowp=torch.bfloat16)]

    def judge(got: dict, want: dict, bounds: dict, row):
        for key in got:
            diff = (got[key].double() - want[key].double()).abs()
            ratio = float((diff / (bounds[key] + 1e-30)).max())
            row["max_abs_diff"] = max(row["max_abs_diff"], float(diff.max()))
            if ratio > row["max_ratio_to_bound"]:
                row["max_ratio_to_bound"], row["worst_tensor"] = ratio, key

    for kind, variants in (("adam", adam_variants), ("sgd", sgd_variants)):
        for var in variants:
            lp = var["lowp"]
            name = kind + "(" + ", ".join(f"{k}={str(v).replace('torch.', '')}"
                                          for k, v in var.items()) + ")"
            row = {"kernel": name, "max_abs_diff": 0.0, "max_ratio_to_bound": 0.0,
                   "worst_tensor": None, "lowp_mismatch": 0}
            for n in sizes:
                state = {"param": rnd(n)}
                if kind == "adam":
                    state.update(exp_avg=torch.zeros(n, device=dev),
                                 exp_avg_sq=torch.zeros(n, device=dev))
                else:
                    state["momentum_buffer"] = torch.zeros(n, device=dev)
                for step in range(1, steps + 1):
                    grad = rnd(n, 10.0 ** float(torch.empty(1).uniform_(-3, 1, generator=scale_gen)))
                    old = {k: v.clone() for k, v in state.items()}
                    mine = {k: v.clone() for k, v in state.items()}
                    theirs = {k: v.clone() for k, v in state.items()}
                    low_mine = torch.empty(n, dtype=lp, device=dev) if lp else None
                    if kind == "adam":
                        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                  weight_decay=var["weight_decay"], step=step,
                                  adamw=var["adamw"], bias_correction=var["bias_correction"])
                        ks.adam_step(mine["param"], grad, mine["exp_avg"], mine["exp_avg_sq"],
                                     param_lowp=low_mine, **kw)
                        ref.adam_step(theirs["param"], grad, theirs["exp_avg"],
                                      theirs["exp_avg_sq"], **kw)
                        bounds = adam_error_bound(old, grad, theirs, ulps=64, **kw)
                    else:
                        kw = dict(lr=1e-2, momentum=var["momentum"], dampening=var["dampening"],
                                  weight_decay=var["weight_decay"], nesterov=var["nesterov"],
                                  first_step=step == 1)
                        buf_m = mine["momentum_buffer"] if var["momentum"] else None
                        buf_t = theirs["momentum_buffer"] if var["momentum"] else None
                        ks.sgd_step(mine["param"], grad, buf_m, param_lowp=low_mine, **kw)
                        ref.sgd_step(theirs["param"], grad, buf_t, **kw)
                        bounds = {k: 64 * ulp * (old[k].double().abs() + theirs[k].double().abs())
                                  for k in theirs}
                    judge(mine, theirs, bounds, row)
                    if lp is not None:
                        row["lowp_mismatch"] += int((low_mine != mine["param"].to(lp)).sum())
                    state = mine
            rows.append(row)
            if row["max_ratio_to_bound"] > 1.0:
                failures.append(f"{name}: {row['worst_tensor']} differs from optim_reference "
                                f"by {row['max_ratio_to_bound']:.2f}x its 64-ulp bound (largest "
                                f"difference {row['max_abs_diff']:.3g})")
            if row["lowp_mismatch"]:
                failures.append(f"{name}: {row['lowp_mismatch']} low-precision copies are not "
                                f"the kernel's fp32 result rounded")
    worst = max(rows, key=lambda r: r["max_ratio_to_bound"])
    return {"numbers": {"kernel_set": ks.name, "implementation": ks.info.get("implementation"),
                        "adam_step": ks.info.get("adam_step"), "sizes": sizes, "steps": steps,
                        "max_abs_diff": max(r["max_abs_diff"] for r in rows),
                        "worst": worst["kernel"], "rows": rows},
            "failures": failures,
            "detail": f"set {ks.name} ({ks.info.get('implementation')}): max abs diff "
                      f"{max(r['max_abs_diff'] for r in rows):.3g}, worst "
                      f"{worst['max_ratio_to_bound']:.3f}x bound"}


# ============================================================================ engine
@dataclass(frozen=True)
class EngineCase:
    """One engine configuration at world size 1."""

    stage: int
    precision: str = "bf16"             # "fp32" | "bf16"
    offload_optimizer: str = "none"     # "none" | "cpu" | "nvme"
    offload_param: str = "none"
    qwz: bool = False
    qgz: bool = False
    hpz: int = 1

    @property
    def name(self) -> str:
        parts = [f"stage{self.stage}", self.precision]
        if self.offload_optimizer != "none":
            parts.append(f"offopt-{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"offparam-{self.offload_param}")
        parts += [p for p, on in (("qwz", self.qwz), ("qgz", self.qgz)) if on]
        if self.hpz > 1:
            parts.append(f"hpz{self.hpz}")
        return "-".join(parts)


def engine_cases(ctx: Ctx) -> list[EngineCase]:
    cases = [EngineCase(s, p) for p in ("fp32", "bf16") for s in (0, 1, 2, 3)]
    cases += [EngineCase(s, "bf16", offload_optimizer=d) for d in ("cpu", "nvme")
              for s in (1, 2, 3)]
    cases += [EngineCase(3, "bf16", offload_optimizer=d, offload_param=d)
              for d in ("cpu", "nvme")]
    cases += [EngineCase(3, "bf16", qwz=True), EngineCase(3, "bf16", qgz=True),
              EngineCase(3, "bf16", qwz=True, qgz=True), EngineCase(3, "bf16", hpz=2),
              EngineCase(3, "bf16", qwz=True, qgz=True, hpz=2)]
    if ctx.quick:
        keep = {"stage0-fp32", "stage3-fp32", "stage2-bf16", "stage3-bf16",
                "stage2-bf16-offopt-cpu", "stage3-bf16-offopt-nvme-offparam-nvme",
                "stage3-bf16-qwz", "stage3-bf16-hpz2"}
        cases = [c for c in cases if c.name in keep]
    return cases


def checkpoint_cases(ctx: Ctx) -> list[EngineCase]:
    cases = [EngineCase(1, "bf16"), EngineCase(2, "bf16"), EngineCase(3, "bf16"),
             EngineCase(2, "bf16", offload_optimizer="cpu"),
             EngineCase(3, "bf16", offload_optimizer="nvme", offload_param="cpu")]
    return [cases[2]] if ctx.quick else cases


@dataclass(frozen=True)
class Sizes:
    preset: str
    micro: int
    seq: int
    gas: int
    steps: int
    lr: float = 5e-3


def sizes(ctx: Ctx) -> Sizes:
    if ctx.quick:
        return Sizes("tiny", micro=4, seq=32, gas=2, steps=4)
    if ctx.cuda:
        return Sizes("small", micro=8, seq=128, gas=2, steps=12)
    return Sizes("small", micro=4, seq=64, gas=2, steps=6)


def engine_config(ctx: Ctx, case: EngineCase, sz: Sizes, nvme_dir: str,
                  accelerator: str | None = None, comm: str | None = None) -> dict:
    """A config that cuts the model into several buckets, fetch units and sub-groups, so
    that the multi-piece paths run even on the small model."""
    zo = {"stage": case.stage, "reduce_bucket_size": 60_000, "allgather_bucket_size": 60_000}
    if case.stage == 3:
        zo.update(stage3_param_persistence_threshold=2_000, stage3_prefetch_bucket_size=100_000,
                  stage3_max_live_parameters=400_000, stage3_max_reuse_distance=50_000)
    if case.offload_optimizer != "none":
        zo["offload_optimizer"] = {"device": case.offload_optimizer, "nvme_path": nvme_dir,
                                   "pin_memory": True, "buffer_count": 4}
        zo["sub_group_size"] = 150_000
    if case.offload_param != "none":
        zo["offload_param"] = {"device": case.offload_param, "nvme_path": nvme_dir,
                               "pin_memory": True, "buffer_count": 4, "buffer_size": 2_000_000,
                               "max_in_cpu": 100_000}
    if case.qwz:
        zo["zero_quantized_weights"] = True
    if case.qgz:
        zo["zero_quantized_gradients"] = True
    if case.hpz > 1:
        zo["zero_hpz_partition_size"] = case.hpz
    cfg = {"train_micro_batch_size_per_gpu": sz.micro, "gradient_accumulation_steps": sz.gas,
           "gradient_clipping": 1.0, "zero_optimization": zo,
           "optimizer": {"type": "AdamW", "params": {"lr": sz.lr, "betas": [0.9, 0.95],
                                                     "eps": 1e-8, "weight_decay": 0.1}},
           "accelerator": accelerator or ctx.device, "comm_backend": comm or ctx.comm}
    if case.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_engine(engine, batches, device) -> tuple[list, list]:
    """Losses of every micro-batch and the gradient norm of every optimizer step."""
    from_gpt = gpt_module()
    losses, norms = [], []
    for x, y in batches:
        loss = from_gpt.lm_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(float(loss.detach()))
        if boundary:
            norms.append(engine.get_global_grad_norm())
    return losses, norms


def train_reference(model, batches, sz: Sizes, precision: str, device):
    """Plain torch on the same device: torch.optim.AdamW, clip_grad_norm_(1.0), gradient
    accumulation by dividing the loss. bf16: the model computes in bf16, AdamW steps fp32
    master copies (what mixed precision training does by hand). Returns (losses, last
    gradient norm, final fp32 weights by name)."""
    torch = _torch()
    lm_loss = gpt_module().lm_loss
    model = model.to(device)
    params = [p for p in model.parameters()]
    if precision == "bf16":
        master = [p.detach().float().clone().requires_grad_(True) for p in params]
        model.to(torch.bfloat16)
    else:
        master = params
    opt = torch.optim.AdamW(master, lr=sz.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses, norms = [], []
    for i, (x, y) in enumerate(batches):
        loss = lm_loss(model(x.to(device)), y.to(device))
        (loss / sz.gas).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % sz.gas == 0:
            if master is not params:
                for m, p in zip(master, params):
                    m.grad = p.grad.float()
                    p.grad = None
            norms.append(float(torch.nn.utils.clip_grad_norm_(master, 1.0)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if master is not params:
                with torch.no_grad():
                    for m, p in zip(master, params):
                        p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return losses, norms, {n: m.detach().float() for n, m in zip(names, master)}


def engine_weights(engine) -> dict:
    """name -> the model's weights as the engine holds them (compute dtype; gathered at
    stage 3), as fp32 CPU tensors."""
    if engine.stage == 3:
        sd = engine.module_state_dict()
        return {n: sd[n].detach().float().cpu() for n, _ in engine.module.named_parameters()}
    return {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}


def rel_curve_diff(a: list, b: list) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) / max(max(abs(y) for y in b), 1e-12)


def rel_weight_diff(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all weights together (L2)."""
    num = den = 0.0
    for n, w in b.items():
        w = w.cpu().double()
        num += float((a[n].double() - w).square().sum())
        den += float(w.square().sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


# ---- placement --------------------------------------------------------------------------
_LEAF_TYPES = (str, bytes, int, float, bool, complex, type(None), type, types.FunctionType,
               types.BuiltinFunctionType, types.MethodType, types.ModuleType)
_SKIP_PACKAGES = ("threading", "concurrent", "queue", "logging", "weakref", "_thread", "mmap",
                  "numpy", "subprocess", "io", "_io", "ctypes", "torch", "pluggy")
_OPT_STORE_CLASSES = {"HostStateStore", "NvmeStateStore", "SwappedFlatBuffer",
                      "MasterWriteThrough"}
_PARAM_STORE_CLASSES = {"ParamOffload", "_MappedParams"}


def engine_tensors(engine) -> list:
    """Every tensor reachable from *engine*'s attributes (breadth first, so each tensor gets
    its shortest path), as (path, owner class names along the path, tensor). The model's
    own parameters and buffers are listed under ``module.`` by name; other modules, the
    shared runtime and the config are not entered."""
    torch = _torch()
    seen, found = set(), []
    queue = deque([(engine, "engine", ())])
    for n, p in engine.module.named_parameters():
        seen.add(id(p))
        found.append((f"module.{n}", ("Parameter",), p.data))
    for n, b in engine.module.named_buffers():
        seen.add(id(b))
        found.append((f"module.{n}", ("Buffer",), b))
    seen.add(id(engine))
    while queue:
        obj, path, owners = queue.popleft()
        if len(owners) > 14:
            continue
        if isinstance(obj, dict):
            items = [(f"{path}[{k!r}]" if isinstance(k, (str, int)) else f"{path}[?]", v)
                     for k, v in list(obj.items())]
            next_owners = owners
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(list(obj))]
            next_owners = owners
        else:
            items = []
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                items += [(f"{path}.{k}", v) for k, v in list(attrs.items())]
            for k in getattr(type(obj), "__slots__", ()) or ():
                if isinstance(k, str) and hasattr(obj, k):
                    items.append((f"{path}.{k}", getattr(obj, k)))
            next_owners = owners + (type(obj).__name__,)
        for child_path, child in items:
            if id(child) in seen or isinstance(child, _LEAF_TYPES):
                continue
            if isinstance(child, (torch.dtype, torch.device, torch.Generator)):
                continue
            if isinstance(child, torch.Tensor):
                seen.add(id(child))
                found.append((child_path, next_owners, child))
                continue
            if obj is engine and child_path.split(".")[-1] in (
                    "module", "runtime", "comm", "config", "_modules", "_parameters",
                    "_forward_hooks", "_backward_hooks", "memory_ledger"):
                continue
            if isinstance(child, torch.nn.Module):
                continue
            package = (type(child).__module__ or "").split(".")[0]
            if package in _SKIP_PACKAGES:
                continue
            seen.add(id(child))
            queue.append((child, child_path, next_owners))
    return found


def placement(engine, case: EngineCase, device_type: str) -> dict:
    """Which engine-owned tensors are on the device and which in host memory, judged
    against the configuration: everything with more than one element belongs on the
    device, except (offload_optimizer) the fp32 master weights, optimizer states and the
    host gradient staging of the offloaded step, and (offload_param) the stage-3 parameter
    partitions and their staging buffers. Conversely, offloaded states found on the device
    are reported too. Model parameters (``module.*``) must be on the device whatever their
    size (stage 3 placeholders included)."""
    on_dev = on_host = 0
    dev_bytes = host_bytes = 0
    wrong_host, wrong_dev = [], []
    for path, owners, t in engine_tensors(engine):
        if t.device.type == "meta":
            continue
        nbytes = t.numel() * t.element_size()
        is_dev = t.device.type == device_type
        leaf = path.replace(".data", "").rsplit(".", 1)[-1]
        opt_side = (bool(_OPT_STORE_CLASSES & set(owners)) or ".master" in path
                    or "flat_state" in path or "optimizer.store" in path
                    or "exp_avg" in path)
        param_side = (bool(_PARAM_STORE_CLASSES & set(owners)) or "part_source" in path
                      or "param_offload" in path
                      or (case.stage == 3 and leaf.split("[")[0] in ("part", "param_buf")))
        if is_dev:
            on_dev += 1
            dev_bytes += nbytes
            if device_type != "cpu" and t.numel() > 1 and t.is_floating_point() and (
                    (case.offload_optimizer != "none" and opt_side and "grad" not in leaf
                     and t.dtype == _torch().float32)
                    or (case.offload_param != "none" and param_side
                        and leaf.split("[")[0] in ("part", "param_buf"))):
                wrong_dev.append(f"{path} {tuple(t.shape)} {str(t.dtype)[6:]}")
            continue
        on_host += 1
        host_bytes += nbytes
        if device_type == "cpu":
            continue
        if path.startswith("module."):
            # a parameter's device is what user code reads (stage-3 placeholders too)
            wrong_host.append(f"{path} {tuple(t.shape)} {str(t.dtype)[6:]}")
            continue
        if t.numel() <= 1:
            continue
        allowed = ((case.offload_optimizer != "none" and opt_side)
                   or (case.offload_param != "none" and param_side))
        if not allowed:
            wrong_host.append(f"{path} {tuple(t.shape)} {str(t.dtype)[6:]} "
                              f"(owners {'/'.join(owners[-3:])})")
    return {"tensors_on_device": on_dev, "tensors_on_host": on_host,
            "device_MiB": round(dev_bytes / 2**20, 2), "host_MiB": round(host_bytes / 2**20, 2),
            "unexpected_on_host": wrong_host[:20], "unexpected_on_host_count": len(wrong_host),
            "unexpected_on_device": wrong_dev[:20], "unexpected_on_device_count": len(wrong_dev)}


# ---- the engine checks ----------------------------------------------------------------
def _build(ctx: Ctx, case: EngineCase, sz: Sizes, nvme_dir: str, seed: int, **cfg_kw):
    import zero_core
    gpt = gpt_module()
    os.makedirs(nvme_dir, exist_ok=True)   # zero-core does not create swap directories
    model = gpt.build_model(sz.preset, seed=seed)
    initial = copy.deepcopy(model)
    cfg = engine_config(ctx, case, sz, nvme_dir, **cfg_kw)
    engine, *_ = zero_core.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    return engine, initial, cfg


def run_engine_case(ctx: Ctx, case: EngineCase) -> dict:
    """Train the GPT with the engine and with plain torch on the same device and batches;
    compare loss curves, gradient norms and the final weights; check placement. Bounds:
    fp32 loss curve within 1e-3 relative of torch fp32 and the first step's gradient norm
    (same weights on both sides) within 1e-4; bf16 within 2e-2 / 1e-2 of torch's bf16 mixed
    precision (same rounding points, different kernels and summation orders). Later norms
    and the final weights are reported, not judged (bf16 trajectories drift apart)."""
    torch = _torch()
    from zero_core.errors import ConfigError
    rt = runtime(ctx)
    sz = sizes(ctx)
    nvme_dir = tempfile.mkdtemp(prefix=f"nvme_{case.name}_", dir=ctx.scratch)
    gpt = gpt_module()
    vocab = gpt.GPTConfig.preset(sz.preset).vocab_size
    batches = learnable_batches(sz.steps * sz.gas, sz.micro, sz.seq, vocab, ctx.seed)
    try:
        engine, initial, cfg = _build(ctx, case, sz, nvme_dir, ctx.seed)
    except ConfigError as exc:
        if case.hpz > 1:
            return {"status": "refused", "numbers": {"message": str(exc)},
                    "detail": f"refused at world size 1: {str(exc)[:160]}"}
        raise
    try:
        t0 = time.perf_counter()
        losses, norms = train_engine(engine, batches, rt.device)
        synchronize(ctx)
        train_s = time.perf_counter() - t0
        weights = engine_weights(engine)
        place = placement(engine, case, rt.device.type)
        mem = engine.memory_report()
        zeropp = mem.get("zeropp")
    finally:
        engine.destroy()
    ref_losses, ref_norms, ref_weights = train_reference(
        copy.deepcopy(initial), batches, sz, case.precision, rt.device)
    fp32_losses = ref_losses
    if case.precision != "fp32":
        fp32_losses = train_reference(copy.deepcopy(initial), batches, sz, "fp32",
                                      rt.device)[0]
    loss_tol, norm_tol = (1e-3, 1e-4) if case.precision == "fp32" else (2e-2, 1e-2)
    curve = rel_curve_diff(losses, ref_losses)
    # the first step's norm comes from identical weights: only summation orders differ
    norm_diff = abs(norms[0] - ref_norms[0]) / max(abs(ref_norms[0]), 1e-12)
    numbers = {"losses": [round(v, 5) for v in losses],
               "reference_losses": [round(v, 5) for v in ref_losses],
               "loss_curve_max_rel_diff": curve,
               "loss_curve_max_rel_diff_vs_torch_fp32": rel_curve_diff(losses, fp32_losses),
               "grad_norms": norms, "reference_grad_norms": ref_norms,
               "grad_norm_rel_diff": norm_diff,
               "last_grad_norm_rel_diff": abs(norms[-1] - ref_norms[-1]) / max(
                   abs(ref_norms[-1]), 1e-12),
               "final_weights_rel_l2_diff": rel_weight_diff(weights, ref_weights),
               "train_seconds": round(train_s, 3), "placement": place,
               "memory_ledger_MiB": {k: round(v / 2**20, 3) for k, v in mem["ledger"].items()},
               "accelerator_peak_MiB": round(mem["accelerator"]["peak"] / 2**20, 1),
               "config": cfg["zero_optimization"]}
    if zeropp is not None:
        numbers["zeropp"] = zeropp
    failures = []
    if not all(math.isfinite(v) for v in losses):
        failures.append(f"non-finite loss: {losses}")
    if curve > loss_tol:
        failures.append(f"loss curve differs from plain torch by {curve:.3g} relative "
                        f"(bound {loss_tol})")
    if not norm_diff <= norm_tol:
        failures.append(f"first step's gradient norm {norms[0]:.6g} vs torch "
                        f"{ref_norms[0]:.6g} ({norm_diff:.3g} relative, bound {norm_tol})")
    if place["unexpected_on_host_count"]:
        failures.append(f"{place['unexpected_on_host_count']} engine tensor(s) in host memory "
                        f"that belong on the device: {place['unexpected_on_host'][:3]}")
    if place["unexpected_on_device_count"]:
        failures.append(f"{place['unexpected_on_device_count']} offloaded tensor(s) on the "
                        f"device: {place['unexpected_on_device'][:3]}")
    if losses[-1] >= losses[0]:
        failures.append(f"the loss did not go down ({losses[0]:.4f} -> {losses[-1]:.4f})")
    detail = (f"loss {losses[0]:.3f}->{losses[-1]:.3f}, curve diff {curve:.2e}, "
              f"norm diff {norm_diff:.2e}, host MiB {place['host_MiB']}")
    if case.qwz or case.qgz:
        detail += "; world size 1: gathers/reductions are local copies, nothing is quantized"
    release_memory(ctx)
    return {"numbers": numbers, "failures": failures, "detail": detail}


def fragments(engine) -> dict:
    """The engine's checkpoint fragments (every state of every owned slice) as CPU tensors,
    keyed ``name[start:end]/state``."""
    out = {}
    for f in engine._checkpoint_fragments("save"):
        for key, t in f.tensors.items():
            out[f"{f.name}[{f.start}:{f.end}]/{key}"] = t.detach().cpu().clone()
    return out


def run_checkpoint_case(ctx: Ctx, case: EngineCase) -> dict:
    """Train on the device, save a checkpoint, load it back into a fresh engine on the
    device, then in a separate process build the same model with the *cpu* accelerator and
    gloo and load it there; both loads are compared bit for bit with what was saved: the
    model's weights (compute dtype) and every checkpoint fragment (fp32 master weights and
    Adam states). The CPU side then evaluates the next batch; its loss must agree with the
    device's within 2e-2 relative (different hardware)."""
    torch = _torch()
    rt = runtime(ctx)
    sz = sizes(ctx)
    work = tempfile.mkdtemp(prefix=f"ckpt_{case.name}_", dir=ctx.scratch)
    gpt = gpt_module()
    vocab = gpt.GPTConfig.preset(sz.preset).vocab_size
    batches = learnable_batches(sz.steps * sz.gas + 1, sz.micro, sz.seq, vocab, ctx.seed + 1)
    engine, _, cfg = _build(ctx, case, sz, os.path.join(work, "nvme_gpu"), ctx.seed)
    try:
        train_engine(engine, batches[:-1], rt.device)  # losses and norms not needed
        t0 = time.perf_counter()
        ckpt_dir = engine.save_checkpoint(os.path.join(work, "ckpt"))
        save_s = time.perf_counter() - t0
        expected = {"weights": engine_weights(engine), "fragments": fragments(engine),
                    "global_steps": engine.global_steps}
        x, y = batches[-1]
        engine.module.eval()
        with torch.no_grad():
            next_loss = float(gpt.lm_loss(engine(x.to(rt.device)), y.to(rt.device)))
    finally:
        engine.destroy()
    torch.save(expected, os.path.join(work, "expected.pt"))
    # the same checkpoint loaded back on the device by a fresh engine (other initial values)
    reload_failures, reload_numbers = [], {}
    try:
        again, _, _ = _build(ctx, case, sz, os.path.join(work, "nvme_gpu2"), ctx.seed + 3)
        try:
            again.load_checkpoint(os.path.join(work, "ckpt"))
            got_w, got_f = engine_weights(again), fragments(again)
        finally:
            again.destroy()
        w_bad = [n for n, t in expected["weights"].items()
                 if n not in got_w or not same_bits(got_w[n], t)[0]]
        f_bad = [k for k, t in expected["fragments"].items()
                 if k not in got_f or not same_bits(got_f[k], t)[0]]
        reload_numbers = {"device_reload_weights_differing": len(w_bad),
                          "device_reload_fragments_differing": len(f_bad)}
        if w_bad or f_bad:
            reload_failures.append(f"reloaded on {ctx.device}: {len(w_bad)} weight(s) and "
                                   f"{len(f_bad)} fragment(s) differ: {(w_bad + f_bad)[:4]}")
    except Exception as exc:  # noqa: BLE001 - recorded; the CPU side still runs
        reload_failures.append(f"loading it back on {ctx.device} failed: "
                               f"{type(exc).__name__}: {str(exc)[:400]}")
        reload_numbers = {"device_reload_traceback": tail(traceback.format_exc(), 8)}
    release_memory(ctx)
    spec = {"case": case.__dict__, "sizes": sz.__dict__, "seed": ctx.seed, "work": work,
            "quick": ctx.quick, "next_loss": next_loss, "batch_seed": ctx.seed + 1}
    with open(os.path.join(work, "spec.json"), "w") as fh:
        json.dump(spec, fh)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "gpu_check.py"), "--ckpt-load",
                           os.path.join(work, "spec.json")],
                          env=clean_env(), capture_output=True, text=True, timeout=240,
                          cwd=ctx.scratch)
    result_path = os.path.join(work, "loaded.json")
    if not os.path.exists(result_path):
        return {"failures": [f"the cpu loader wrote no result (exit {proc.returncode}): "
                             f"{tail(proc.stdout + proc.stderr, 12)}"]}
    with open(result_path) as fh:
        loaded = json.load(fh)
    numbers = {"checkpoint": os.path.basename(str(ckpt_dir)), "save_seconds": round(save_s, 3),
               **reload_numbers, **loaded.get("numbers", {})}
    return {"numbers": numbers, "failures": reload_failures + loaded.get("failures", []),
            "detail": loaded.get("detail", "") + (
                f"; reloaded on {ctx.device}: " + ("FAILED" if reload_failures else "bit-equal"))}


def checkpoint_load_main(spec_path: str) -> int:
    """The CPU side of run_checkpoint_case (``gpu_check.py --ckpt-load SPEC``)."""
    torch = _torch()
    with open(spec_path) as fh:
        spec = json.load(fh)
    work = spec["work"]
    out_path = os.path.join(work, "loaded.json")
    try:
        ctx = Ctx("cpu", spec["quick"], work, spec["seed"])
        case = EngineCase(**spec["case"])
        sz = Sizes(**spec["sizes"])
        engine, _, _ = _build(ctx, case, sz, os.path.join(work, "nvme_cpu"), spec["seed"] + 7,
                              accelerator="cpu", comm="gloo")
        path, _ = engine.load_checkpoint(os.path.join(work, "ckpt"))
        expected = torch.load(os.path.join(work, "expected.pt"), weights_only=True)
        got_w, got_f = engine_weights(engine), fragments(engine)
        failures = []
        w_bad = [n for n, t in expected["weights"].items()
                 if n not in got_w or not same_bits(got_w[n], t)[0]]
        f_missing = sorted(set(expected["fragments"]) ^ set(got_f))
        f_bad = [k for k, t in expected["fragments"].items()
                 if k in got_f and not same_bits(got_f[k], t)[0]]
        if w_bad:
            failures.append(f"{len(w_bad)} weight(s) differ after loading on the CPU: {w_bad[:4]}")
        if f_missing:
            failures.append(f"fragments present on one side only: {f_missing[:4]}")
        if f_bad:
            failures.append(f"{len(f_bad)} checkpoint fragment(s) differ: {f_bad[:4]}")
        if engine.global_steps != expected["global_steps"]:
            failures.append(f"global_steps {engine.global_steps} after loading, saved "
                            f"{expected['global_steps']}")
        gpt = gpt_module()
        vocab = gpt.GPTConfig.preset(sz.preset).vocab_size
        x, y = learnable_batches(sz.steps * sz.gas + 1, sz.micro, sz.seq, vocab,
                                 spec["batch_seed"])[-1]
        engine.module.eval()
        with torch.no_grad():
            cpu_loss = float(gpt.lm_loss(engine(x), y))
        engine.destroy()
        diff = abs(cpu_loss - spec["next_loss"]) / abs(spec["next_loss"])
        if diff > 2e-2:
            failures.append(f"next-batch loss on the CPU {cpu_loss:.5f} vs on the device "
                            f"{spec['next_loss']:.5f} ({diff:.3g} relative, bound 2e-2)")
        numbers = {"weights_compared": len(expected["weights"]),
                   "fragments_compared": len(expected["fragments"]),
                   "weights_differing": len(w_bad), "fragments_differing": len(f_bad),
                   "device_next_loss": spec["next_loss"], "cpu_next_loss": cpu_loss,
                   "next_loss_rel_diff": diff}
        result = {"numbers": numbers, "failures": failures,
                  "detail": f"{len(expected['weights'])} weights + {len(expected['fragments'])} "
                            f"fragments bit-equal on the CPU: {not (w_bad or f_bad)}; "
                            f"next loss diff {diff:.2e}"}
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result = {"failures": [f"{type(exc).__name__}: {exc}"],
                  "numbers": {"traceback": tail(traceback.format_exc(), 12)}}
    with open(out_path, "w") as fh:
        json.dump(result, fh)
    return 0


# ============================================================================ bench
def profile_steps(ctx: Ctx, step, batches, top: int = 15) -> dict:
    """torch.profiler over *batches* (one step each): wall time, the device's busy time
    (kernels and copies), launches, and the ops with the most self time on the host and on
    the device -- where a step's time goes when it is slower than plain torch."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    dev = _torch().device(ctx.device)
    synchronize(ctx)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for x, y in batches:
            step(x.to(dev), y.to(dev))
        synchronize(ctx)
    wall_ms = 1e3 * (time.perf_counter() - t0) / len(batches)
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", None)
                     or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    def row(e) -> dict:
        return {"name": e.key[:90], "calls": int(e.count) // len(batches),
                "host_self_ms": round(e.self_cpu_time_total / 1e3 / len(batches), 3),
                "device_self_ms": round(device_us(e) / 1e3 / len(batches), 3)}

    from torch.autograd import DeviceType
    # the kernels and copies themselves; the host ops that launched them carry the same time
    # as their "self device" time, which ranks the ops in top_device
    on_device = [e for e in events if e.device_type != DeviceType.CPU]
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    busy_ms = sum(device_us(e) for e in on_device) / 1e3 / len(batches)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                         "cudaLaunchKernelExC"))
    return {"steps": len(batches), "wall_ms_per_step": round(wall_ms, 2),
            "device_busy_ms_per_step": round(busy_ms, 2),
            "kernel_launches_per_step": int(launches) // len(batches),
            "top_device": [row(e) for e in sorted(ops, key=device_us, reverse=True)[:top]],
            "top_host": [row(e) for e in sorted(ops, key=lambda e: e.self_cpu_time_total,
                                                reverse=True)[:top]]}


BENCH = ["torch-fp32", "torch-fp32-fused", "torch-bf16-autocast", "zero-s0-fp32", "zero-s1-fp32",
         "zero-s2-fp32", "zero-s3-fp32", "zero-s2-bf16", "zero-s3-bf16",
         "zero-s2-bf16-offopt-cpu"]
QUICK_BENCH = ["torch-fp32", "zero-s2-fp32", "zero-s3-bf16"]


def bench_sizes(ctx: Ctx) -> dict:
    """GPT size and steps: on the GPU a 12 x 768 GPT (~85M parameters, context 256, 16
    sequences per step), a few seconds per contender."""
    if ctx.cuda:
        return {"preset": "bench", "overrides": {"n_layer": 12, "n_head": 12, "n_embd": 768,
                                                 "block_size": 256},
                "micro": 16, "seq": 256, "warmup": 3, "steps": 15}
    if ctx.quick:
        return {"preset": "tiny", "overrides": {}, "micro": 2, "seq": 32, "warmup": 1,
                "steps": 2}
    return {"preset": "small", "overrides": {}, "micro": 4, "seq": 128, "warmup": 2, "steps": 4}


def run_bench(ctx: Ctx, contender: str) -> dict:
    """Median step time and peak accelerator memory of one contender training the GPT:
    plain torch (torch.optim.AdamW, foreach / fused, bf16 autocast) or zero-core (stage,
    precision, offload). Same model, batches and hyperparameters for all; the report puts
    the rows side by side (ratios against torch-fp32)."""
    torch = _torch()
    import zero_core
    rt = runtime(ctx)
    acc, dev = rt.accelerator, rt.device
    b = bench_sizes(ctx)
    gpt = gpt_module()
    release_memory(ctx)
    profiled = 2 if ctx.profile else 0
    batches = learnable_batches(b["warmup"] + b["steps"] + profiled, b["micro"], b["seq"], 256,
                                ctx.seed)
    acc.reset_peak_memory_stats()
    base_mem = acc.memory_allocated()
    model = gpt.build_model(b["preset"], seed=ctx.seed, **b["overrides"])
    n_params = model.num_parameters()
    lr = 3e-4
    engine = opt = None
    if contender.startswith("torch"):
        model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=True if "fused" in contender else None)
        autocast = "autocast" in contender

        def step(x, y):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                loss = gpt.lm_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        parts = contender.split("-")
        stage, precision = int(parts[1][1:]), parts[2]
        zo = {"stage": stage}
        if "offopt" in contender:
            zo["offload_optimizer"] = {"device": parts[-1], "pin_memory": True}
        cfg = {"train_micro_batch_size_per_gpu": b["micro"], "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95],
                                                         "weight_decay": 0.1}},
               "zero_optimization": zo, "accelerator": ctx.device, "comm_backend": ctx.comm}
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine, *_ = zero_core.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)

        def step(x, y):
            loss = gpt.lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss
    try:
        times, losses = [], []
        for i, (x, y) in enumerate(batches[:len(batches) - profiled]):
            x, y = x.to(dev), y.to(dev)
            synchronize(ctx)
            t0 = time.perf_counter()
            loss = step(x, y)
            synchronize(ctx)
            if i >= b["warmup"]:
                times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
        peak = acc.max_memory_allocated()
        numbers = {"contender": contender, "parameters": n_params,
                   "tokens_per_step": b["micro"] * b["seq"], "steps_timed": len(times),
                   "median_step_ms": round(1e3 * statistics.median(times), 2),
                   "min_step_ms": round(1e3 * min(times), 2),
                   "max_step_ms": round(1e3 * max(times), 2),
                   "peak_MiB": round((peak - (base_mem if ctx.cuda else 0)) / 2**20, 1),
                   "peak_is": "accelerator max_memory_allocated above the baseline" if ctx.cuda
                   else "process peak RSS (cpu accelerator)",
                   "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)}
        if profiled:
            numbers["profile"] = profile_steps(ctx, step, batches[-profiled:])
        if engine is not None:
            mem = engine.memory_report()
            numbers["model_states_MiB_ledger"] = round(mem["ledger"]["model_states"] / 2**20, 1)
            if mem.get("formula"):
                numbers["model_states_MiB_formula"] = round(
                    mem["formula"]["model_states"] / 2**20, 1)
    finally:
        if engine is not None:
            engine.destroy()
        del engine, opt, model
        release_memory(ctx)
    failures = [] if all(math.isfinite(v) for v in losses) else [f"non-finite loss {losses}"]
    return {"numbers": numbers, "failures": failures,
            "detail": f"{numbers['median_step_ms']} ms/step, peak {numbers['peak_MiB']} MiB, "
                      f"loss {numbers['loss_first']}->{numbers['loss_last']}"}


# ============================================================================ the plan
@dataclass(frozen=True)
class Check:
    name: str
    group: str          # worker process it runs in
    cap_s: float        # a single check running longer than this is stopped
    run: object         # fn(ctx) -> dict


def plan(ctx: Ctx) -> list[Check]:
    """Every check, in the order they run (cheap and independent first)."""
    checks = [
        Check("conformance/cli", "conformance", 240, check_conformance_cli),
        Check("conformance/preinit-filestore", "conformance-preinit", 180,
              check_conformance_preinit),
        Check("kernels/quant-triton-bitwise", "kernels", 240, check_quant_triton),
        Check("kernels/quant-bandwidth", "kernels", 120, check_quant_bandwidth),
        Check("kernels/optim-fused", "kernels", 120, check_optim_fused),
    ]
    for case in engine_cases(ctx):
        checks.append(Check(f"engine/{case.name}", "engine", 150,
                            lambda c, case=case: run_engine_case(c, case)))
    for case in checkpoint_cases(ctx):
        checks.append(Check(f"checkpoint/{case.name}-to-cpu", "engine", 240,
                            lambda c, case=case: run_checkpoint_case(c, case)))
    for contender in (QUICK_BENCH if ctx.quick else BENCH):
        checks.append(Check(f"bench/{contender}", "engine", 150,
                            lambda c, contender=contender: run_bench(c, contender)))
    return checks
