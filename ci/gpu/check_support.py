"""What every check of the GPU kit shares: the context it gets, a worker's environment,
timing, bit-for-bit comparison, and the GPT with its learnable batches.

The checks themselves are in conformance_checks.py, kernel_checks.py, engine_checks.py,
checkpoint_checks.py and bench_checks.py; check_plan.py lists them and check.py runs them.
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))  # this file is ci/gpu/check_support.py

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
def import_torch():
    """torch, imported when a check first needs it."""
    import torch
    return torch


def runtime(ctx: Ctx):
    """zero-core's runtime on ctx.device at world size 1 (initialized on first use)."""
    from zero_core.runtime.context import init_distributed
    return init_distributed(accelerator=ctx.device, comm_backend=ctx.comm)


def synchronize(ctx: Ctx) -> None:
    if ctx.cuda:
        import_torch().cuda.synchronize()


def median_seconds(ctx: Ctx, fn, reps: int, warmup: int = 2) -> float:
    """Median wall time of *fn* in seconds: CUDA events on the GPU, perf_counter on CPU."""
    torch = import_torch()
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
    torch = import_torch()
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
    torch = import_torch()
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
        import_torch().cuda.empty_cache()
