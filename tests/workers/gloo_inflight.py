"""Rank program for tests/test_gloo_async_inflight.py: two asynchronous collectives in
flight on one gloo group, then both waited, through zero-core's communicator and through
plain torch.distributed, checked element for element.

Usage: ``gloo_inflight.py SEED ITERATIONS``. Every rank rebuilds every rank's seeded input,
so each result is compared with what it must be exactly (reductions on integer-valued
floats, exact in fp32). Sizes are random each iteration and, every other iteration, the two
collectives carry the same number of bytes, so that a message delivered into the other
collective's buffer would not fail on a size check but show as wrong data.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from zero_core.runtime import registry
from zero_core.runtime.launch import discover
from zero_core.runtime.topology import resolve_ranks_per_node
from zero_core.testing.ranks import report

SEED, ITERATIONS = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
launch = discover()
comm = registry.load().communicator_class("gloo")(
    launch, resolve_ranks_per_node(launch.world_size, launch.local_world_size), timeout=120)
n, rank = comm.world_size, comm.rank


def data(seed: int, r: int, k: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + r)
    return torch.randint(-50, 50, (k,), generator=g).to(dtype)


def p2p_all_gather(out, inp):
    """An all-gather as plain torch point-to-point messages (what GlooCommunicator sends)."""
    ops = []
    for p in range(n):
        if p != rank:
            ops.append(dist.P2POp(dist.isend, inp, p))
            ops.append(dist.P2POp(dist.irecv, out[p * inp.numel():(p + 1) * inp.numel()], p))
    works = dist.batch_isend_irecv(ops)
    out[rank * inp.numel():(rank + 1) * inp.numel()].copy_(inp)
    return works


class Op:
    """One collective of a pair: its kind, input, output and the exact expected output."""

    def __init__(self, kind: str, seed: int, k: int, dtype):
        ins = [data(seed, r, k * n, dtype) for r in range(n)]
        self.kind = kind
        if kind in ("all_gather", "gather", "p2p_all_gather"):
            ins = [x[:k] for x in ins]
            self.want = torch.cat(ins)
        elif kind == "all_to_all":
            self.want = torch.cat([x.view(n, k)[rank] for x in ins])
        elif kind == "reduce_scatter":
            self.want = torch.stack(ins).sum(0).view(n, k)[rank]
        else:  # all_reduce
            self.want = torch.stack(ins).sum(0)
        self.input = ins[rank].clone()
        self.out = torch.empty_like(self.want)

    def start_zero_core(self):
        f = {"all_gather": comm.all_gather_into, "all_to_all": comm.all_to_all_single,
             "reduce_scatter": comm.reduce_scatter}.get(self.kind)
        if self.kind == "all_reduce":
            self.out = self.input
            return [comm.all_reduce(self.input, async_op=True)]
        return [f(self.out, self.input, async_op=True)]

    def start_torch(self):
        if self.kind == "all_gather":
            return [dist.all_gather_into_tensor(self.out, self.input, async_op=True)]
        if self.kind == "p2p_all_gather":
            return p2p_all_gather(self.out, self.input)
        if self.kind == "all_to_all":
            return [dist.all_to_all_single(self.out, self.input, async_op=True)]
        if self.kind == "gather":  # into separate buffers on rank 0
            self.parts = [torch.empty_like(self.input) for _ in range(n)] if rank == 0 else None
            return [dist.gather(self.input, self.parts, dst=0, async_op=True)]
        self.out = self.input
        return [dist.all_reduce(self.input, async_op=True)]

    def result(self):
        if self.kind == "gather":
            return torch.cat(self.parts) if rank == 0 else self.want
        return self.out


PAIRS = {
    "zero_core": [("all_to_all", "all_gather"), ("all_gather", "all_to_all"),
                  ("all_gather", "all_gather"), ("reduce_scatter", "all_gather"),
                  ("all_reduce", "all_gather"), ("all_to_all", "all_to_all")],
    "torch": [("all_to_all", "all_gather"), ("all_gather", "all_gather"),
              ("gather", "gather"), ("all_to_all", "p2p_all_gather"),
              ("p2p_all_gather", "p2p_all_gather")],
}
checks, wrong = 0, []
for api, pairs in PAIRS.items():
    for first, second in pairs:
        for it in range(ITERATIONS):
            seed = SEED * 7919 + it * 31 + len(wrong)
            g = torch.Generator().manual_seed(seed)
            k1, k2 = (int(x) for x in torch.randint(1, 3000, (2,), generator=g))
            if it % 2:        # the same bytes on the wire for both
                k1 = 4 * k2
            ops = [Op(first, seed, k1, torch.uint8 if "gather" in first or first == "all_to_all"
                      else torch.float32), Op(second, seed + 1, k2, torch.float32)]
            handles = [h for op in ops for h in getattr(op, "start_" + api)()]
            for h in handles:
                h.wait()
            for op in ops:
                checks += 1
                if not torch.equal(op.result(), op.want):
                    wrong.append(f"{api} {first}+{second} it {it} ({k1}, {k2}): {op.kind} "
                                 f"{float((op.result() != op.want).float().mean()):.2f} off")
report({"rank": rank, "checks": checks, "wrong": wrong[:20]})
