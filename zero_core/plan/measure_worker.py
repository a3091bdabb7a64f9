"""Rank program of ``zero-core plan --measure``: times all_reduce and all_gather of 4 MB on
this job's communicator and reports the bytes/s this rank sent (the ledger's count).

Run by ``measure.collective_bandwidth`` through ``zero_core.testing.run_ranks``."""
from __future__ import annotations

import time

import torch

from zero_core.runtime import registry
from zero_core.runtime.context import comm_timeout
from zero_core.runtime.launch import discover
from zero_core.runtime.topology import resolve_ranks_per_node
from zero_core.testing import report

ELEMENTS = 2 ** 20   # 4 MB of float32
REPS = 5


def timed(comm, op) -> float:
    """Bytes/s this rank sent in REPS calls of *op* (after one warm-up call)."""
    op()
    before = comm.ledger.snapshot()["sent_bytes"]
    start = time.perf_counter()
    for _ in range(REPS):
        op()
    elapsed = time.perf_counter() - start
    return (comm.ledger.snapshot()["sent_bytes"] - before) / elapsed


launch = discover()
topology = resolve_ranks_per_node(launch.world_size, launch.local_world_size)
comm = registry.load().communicator_class(None)(launch, topology, timeout=comm_timeout())
x = torch.ones(ELEMENTS)
out = torch.empty(ELEMENTS * comm.world_size)
report({"all_reduce": timed(comm, lambda: comm.all_reduce(x)),
        "all_gather": timed(comm, lambda: comm.all_gather_into(out, x))})
