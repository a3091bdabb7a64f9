"""Rank program: the runtime under mpirun with MASTER_ADDR / MASTER_PORT unset.

Usage: ``comm_runtime.py BACKEND``. Calls ``zero_core.runtime.context.init_distributed`` with the
CPU accelerator and communicator BACKEND, then checks that torch.distributed is usable
next to the communicator — even with a communicator collective in flight.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from zero_core.runtime import context as runtime
from zero_core.testing.ranks import report

BACKEND = sys.argv[1]
env_before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
rt = runtime.init_distributed(accelerator="cpu", comm_backend=BACKEND)
comm, rank, n = rt.comm, rt.rank, rt.world_size

# a communicator collective in flight while torch.distributed does its own
pending = torch.full((4096,), float(rank + 1))
handle = comm.all_reduce(pending, async_op=True)
x = torch.full((16,), float(rank + 1))
dist.all_reduce(x)
dist.barrier()
handle.wait()
gathered = [torch.empty(1) for _ in range(n)]
dist.all_gather(gathered, torch.tensor([float(rank)]))

report({
    "rank": rank,
    "comm": comm.name,
    "env_before": env_before,
    "master": [os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")],
    "dist_initialized": dist.is_initialized(),
    "dist_rank": dist.get_rank(),
    "dist_world": dist.get_world_size(),
    "dist_backend": str(dist.get_backend()),
    "dist_sum": x[0].item(),
    "dist_gather": [g.item() for g in gathered],
    "comm_sum": pending[0].item(),
})
runtime.shutdown()
