"""Rank program: does an async collective progress while this rank computes?

Usage: ``comm_overlap.py BACKEND COMPUTE_SECONDS``.

Rank 0 starts each collective with ``async_op=True``, runs torch matmuls for
COMPUTE_SECONDS without calling the communicator, then waits. The other ranks call the
same collective synchronously and time it. If the collective really progresses in the
background, they finish long before rank 0's compute ends; if it only progresses when
rank 0 calls into the library again (Open MPI's non-blocking collectives without a
progress thread), they finish only after it.
"""
from __future__ import annotations

import sys
import time

import torch

from zero_core.runtime import registry
from zero_core.runtime.launch import discover
from zero_core.runtime.context import comm_timeout
from zero_core.testing.ranks import report
from zero_core.runtime.topology import resolve_ranks_per_node

BACKEND, COMPUTE = sys.argv[1], float(sys.argv[2])
torch.set_num_threads(1)
launch = discover()
topology = resolve_ranks_per_node(launch.world_size, launch.local_world_size)
comm = registry.load().communicator_class(BACKEND)(launch, topology, timeout=comm_timeout())
n, rank = comm.world_size, comm.rank
numel = 1 << 20  # 4 MiB of fp32: far above any eager/short-message protocol
a = torch.randn(384, 384)


def compute(seconds: float) -> int:
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        steps += 1
    return steps


def start(op: str, async_op: bool):
    if op == "all_reduce":
        return comm.all_reduce(torch.ones(numel), async_op=async_op)
    if op == "all_gather_into":
        return comm.all_gather_into(torch.empty(numel), torch.ones(numel // n), async_op=async_op)
    if op == "reduce_scatter":
        return comm.reduce_scatter(torch.empty(numel // n), torch.ones(numel), async_op=async_op)
    return comm.all_to_all_single(torch.empty(numel), torch.ones(numel), async_op=async_op)


result = {"rank": rank, "peer_seconds": {}, "done_before_wait": {}, "compute_seconds": COMPUTE}
for op in ("all_reduce", "all_gather_into", "reduce_scatter", "all_to_all_single"):
    start(op, False)  # warm-up: connections and buffers exist before timing
    comm.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        handle = start(op, True)
        compute(COMPUTE)
        result["done_before_wait"][op] = handle.is_completed()
        handle.wait()
    else:
        start(op, False)
        result["peer_seconds"][op] = time.perf_counter() - t0
    comm.barrier()
report(result)
comm.shutdown()
