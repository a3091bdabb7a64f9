"""The GPU kit's bench checks: median step time and peak memory of the examples/gpt.py GPT
trained by plain torch (AdamW foreach / fused, bf16 autocast) and by zero-core (stages,
precision, optimizer offload), with a torch.profiler summary of two steps for the rows in
PROFILED (every row with ``--profile``): host time, device busy time, kernel launches and
host-device synchronizations per step. Synchronizations are counted twice: the profiler's
blocking CUDA runtime calls (SYNC_CALLS) and torch.cuda.set_sync_debug_mode("warn")'s
warnings; the engine's goal is 0 per step (tests/test_sync_free_step.py counts 0 on the
vdev device). Profiled steps feed batches as a training loop with pin_memory=True does
(pinned, moved non-blocking) and do not read the loss.
"""
from __future__ import annotations

import math
import statistics
import time
import warnings

from check_support import (Ctx, gpt_module, import_torch, learnable_batches, release_memory,
                           runtime, synchronize)


#: CUDA runtime calls that block the host on the device (as the profiler names them)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")


def count_sync_warnings(ctx: Ctx, fn) -> int | None:
    """Run *fn*; the synchronizations torch.cuda's sync debug mode warns about during it
    (None on the CPU: host and device are one there)."""
    if not ctx.cuda:
        fn()
        return None
    torch = import_torch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def profile_steps(ctx: Ctx, step, batches, top: int = 15) -> dict:
    """torch.profiler over *batches* (one step each): wall time, the device's busy time
    (kernels and copies), launches, synchronizations, and the ops with the most self time on
    the host and on the device -- where a step's time goes when it is slower than plain
    torch."""
    from torch.profiler import ProfilerActivity, profile
    torch = import_torch()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    dev = torch.device(ctx.device)
    # as a DataLoader(pin_memory=True) hands them over: pinned, moved without blocking
    host = [(x.pin_memory(), y.pin_memory()) if ctx.cuda else (x, y) for x, y in batches]
    synchronize(ctx)
    warned = []
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for x, y in host:
            warned.append(count_sync_warnings(ctx, lambda: step(
                x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))))
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
    # the profiled window ends with one synchronize of ours: not the step's
    blocking = sum(e.count for e in events if e.key in SYNC_CALLS) - (1 if ctx.cuda else 0)
    return {"steps": len(batches), "wall_ms_per_step": round(wall_ms, 2),
            "device_busy_ms_per_step": round(busy_ms, 2),
            "kernel_launches_per_step": int(launches) // len(batches),
            "syncs_per_step_profiler": (round(max(blocking, 0) / len(batches), 2) if ctx.cuda
                                        else "n/a (cpu)"),
            "syncs_per_step_debug_mode": (round(sum(warned) / len(warned), 2) if ctx.cuda
                                          else "n/a (cpu)"),
            "syncs_goal": 0,
            "top_device": [row(e) for e in sorted(ops, key=device_us, reverse=True)[:top]],
            "top_host": [row(e) for e in sorted(ops, key=lambda e: e.self_cpu_time_total,
                                                reverse=True)[:top]]}


BENCH = ["torch-fp32", "torch-fp32-fused", "torch-bf16-autocast", "zero-s0-fp32", "zero-s1-fp32",
         "zero-s2-fp32", "zero-s3-fp32", "zero-s2-bf16", "zero-s3-bf16",
         "zero-s2-bf16-offopt-cpu"]
QUICK_BENCH = ["torch-fp32", "zero-s2-fp32", "zero-s3-bf16"]
#: rows profiled without --profile: the engine's stages in bf16 (the step-time goal is
#: 1.15x plain torch's bf16 autocast step) and that reference
PROFILED = ("torch-bf16-autocast", "zero-s0-fp32", "zero-s1-fp32", "zero-s2-bf16", "zero-s3-bf16")


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
    torch = import_torch()
    import zero_core
    rt = runtime(ctx)
    acc, dev = rt.accelerator, rt.device
    b = bench_sizes(ctx)
    gpt = gpt_module()
    release_memory(ctx)
    profiled = 2 if ctx.profile or contender in PROFILED else 0
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
