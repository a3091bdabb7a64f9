"""The GPU kit's kernel checks: the Triton quantization kernels bit for bit against
quant_reference, their bandwidth against a device-to-device copy, and the fused optimizer
kernels of the device's kernel set against optim_reference within a forward-error bound
(:func:`adam_error_bound`, also tested on the CPU by tests/test_gpu_kit.py).
"""
from __future__ import annotations

import math
import os

from check_support import Ctx, import_torch, median_seconds, release_memory, same_bits


def _quant_input(kind: str, n: int, block: int, dtype, gen):
    """A CPU input of *n* elements: "normal" (block magnitudes spread over 1e-4..1e4),
    "edge" (a zero block, NaN / +inf / -inf blocks, an outlier, exact ties x/s = k+0.5),
    "tiny" (subnormal block scales)."""
    torch = import_torch()
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
    torch = import_torch()
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
    torch = import_torch()
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
    torch = import_torch()
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
    torch = import_torch()
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
    torch = import_torch()
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
