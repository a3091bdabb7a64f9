"""Rank program for fault tests: ``comm_faults.py BACKEND MODE``.

MODE
  die    the last rank SIGKILLs itself before an all_reduce; the others must stop with an
         error naming the collective and the group within ZERO_CORE_COMM_TIMEOUT
  hang   the last rank stops calling collectives (waits for the others to give up); the
         others must raise CommTimeoutError. Under mpirun the error is left uncaught, as
         in a real training script, and the job must still end (no hang in MPI_Finalize)
  late   the last rank joins an all_reduce 3 s late; rank 0's wait with a 1 s deadline
         raises CommTimeoutError, and waiting again on the same handle then succeeds with
         the right result (the backend kept the collective running)
  dtype  rank 0 calls collectives the backend cannot carry (bool, integer average);
         each must fail before anything is sent, so the next collective still matches;
         then the ranks exit without calling shutdown()
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch

from zero_core.runtime import registry
from zero_core.errors import CommError
from zero_core.runtime.launch import discover
from zero_core.runtime.context import comm_timeout
from zero_core.testing.ranks import report
from zero_core.runtime.topology import resolve_ranks_per_node

BACKEND, MODE = sys.argv[1], sys.argv[2]
launch = discover()
topology = resolve_ranks_per_node(launch.world_size, launch.local_world_size)
comm = registry.load().communicator_class(BACKEND)(launch, topology, timeout=comm_timeout())
rank, last = comm.rank, comm.world_size - 1
DONE = os.path.join(os.environ.get("ZERO_CORE_REPORT_DIR", "/tmp"), "survivors_done")

# one healthy collective first, so that every connection is up before the fault
t = torch.ones(1000)
comm.all_reduce(t)
assert t[0].item() == comm.world_size

if MODE == "die":
    if rank == last:
        print(f"rank {rank}: killing myself with SIGKILL before all_reduce", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # make sure the peer is gone before we start
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1 << 16))
        outcome = {"error": None}
    except CommError as exc:
        outcome = {"error": str(exc), "type": type(exc).__name__}
    outcome.update(rank=rank, seconds=time.monotonic() - start)
    report(outcome)
    sys.stdout.flush()
    os._exit(0)  # the process group has a dead peer: do not wait for it at teardown

elif MODE == "hang":
    if rank == last:
        # stop calling collectives until the others have given up (bounded wait)
        deadline = time.monotonic() + 120
        while not os.path.exists(DONE) and time.monotonic() < deadline:
            time.sleep(0.1)
        report({"rank": rank, "hung": True})
        os._exit(0)
    start = time.monotonic()
    if launch.is_mpi:
        # uncaught, as in a training script: the traceback must name the collective, and
        # the exit hook must abort the job rather than hang in MPI_Finalize
        print(f"rank {rank}: entering all_reduce at {time.time():.3f}", flush=True)
        comm.all_reduce(torch.ones(1 << 16))
        raise SystemExit("all_reduce returned although a peer never joined")
    try:
        comm.all_reduce(torch.ones(1 << 16))
        outcome = {"error": None}
    except CommError as exc:
        outcome = {"error": str(exc), "type": type(exc).__name__}
    outcome.update(rank=rank, seconds=time.monotonic() - start)
    report(outcome)
    if rank == 0:
        open(DONE, "w").close()
    os._exit(0)

elif MODE == "late":
    x = torch.full((1 << 16,), float(rank + 1))
    expect = comm.world_size * (comm.world_size + 1) / 2
    if rank == last:
        time.sleep(3.0)
        comm.all_reduce(x)
        report({"rank": rank, "ok": bool((x == expect).all())})
    else:
        handle = comm.all_reduce(x, async_op=True)
        handle.timeout = 1.0
        try:
            handle.wait()
            first = None
        except CommError as exc:
            first = {"type": type(exc).__name__, "error": str(exc)}
        handle.timeout = 60.0
        handle.wait()
        report({"rank": rank, "first": first, "ok": bool((x == expect).all())})
    comm.barrier()

elif MODE == "dtype":
    refused = []
    if rank == 0:
        attempts = [
            ("all_reduce bool", lambda: comm.all_reduce(torch.ones(8, dtype=torch.bool))),
            ("all_reduce complex", lambda: comm.all_reduce(torch.ones(8, dtype=torch.complex64))),
            ("all_reduce int avg",
             lambda: comm.all_reduce(torch.ones(8, dtype=torch.int32), op="avg")),
            ("reduce_scatter int8 avg", lambda: comm.reduce_scatter(
                torch.ones(4, dtype=torch.int8), torch.ones(4 * comm.world_size, dtype=torch.int8),
                op="avg")),
            ("all_gather bool", lambda: comm.all_gather_into(
                torch.ones(4 * comm.world_size, dtype=torch.bool),
                torch.ones(4, dtype=torch.bool))),
        ]
        for label, call in attempts:
            try:
                call()
                refused.append([label, None])
            except CommError as exc:
                refused.append([label, str(exc)])
    # if any refused call had sent something, this collective would mismatch or hang
    x = torch.full((64,), float(rank + 1))
    comm.all_reduce(x)
    expect = comm.world_size * (comm.world_size + 1) / 2
    report({"rank": rank, "refused": refused, "after_ok": bool((x == expect).all())})
    # no comm.shutdown(): leaving without it must not hang (MPI's exit hook joins the
    # worker thread before mpi4py finalizes MPI)
