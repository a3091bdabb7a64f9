"""``zero-core plan --measure``: this machine's rates, timed here in about 30 s.

- FLOP rate per rank: a float32 matmul (1024², a few repetitions after a warm-up) with the
  threads one rank of ``ranks`` gets (cores / ranks), FLOP = 2n³ per product;
- memory copy (host↔"device" on CPU ranks): a 256 MB tensor copy;
- disk: a file of *disk_mb* MB written sequentially with fsync, its pages dropped from the
  cache (``posix_fadvise(DONTNEED)``), then read back; bandwidth = bytes / (write + read)
  time, both directions being what an nvme offload step does;
- collectives: 2 local ranks over gloo (``run_ranks`` + ``measure_worker.py``), all_reduce
  and all_gather of 4 MB; bandwidth = bytes the ledger counts as sent / seconds.
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


def collective_bandwidth(timeout: float = 60.0) -> dict:
    """Bytes/s one rank sends in all_reduce and all_gather between 2 local gloo ranks."""
    from zero_core.testing import run_ranks
    results = run_ranks(str(WORKER), 2, "torchrun", env={"ZERO_CORE_COMM": "gloo"},
                        timeout=timeout)
    reports = [r.report for r in results]
    return {op: min(rep[op] for rep in reports) for op in ("all_reduce", "all_gather")}


def measure(ranks: int = 2, disk_dir: str | None = None) -> dict:
    """Every rate of the module docstring, and how long measuring took."""
    start = time.perf_counter()
    coll = collective_bandwidth()
    out = {"ranks": ranks, "flops": matmul_flops(ranks),
           "memcpy_bandwidth": memcpy_bandwidth(), "disk_bandwidth": disk_bandwidth(disk_dir),
           "intra_bandwidth": min(coll.values()), "collectives": coll}
    out["seconds"] = time.perf_counter() - start
    return out
