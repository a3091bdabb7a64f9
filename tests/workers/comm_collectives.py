"""Rank program: every collective of one communicator against float64 references.

Usage: ``comm_collectives.py BACKEND SEED`` under mpirun or torchrun-style launch.

Every rank can regenerate every other rank's input from (SEED, case, rank), so each
rank computes the expected result locally in float64 from all inputs and compares.
The rank reports the number of checks, the failures and its ledger snapshot.
"""
from __future__ import annotations

import sys

import torch

from zero_core.runtime import registry
from zero_core.runtime.launch import discover
from zero_core.runtime.context import comm_timeout
from zero_core.testing.ranks import report
from zero_core.runtime.topology import resolve_ranks_per_node

BACKEND, SEED = sys.argv[1], int(sys.argv[2])
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.float64,
          torch.int64]

launch = discover()
topology = resolve_ranks_per_node(launch.world_size, launch.local_world_size)
comm = registry.load().communicator_class(BACKEND)(launch, topology, timeout=comm_timeout())
rank, world = comm.rank, comm.world_size
failures: list[str] = []
checks = 0


def make(case: int, r: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank *r*'s input for *case*: the same on every rank that regenerates it."""
    g = torch.Generator().manual_seed(SEED * 100003 + case * 101 + r)
    if dtype == torch.uint8:
        return torch.randint(0, 40, (numel,), generator=g, dtype=torch.uint8)
    if not dtype.is_floating_point:
        return torch.randint(-30, 30, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def reduce64(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack([p.to(torch.float64) for p in parts])
    return {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.amax(0),
            "min": stack.amin(0)}[op]


def check(label: str, got: torch.Tensor, want64: torch.Tensor, parts=None, op: str = "") -> None:
    """Data movement must be bit-exact; a reduction of *parts* may differ from the float64
    reference by a few roundings of the dtype per term, bounded element-wise by
    eps * n * sum(|x_i|) (the classic bound for a sum of n terms in any order)."""
    global checks
    checks += 1
    if got.dtype.is_floating_point and parts is not None and op in ("sum", "avg"):
        eps = torch.finfo(got.dtype).eps
        sumabs = torch.stack([p.to(torch.float64).abs() for p in parts]).sum(0)
        if op == "avg":
            sumabs = sumabs / len(parts)
        bound = 2 * eps * len(parts) * sumabs + eps * want64.abs() + 1e-300
        bad = ((got.to(torch.float64) - want64).abs() > bound).sum().item()
        if bad:
            err = (got.to(torch.float64) - want64).abs().max().item()
            failures.append(f"{label}: {bad} elements outside the rounding bound "
                            f"(max error {err:.3g})")
        return
    want = want64
    if not got.dtype.is_floating_point:
        # the backends' integer sums wrap around on overflow, as a cast from int64 does
        want = want64.to(torch.int64)
    if not torch.equal(got, want.to(got.dtype)):
        failures.append(f"{label}: result differs from the reference")


def run_suite(group, case0: int) -> int:
    """Every collective on *group* for every dtype; returns the next free case number."""
    n, me = group.size, group.rank
    case = case0
    for dtype in DTYPES:
        # sizes: divisible by n, and one that only all_reduce/broadcast accept (odd size)
        shard = 37
        floating = dtype.is_floating_point
        # all_gather_into
        case += 1
        parts = [make(case, r, shard, dtype) for r in range(n)]
        out = torch.empty(shard * n, dtype=dtype)
        comm.all_gather_into(out, parts[me].clone(), group=group)
        check(f"all_gather_into {dtype} {group.name}", out, torch.cat(parts).to(torch.float64))
        # all_to_all_single: chunk j of rank i lands as chunk i on rank j
        case += 1
        parts = [make(case, r, shard * n, dtype) for r in range(n)]
        out = torch.empty(shard * n, dtype=dtype)
        comm.all_to_all_single(out, parts[me].clone(), group=group)
        want = torch.cat([parts[r][me * shard:(me + 1) * shard] for r in range(n)])
        check(f"all_to_all_single {dtype} {group.name}", out, want.to(torch.float64))
        # broadcast from every group rank
        for src in range(n):
            case += 1
            t = make(case, me, 2 * shard + 1, dtype)
            comm.broadcast(t, src=src, group=group)
            check(f"broadcast src={src} {dtype} {group.name}", t,
                  make(case, src, 2 * shard + 1, dtype).to(torch.float64))
        for op in ("sum", "avg", "max", "min"):
            if op == "avg" and not floating:
                continue
            # reduce_scatter
            case += 1
            parts = [make(case, r, shard * n, dtype) for r in range(n)]
            out = torch.empty(shard, dtype=dtype)
            comm.reduce_scatter(out, parts[me].clone(), op=op, group=group)
            full = reduce64(parts, op)
            check(f"reduce_scatter {op} {dtype} {group.name}", out,
                  full[me * shard:(me + 1) * shard],
                  [p[me * shard:(me + 1) * shard] for p in parts], op)
            # all_reduce on a size that is not a multiple of n
            case += 1
            parts = [make(case, r, shard * n + 3, dtype) for r in range(n)]
            t = parts[me].clone()
            comm.all_reduce(t, op=op, group=group)
            check(f"all_reduce {op} {dtype} {group.name}", t, reduce64(parts, op), parts, op)
    comm.barrier(group=group)
    return case


# the world, then two subgroups whose group ranks differ from the global ranks
case = run_suite(comm.world, 0)
ledger_world_default_routes = comm.ledger.snapshot()
# the other route of each backend, on the world again
if BACKEND == "mpi":
    comm.all_reduce_composite_bytes = 0        # every all_reduce as all-to-all + all-gather
    case = run_suite(comm.world, 30_000)
    del comm.all_reduce_composite_bytes
elif BACKEND == "gloo":
    comm.all_gather_via_p2p = comm.reduce_scatter_via_all_to_all = False  # torch's own calls
    case = run_suite(comm.world, 30_000)
    del comm.all_gather_via_p2p, comm.reduce_scatter_via_all_to_all
if world >= 2:
    odd_even = comm.split([[r for r in range(world) if r % 2 == p] for p in (0, 1)], "parity")
    case = run_suite(odd_even, 10_000)
    tail = comm.new_group(range(1, world), name="tail")
    if tail.is_member:
        case = run_suite(tail, 20_000)

# several async ops in flight at once, waited in reverse order
handles, expected = [], []
for k in range(4):
    parts = [make(90_000 + k, r, 1024 * world, torch.float32) for r in range(world)]
    t = parts[rank].clone()
    handles.append(comm.all_reduce(t, async_op=True))
    expected.append((t, reduce64(parts, "sum"), parts))
    out = torch.empty(1024 * world)
    handles.append(comm.all_gather_into(out, parts[rank][:1024].clone(), async_op=True))
    expected.append((out, torch.cat([p[:1024] for p in parts]).to(torch.float64), None))
    rs = torch.empty(1024)
    handles.append(comm.reduce_scatter(rs, parts[rank].clone(), async_op=True))
    expected.append((rs, reduce64(parts, "sum")[rank * 1024:(rank + 1) * 1024],
                     [p[rank * 1024:(rank + 1) * 1024] for p in parts]))
for h in reversed(handles):
    h.wait()
for i, (got, want, summed) in enumerate(expected):
    check(f"async op {i}", got, want, summed, "sum" if summed else "")

report({"rank": rank, "checks": checks, "failures": failures,
        "ledger_world_default_routes": ledger_world_default_routes})
comm.shutdown()
