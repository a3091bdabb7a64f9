"""Rank program: the conformance suite on the oneccl communicator, then oneCCL-specific
checks against references each rank computes itself, in one job.

Usage: ``oneccl_checks.py SEED [faults]`` under mpirun or torchrun-style launch (any world
size; ``faults`` needs 2 ranks or more).

After the suite (every collective, dtype and reduce op on small inputs, refusals, async,
groups, ledger), the same communicator runs: large random buffers whose size is not a
multiple of the world size (fp32 with every op, bf16 sums within the rounding bound), the
dtypes the suite does not cover (int32, int64, fp64), in-place and aliased buffers
(all-gather into its own output, reduce-scatter into its own input, all-to-all with input
and output the same tensor), empty tensors, and an average on the inter-node group (whose
group ranks are not the global ranks). Every rank can regenerate every rank's input from
(SEED, case, rank), so references are exact float64 (or int64) results of the inputs,
independent of the communicator.

With ``faults``, two more steps follow the report of the above:

- late peer: rank 0 waits for an all-reduce with a 2 s deadline while the last rank joins
  only after 4 s: the wait raises CommTimeoutError naming the collective and the group, and
  a second wait on the same handle then succeeds with the right sum;
- stuck at exit: rank 0 starts an all-reduce that no rank joins and exits without
  shutdown(); the exit hook must end the process (exit status 1, saying why) instead of
  hanging in oneCCL's teardown. The other ranks exit normally.
"""
from __future__ import annotations

import sys
import time

import torch

from zero_core.runtime import context as runtime
from zero_core.conformance import run_conformance
from zero_core.testing.ranks import report

SEED = int(sys.argv[1])
FAULTS = sys.argv[2:] == ["faults"]
started = time.monotonic()
suite = run_conformance(comm="oneccl", timeout=60.0, seed=SEED, check_accelerators=False)
suite_seconds = time.monotonic() - started
comm = runtime.get_runtime().comm
rank, world = comm.rank, comm.world_size
failures: list[str] = []
checks = 0


def make(case: int, r: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank *r*'s input for *case*, the same on every rank that regenerates it."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + case * 101 + r)
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int32)
    if dtype == torch.int64:
        return torch.randint(-(1 << 40), 1 << 40, (numel,), generator=g, dtype=torch.int64)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * 3).to(dtype)


def reference(parts, op):
    wide = torch.float64 if parts[0].dtype.is_floating_point else torch.int64
    stack = torch.stack([p.to(wide) for p in parts])
    return {"sum": stack.sum(0), "avg": stack.mean(0) if wide == torch.float64 else None,
            "max": stack.amax(0), "min": stack.amin(0)}[op]


def expect_exact(label, got, want):
    global checks
    checks += 1
    if not torch.equal(got, want.to(got.dtype)):
        bad = (got.to(torch.float64) != want.to(torch.float64)).sum().item()
        failures.append(f"{label}: {bad} of {got.numel()} elements differ from the reference")


def expect_sum(label, got, parts, op):
    """Floating sums within the bound of any summation order: per element,
    2 * eps * n * sum(|x_i|) plus one rounding of the result."""
    global checks
    checks += 1
    want = reference(parts, op)
    eps = torch.finfo(got.dtype).eps
    sumabs = torch.stack([p.to(torch.float64).abs() for p in parts]).sum(0)
    if op == "avg":
        sumabs = sumabs / len(parts)
    bound = 2 * eps * len(parts) * sumabs + eps * want.abs() + 1e-300
    err = (got.to(torch.float64) - want).abs()
    if bool((err > bound).any()):
        failures.append(f"{label}: {(err > bound).sum().item()} elements outside the rounding "
                        f"bound (max error {err.max().item():.3g})")


case = 0
# large random buffers, sizes not multiples of the world size
big = 800_000 // world + 3          # 400_003 on 2 ranks: not a multiple of the world
for op in ("sum", "avg", "max", "min"):
    case += 1
    parts = [make(case, r, big, torch.float32) for r in range(world)]
    t = parts[rank].clone()
    comm.all_reduce(t, op=op)
    if op in ("sum", "avg"):
        expect_sum(f"all_reduce {op} fp32 {big}", t, parts, op)
    else:
        expect_exact(f"all_reduce {op} fp32 {big}", t, reference(parts, op))
case += 1
parts = [make(case, r, big // 3, torch.bfloat16) for r in range(world)]
t = parts[rank].clone()
comm.all_reduce(t)
expect_sum(f"all_reduce sum bf16 {big // 3}", t, parts, "sum")
chunk = 200_006 // world
case += 1
parts = [make(case, r, chunk * world, torch.float32) for r in range(world)]
out = torch.empty(chunk)
comm.reduce_scatter(out, parts[rank].clone(), op="avg")
expect_sum(f"reduce_scatter avg fp32 {chunk}/rank", out,
           [p[rank * chunk:(rank + 1) * chunk] for p in parts], "avg")

# the dtypes the suite does not cover
for dtype in (torch.int32, torch.int64, torch.float64):
    for op in ("sum", "max", "min"):
        case += 1
        parts = [make(case, r, 4099, dtype) for r in range(world)]
        t = parts[rank].clone()
        comm.all_reduce(t, op=op)
        if dtype.is_floating_point and op == "sum":
            expect_sum(f"all_reduce {op} {dtype}", t, parts, op)
        else:
            expect_exact(f"all_reduce {op} {dtype}", t, reference(parts, op))
    case += 1
    parts = [make(case, r, 1027, dtype) for r in range(world)]
    out = torch.empty(1027 * world, dtype=dtype)
    comm.all_gather_into(out, parts[rank].clone())
    expect_exact(f"all_gather_into {dtype}", out, torch.cat(parts))
    case += 1
    parts = [make(case, r, 1027 * world, dtype) for r in range(world)]
    out = torch.empty(1027 * world, dtype=dtype)
    comm.all_to_all_single(out, parts[rank].clone())
    expect_exact(f"all_to_all_single {dtype}", out,
                 torch.cat([p[rank * 1027:(rank + 1) * 1027] for p in parts]))
    for src in range(world):
        case += 1
        t = make(case, rank, 513, dtype)
        comm.broadcast(t, src=src)
        expect_exact(f"broadcast {dtype} src={src}", t, make(case, src, 513, dtype))

# in place and aliased buffers
k = 10_007
case += 1
parts = [make(case, r, k, torch.float32) for r in range(world)]
out = torch.full((k * world,), float("nan"))
out[rank * k:(rank + 1) * k] = parts[rank]
comm.all_gather_into(out, out[rank * k:(rank + 1) * k])
expect_exact("all_gather_into in place (input is this rank's chunk of output)", out,
             torch.cat(parts))
case += 1
parts = [make(case, r, k * world, torch.float32) for r in range(world)]
buf = parts[rank].clone()
comm.reduce_scatter(buf[rank * k:(rank + 1) * k], buf)
expect_sum("reduce_scatter in place (output is this rank's chunk of input)",
           buf[rank * k:(rank + 1) * k], [p[rank * k:(rank + 1) * k] for p in parts], "sum")
case += 1
parts = [make(case, r, k * world, torch.float32) for r in range(world)]
buf = parts[rank].clone()
comm.all_to_all_single(buf, buf)
expect_exact("all_to_all_single with input and output the same tensor", buf,
             torch.cat([p[rank * k:(rank + 1) * k] for p in parts]))
case += 1
c = 1009
parts = [make(case, r, c * world, torch.float32) for r in range(world)]
buf = torch.zeros(c * world + c)
buf[c:] = parts[rank]
# output buf[:c*n] and input buf[c:] share all but one chunk: not an in-place layout
comm.all_to_all_single(buf[:c * world], buf[c:])
expect_exact("all_to_all_single with overlapping input and output", buf[:c * world],
             torch.cat([p[rank * c:(rank + 1) * c] for p in parts]))

# empty tensors: nothing to do, nothing may break
empty = torch.empty(0)
comm.all_reduce(empty)
comm.all_gather_into(torch.empty(0), torch.empty(0))
comm.reduce_scatter(torch.empty(0), torch.empty(0))
comm.all_to_all_single(torch.empty(0), torch.empty(0))
comm.broadcast(empty, src=world - 1)
checks += 1

# a group whose ranks differ from the global ranks (the suite made it: no new communicator)
group = comm.inter_node_group()
if group.size > 1:
    case += 1
    parts = [make(case, r, 3001, torch.float32) for r in group.ranks]
    t = parts[group.rank].clone()
    comm.all_reduce(t, op="avg", group=group)
    expect_sum(f"all_reduce avg on ranks {list(group.ranks)}", t, parts, "avg")
comm.barrier()

result = {"rank": rank, "suite": suite.to_json(), "suite_seconds": suite_seconds,
          "checks": checks, "failures": failures, "settings": comm.settings,
          "library_version": comm.library_version, "seconds": time.monotonic() - started}
if not FAULTS:
    report(result)
    runtime.shutdown()
    sys.exit(0)

# ---- faults ----------------------------------------------------------------------------------
from zero_core.errors import CommError, CommTimeoutError  # noqa: E402

x = torch.full((1 << 16,), float(rank + 1))
total = world * (world + 1) / 2
if rank == world - 1:
    time.sleep(4.0)
    comm.all_reduce(x)
    result["late"] = {"ok": bool((x == total).all())}
elif rank == 0:
    handle = comm.all_reduce(x, async_op=True)
    handle.timeout = 2.0
    t0 = time.monotonic()
    try:
        handle.wait()
        first = None
    except CommError as exc:
        first = {"type": type(exc).__name__, "error": str(exc),
                 "is_timeout": isinstance(exc, CommTimeoutError)}
    waited = time.monotonic() - t0
    handle.timeout = 60.0
    handle.wait()
    result["late"] = {"first": first, "waited": waited, "ok": bool((x == total).all())}
else:
    comm.all_reduce(x)
    result["late"] = {"ok": bool((x == total).all())}
comm.barrier()
if rank == 0:
    comm.all_reduce(torch.ones(8), async_op=True)   # nobody joins: stuck at exit
    time.sleep(0.5)                                  # let the worker thread enter it
report(result)
sys.stdout.flush()
# no shutdown(): rank 0's exit hook must end the process although a collective is stuck
sys.exit(0)
