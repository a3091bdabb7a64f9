"""``zero-core plan --measure``: this machine's rates, timed here in about 30 s.

- FLOP rate per rank: a float32 matmul (1024², a few repetitions after a warm-up) with the
  threads one rank of ``ranks`` gets (cores / ranks), FLOP = 2n³ per product;
- memory copy (host↔"device" on CPU ranks): a 256 MB tensor copy;
- disk: a file of *disk_mb* MB written sequentially with fsync, its pages dropped from the
  cache (``posix_fadvise(DONTNEED)``), then read back; bandwidth = bytes / (write + read)
  time, both directions being what an nvme offload step does;
- collectives: 2 local ranks over gloo (``run_ranks`` + ``measure_worker.py``), all_reduce
  and all_gather of 4 MB; bandwidth = bytes the ledger counts as sent / seconds;
- training rate (``train_flops``): in the same ranks, all at once, forward + backward of a
  GPT block shaped like the planned model's (hidden size, heads, sequence, micro-batch;
  without a model DEFAULT_BLOCK) in the planned precision's dtype, 6 x parameters x
  tokens FLOP per step. What the
  step-time model divides by: on the development machine it was 0.6-0.8 of the 1024^2
  matmul's rate (``flops``), which had predicted steps 1.5x too short
  (ci/bench/validate_plan.py);
- optimizer rate (``optimizer_rate``): the same ranks' fused Adam step (cpu kernel set)
  on 4M-element flat buffers, elements per second.
"""
from __future__ import annotations

import os
import pathlib
import tempfile
import time

import torch

WORKER = pathlib.Path(__file__).with_name("measure_worker.py")


def matmul_flops(ranks: int = 1, n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of one rank's float32 matmul with cores/ranks threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ranks)))
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b   # warm-up: thread pool and caches
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return 2 * n ** 3 * reps / elapsed


def memcpy_bandwidth(nbytes: int = 256 * 2 ** 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - start)


def disk_bandwidth(directory: str | None = None, mb: int = 256) -> float:
    """Bytes/s of a sequential write (fsync'd) plus read of *mb* MB in *directory*."""
    block = os.urandom(2 ** 20)
    fd, path = tempfile.mkstemp(prefix="zero-core-plan-", dir=directory)
    try:
        start = time.perf_counter()
        for _ in range(mb):
            os.write(fd, block)
        os.fsync(fd)
        written = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # read from the disk, not the cache
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        while os.read(fd, 2 ** 20):
            pass
        read = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return 2 * mb * 2 ** 20 / (written + read)


RANK_RATES = ("all_reduce", "all_gather", "train_flops", "optimizer_rate")
#: the GPT block timed for ``train_flops`` when no model is given: hidden, heads, sequence,
#: sequences
DEFAULT_BLOCK = (768, 12, 128, 4)


#: the dtype the training rate is timed in, by the planner's precision names
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def rank_rates(ranks: int = 2, block: tuple = DEFAULT_BLOCK, timeout: float = 120.0,
               precision: str = "fp32") -> dict:
    """The rates measure_worker.py times on *ranks* local gloo ranks (the slowest rank's):
    bytes/s sent in all_reduce and all_gather, the training FLOP/s of a GPT *block*
    (hidden, heads, sequence, sequences) in *precision* and Adam's elements/s."""
    from zero_core.testing.ranks import run_ranks
    results = run_ranks(str(WORKER), max(2, ranks), "torchrun",
                        args=[*block, DTYPES[precision]],
                        env={"ZERO_CORE_COMM": "gloo"}, timeout=timeout)
    reports = [r.report for r in results]
    return {key: min(rep[key] for rep in reports) for key in RANK_RATES}


def measure(ranks: int = 2, disk_dir: str | None = None, block: tuple | None = None,
            precision: str = "fp32") -> dict:
    """Every rate of the module docstring, and how long measuring took; *block*: the
    planned model's (hidden, heads, sequence, micro-batch) for the training rate, timed
    in *precision*."""
    start = time.perf_counter()
    block = tuple(block or DEFAULT_BLOCK)
    rates = rank_rates(ranks, block, precision=precision)
    coll = {op: rates[op] for op in ("all_reduce", "all_gather")}
    out = {"ranks": ranks, "flops": matmul_flops(ranks), "train_flops": rates["train_flops"],
           "train_block": dict(zip(("hidden", "heads", "seq", "micro_batch"), block),
                               precision=precision),
           "optimizer_rate": rates["optimizer_rate"],
           "memcpy_bandwidth": memcpy_bandwidth(), "disk_bandwidth": disk_bandwidth(disk_dir),
           "intra_bandwidth": min(coll.values()), "collectives": coll}
    out["seconds"] = time.perf_counter() - start
    return out
