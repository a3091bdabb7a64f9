"""Communication micro-benchmark: zero-core gloo, zero-core mpi, zero-core oneccl and raw
torch.distributed gloo, side by side, on ZeRO's collectives.

    python ci/bench/comm.py --launch 2            # re-launches itself: mpirun -np 2 ...
    mpirun -np 4 python ci/bench/comm.py --quick  # or under a launcher of your own

Run under mpirun so that both MPI and gloo are usable in one job (gloo's rendezvous goes
through MPI). The oneccl rows are measured when oneCCL is installed on every rank (see
backends/comm/oneccl.py); otherwise the table says why they are missing. For each
collective and size it reports, like nccl-tests, the median time of several iterations
(after warm-up; the slowest rank's median), the algorithm bandwidth ``size / time`` and
the bus bandwidth ``algbw x factor`` with factor (n-1)/n for all_gather, reduce_scatter
and all_to_all and 2(n-1)/n for all_reduce, so that bus bandwidths of different
collectives compare with the link's speed. "size" is the full buffer: all_gather's output,
reduce_scatter's input, all_reduce's and all_to_all's buffer. The table goes to stdout as
markdown, the numbers to --json and a chart of bus bandwidth against size to --plot
(default docs/images/comm.json and .png; ``--replot JSON`` redraws it; ci/bench/plots.py).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plots  # noqa: E402  (JSON and PNG beside the table)

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
IMPLS = ("zero-core gloo", "zero-core mpi", "zero-core oneccl", "torch gloo (raw)")
BUSBW_FACTOR = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                "all_to_all": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n}


def parse_size(text: str) -> int:
    """'4K', '16M', '1G' or a number of bytes -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def sizes_for(args) -> list[int]:
    step = 16 if args.quick else 4
    sizes, size = [], 4 << 10
    while size <= args.max_size:
        sizes.append(size)
        size *= step
    return sizes


def iterations_for(nbytes: int, args) -> int:
    """More iterations for small messages (their times are tiny and noisy)."""
    if args.iters:
        return args.iters
    if nbytes <= 1 << 20:
        return 40
    if nbytes <= 16 << 20:
        return 15
    return 7


# ---- inside the ranks -------------------------------------------------------------------

def run_rank(args) -> dict:
    import torch
    import torch.distributed as dist

    from zero_core.backends.comm.mpi import MpiCommunicator
    from zero_core.backends.comm.oneccl import OneCclCommunicator
    from zero_core.backends.comm.torch_dist import GlooCommunicator
    from zero_core.runtime.launch import discover
    from zero_core.runtime.topology import resolve_ranks_per_node

    torch.set_num_threads(1)
    launch = discover()
    if not launch.is_mpi:
        raise SystemExit("run under mpirun (or use --launch N), so that MPI and gloo both work")
    topology = resolve_ranks_per_node(launch.world_size, launch.local_world_size)
    mpi = MpiCommunicator(launch, topology, timeout=600)
    gloo = GlooCommunicator(launch, topology, timeout=600)  # initializes torch.distributed
    n, rank = launch.world_size, launch.rank
    # oneccl only where every rank has it (its creation is collective)
    ccl_ok, ccl_why = OneCclCommunicator.availability()
    ccl_everywhere = mpi.world.handle.allreduce(int(ccl_ok), op=mpi._mpi.MIN)
    ccl = OneCclCommunicator(launch, topology, timeout=600) if ccl_everywhere else None
    skipped = {} if ccl else {"zero-core oneccl": ccl_why or "not available on every rank"}
    names = [k for k in IMPLS if k not in skipped]
    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()

    def collectives(comm):
        return {
            "all_gather": lambda b: comm.all_gather_into(b["full"], b["shard"]),
            "reduce_scatter": lambda b: comm.reduce_scatter(b["shard"], b["full"]),
            "all_reduce": lambda b: comm.all_reduce(b["full"]),
            "all_to_all": lambda b: comm.all_to_all_single(b["out"], b["full"]),
        }

    raw_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    raw_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    raw = {
        "all_gather": lambda b: raw_ag(b["full"], b["shard"]),
        "reduce_scatter": lambda b: raw_rs(b["shard"], b["full"]),
        "all_reduce": lambda b: dist.all_reduce(b["full"]),
        "all_to_all": lambda b: dist.all_to_all_single(b["out"], b["full"]),
    }
    impls = {"zero-core gloo": (collectives(gloo), gloo.barrier),
             "zero-core mpi": (collectives(mpi), mpi.barrier),
             "torch gloo (raw)": (raw, dist.barrier)}
    if ccl is not None:
        impls["zero-core oneccl"] = (collectives(ccl), ccl.barrier)

    # sanity: every implementation computes the right thing before it is timed
    for name, (fns, _) in impls.items():
        b = {"full": torch.ones(n * 8, dtype=dtype), "shard": torch.ones(8, dtype=dtype),
             "out": torch.empty(n * 8, dtype=dtype)}
        fns["all_reduce"](b)
        if not bool((b["full"] == n).all()):
            raise SystemExit(f"{name}: all_reduce gave a wrong result")

    results = []
    for size in sizes_for(args):
        numel = max(n, size // elem // n * n)
        buffers = {"full": torch.randn(numel).to(dtype), "shard": torch.randn(numel // n).to(dtype),
                   "out": torch.empty(numel, dtype=dtype)}
        iters = iterations_for(size, args)
        for op in OPS:
            row = {"op": op, "bytes": numel * elem, "iters": iters}
            for name in names:
                for _ in range(args.warmup):
                    impls[name][0][op](buffers)
            # implementations take turns in every iteration, so that the load of other
            # processes on a shared machine falls on all of them alike
            times = {name: [] for name in names}
            for _ in range(iters):
                for name in names:
                    fns, barrier = impls[name]
                    barrier()
                    t0 = time.perf_counter()
                    fns[op](buffers)
                    times[name].append(time.perf_counter() - t0)
            for name in names:
                # the collective is as slow as its slowest rank
                row[name] = mpi.world.handle.allreduce(statistics.median(times[name]),
                                                       op=mpi._mpi.MAX)
            results.append(row)
            if rank == 0 and args.progress:
                print(f"  {human(row['bytes']):>9} {op:<15} " + "  ".join(
                    f"{k}: {row[k] * 1e3:.3f} ms" for k in names), file=sys.stderr, flush=True)
        del buffers
    if ccl is not None:
        ccl.shutdown()
    gloo.shutdown()
    mpi.shutdown()
    dist.destroy_process_group()
    return {"world_size": n, "dtype": args.dtype, "results": results,
            "torch": torch.__version__, "impls": names, "skipped": skipped}


# ---- reporting --------------------------------------------------------------------------

def enrich(data: dict) -> dict:
    """Add algbw / busbw (GB/s, 1e9 bytes) to every measurement."""
    n = data["world_size"]
    impls = data.get("impls", IMPLS)
    for row in data["results"]:
        row["measurements"] = {}
        for name in impls:
            seconds = row.pop(name)
            algbw = row["bytes"] / seconds / 1e9
            row["measurements"][name] = {"time_ms": seconds * 1e3, "algbw_GBps": algbw,
                                         "busbw_GBps": algbw * BUSBW_FACTOR[row["op"]](n)}
        row["fastest"] = min(impls, key=lambda k: row["measurements"][k]["time_ms"])
    return data


def markdown(data: dict) -> str:
    n = data["world_size"]
    impls = data.get("impls", IMPLS)
    lines = [f"Collectives on {n} ranks, {data['dtype']}, median of the slowest rank "
             f"(time in ms, algbw / busbw in GB/s):", ""]
    for name, why in data.get("skipped", {}).items():
        lines += [f"{name} not measured: {why}", ""]
    for op in OPS:
        lines.append(f"**{op}** (busbw factor {BUSBW_FACTOR[op](n):g})")
        lines.append("")
        head = "| size | " + " | ".join(f"{k} ms | algbw | busbw" for k in impls) + " | fastest |"
        lines.append(head)
        lines.append("|" + "---|" * (2 + 3 * len(impls)))
        for row in (r for r in data["results"] if r["op"] == op):
            cells = []
            for k in impls:
                m = row["measurements"][k]
                cells.append(f"{m['time_ms']:.3f} | {m['algbw_GBps']:.2f} | {m['busbw_GBps']:.2f}")
            lines.append(f"| {human(row['bytes'])} | " + " | ".join(cells)
                         + f" | {row['fastest']} |")
        lines.append("")
    lines.append(summary(data))
    return "\n".join(lines)


def summary(data: dict) -> str:
    """Geometric-mean time ratio of each implementation to the fastest, per collective,
    over messages of 1 MiB and more (the bucket sizes ZeRO uses)."""
    impls = data.get("impls", IMPLS)
    out = ["Geometric mean of time / best time over sizes >= 1 MiB (1.00 = always fastest):", ""]
    out.append("| collective | " + " | ".join(impls) + " |")
    out.append("|" + "---|" * (1 + len(impls)))
    for op in OPS:
        rows = [r for r in data["results"] if r["op"] == op and r["bytes"] >= 1 << 20]
        if not rows:
            continue
        ratios = []
        for k in impls:
            logs = [math.log(r["measurements"][k]["time_ms"] /
                             min(r["measurements"][j]["time_ms"] for j in impls)) for r in rows]
            ratios.append(f"{math.exp(sum(logs) / len(logs)):.2f}")
        out.append(f"| {op} | " + " | ".join(ratios) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launch", type=int, metavar="N",
                   help="re-launch this script under mpirun with N ranks and print the table")
    p.add_argument("--quick", action="store_true", help="fewer sizes (x16 steps)")
    p.add_argument("--max-size", type=parse_size, default=parse_size("256M"),
                   help="largest buffer, e.g. 64M (default 256M)")
    p.add_argument("--dtype", default="float32", help="torch dtype name (default float32)")
    p.add_argument("--iters", type=int, default=0, help="timed iterations (default: by size)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--progress", action="store_true", help="print each row as it is measured")
    # internal: set by --launch on the ranks it starts, so that rank 0 hands the data back
    p.add_argument("--report", action="store_true", help=argparse.SUPPRESS)
    plots.add_arguments(p, "comm")
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    meta = None if args.report else plots.start(args, "comm", __file__, argv)

    if args.launch:
        from zero_core.testing.ranks import run_ranks
        i = argv.index("--launch")
        forward = argv[:i] + argv[i + 2:]
        results = run_ranks(os.path.abspath(__file__), args.launch, launcher="mpirun",
                            args=forward + ["--report"], timeout=3600)
        data = results[0].report
        if data is None:
            print(results[0].log, file=sys.stderr)
            return 1
    else:
        from zero_core.runtime.launch import discover
        data = run_rank(args)
        if discover().rank != 0:
            return 0
        if args.report:
            from zero_core.testing.ranks import report
            report(data)
            return 0
    data = enrich(data)
    ranks = data["world_size"]
    command = (f"python ci/bench/comm.py {' '.join(argv)}" if args.launch else
               f"mpirun -np {ranks} python ci/bench/comm.py {' '.join(argv)}")
    print(f"command: {command}")
    print(f"torch {data['torch']}, {ranks} ranks\n")
    print(markdown(data))
    print()
    if not args.launch:
        meta["command"] = command
    plots.finish(args, "comm", {"benchmark": "comm", **data}, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
