"""Multi-rank worker for tests/test_zeropp_collectives.py: the ZeRO++ strategies (qwZ
gather, hpZ secondary gathers, qgZ two-hop reduction and its fallbacks, the quantized
write-back) driven directly on stand-in fetch units with random values.

Every rank's input is generated from a seed and the rank number, so each rank rebuilds
every other rank's input locally and computes the exact answer in float64 without any
communication; the report holds measured errors next to the bounds derived from the
same data (see the test module for the derivation). Run with ZERO_CORE_RANKS_PER_NODE set.
"""
from __future__ import annotations

import logging

import torch

from zero_core.runtime.context import get_runtime, init_distributed, shutdown
from zero_core.stage3.units import FetchUnit
from zero_core.testing.ranks import report
from zero_core.zeropp.fetch import UnitFetch
from zero_core.zeropp.hpz import SecondaryPartitions, hpz_group
from zero_core.zeropp.qgz import TwoHopGradientReduce
from zero_core.zeropp.qwz import QuantizedGather
from zero_core.zeropp.strategies import quantization_kernels
from zero_core.zeropp.wire import QGZ_BLOCK, QWZ_BLOCK, slot_bytes


def rank_values(seed: int, rank: int, numel: int) -> torch.Tensor:
    """Rank *rank*'s random values: mixed magnitudes per region, one outlier, some zeros."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=gen, dtype=torch.float64)
    x *= torch.exp(torch.randn(numel // 64 + 1, generator=gen, dtype=torch.float64)
                   ).repeat_interleave(64)[:numel]
    x[int(torch.randint(numel, (1,), generator=gen))] *= 50.0
    x[:17] = 0.0
    return x.float()


def unit(index: int, padded: int, part: torch.Tensor, trainable=True) -> FetchUnit:
    u = FetchUnit(index=index, group=0 if trainable else -1, persistent=False)
    u.padded_numel, u.numel = padded, padded
    u.names = [f"stand_in_{index}"]
    u.part = part
    return u


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, max |x| over its block (blocks of *block* from the start of *x*)."""
    pad = (-x.numel()) % block
    xb = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, block)
    return xb.amax(dim=1).repeat_interleave(block)[:x.numel()]


def check_qwz(comm, kernels, out):
    n, rank = comm.world_size, comm.rank
    shard = 1000 + 8          # not a multiple of the block: a partial last block per rank
    parts = [rank_values(1, r, shard) for r in range(n)]
    qwz = QuantizedGather(comm, kernels)
    full = torch.empty(n * shard)
    before = comm.ledger.snapshot()
    qwz.gather(parts[rank].clone(), full).wait()
    diff = comm.ledger.difference(comm.ledger.snapshot(), before)
    exact = torch.cat(parts).double()
    bound = torch.cat([block_absmax(p.double(), QWZ_BLOCK) for p in parts]) / 254 * (1 + 1e-5)
    err = (full.double() - exact).abs()
    out["qwz"] = {"max_err_over_bound": float((err / bound.clamp_min(1e-30)).max()),
                  "mean_err": float(err.mean()), "nonzero_err": bool((err > 0).any()),
                  "zeros_exact": bool((full.view(n, shard)[:, :17] == 0).all()),
                  "ops": diff["ops"], "expected_sent": (n - 1) * slot_bytes(shard, 8, QWZ_BLOCK)}


def check_fetch_and_hpz(comm, kernels, out):
    n, rank, r = comm.world_size, comm.rank, comm.topology.ranks_per_node
    padded = n * 512
    parts = [rank_values(2, q, padded // n) for q in range(n)]
    u = unit(0, padded, parts[rank].clone())
    u.master_part = u.part.clone()
    group = hpz_group(comm, r)
    sec = SecondaryPartitions(comm, group, [u], torch.float32, torch.device("cpu"))
    fetch = UnitFetch(comm, QuantizedGather(comm, kernels), False, sec)
    snaps = []

    def gather(for_compute):
        before = comm.ledger.snapshot()
        full, handle = fetch.launch(u, for_compute)
        handle.wait()
        snaps.append(comm.ledger.difference(comm.ledger.snapshot(), before))
        return full

    first = gather(True)     # world, quantized; refreshes the secondary
    second = gather(True)    # node-local from the secondary
    exact = gather(False)    # exact request: the secondary is lossy, so world and exact
    sec.invalidate_all()
    third = gather(True)     # world again after the "step"
    # quantized write-back: a modifier changes 5 elements of every rank's slice
    u.mark_inflight(first.clone(), None)   # stands for a gathered copy
    shard = padded // n
    touched = torch.arange(n)[:, None] * shard + torch.tensor([0, 3, 100, 200, 511])[None, :]
    u.full[touched.reshape(-1)] = 7.25
    old_part = u.part.clone()
    fetch._lossy[u.index] = True
    fetch.write_back(u)
    mine = torch.tensor([0, 3, 100, 200, 511])
    others = torch.ones(shard, dtype=torch.bool)
    others[mine] = False
    out["fetch"] = {
        "second_equals_first": bool(torch.equal(first, second)),
        "exact_is_exact": bool(torch.equal(exact, torch.cat(parts))),
        "first_is_quantized": not bool(torch.equal(first, torch.cat(parts))),
        "third_equals_first": bool(torch.equal(first, third)),
        "ledger": [{"inter": s["inter_node_bytes"], "intra": s["intra_node_bytes"],
                    "ops": sorted(s["ops"])} for s in snaps],
        "hpz_group_size": group.size, "hpz_shard_expected_bytes": padded // r * 4,
        "hpz_bytes": sec.nbytes,
        "writeback_untouched_exact": bool(torch.equal(u.part[others], old_part[others])),
        "writeback_touched_new": bool((u.part[mine] == 7.25).all()),
        "writeback_master_follows": bool(torch.equal(u.master_part, u.part)),
        "secondary_invalidated": not sec.valid(u),
    }


class Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def check_qgz(comm, kernels, out):
    n, rank = comm.world_size, comm.rank
    rpn, k = comm.topology.ranks_per_node, comm.topology.num_nodes
    cap = Capture()
    logging.getLogger("zero_core.zeropp").addHandler(cap)
    logging.getLogger("zero_core.zeropp").setLevel(logging.INFO)
    qgz = TwoHopGradientReduce(comm, kernels)
    res = {}
    # S = 1000: not a multiple of the block (padded chunks); S = 2048: whole blocks
    for label, s in (("padded_chunks", 1000), ("whole_blocks", 2048)):
        grads = [rank_values(3 + s, q, n * s) for q in range(n)]
        u = unit(10 + s, n * s, torch.empty(s))
        output = torch.empty(s)
        before = comm.ledger.snapshot()
        qgz(u, output, grads[rank].clone()).wait()
        diff = comm.ledger.difference(comm.ledger.snapshot(), before)
        # the exact answer and the bound (see the test module's docstring)
        chunks = [g.double().narrow(0, rank * s, s) for g in grads]
        exact = sum(chunks)
        step = [block_absmax(c, QGZ_BLOCK) / 14 for c in chunks]
        bound = torch.zeros(s, dtype=torch.float64)
        for node in range(k):
            members = range(node * rpn, (node + 1) * rpn)
            node_exact = sum(chunks[m] for m in members)
            hop1 = sum(step[m] for m in members)
            bound += hop1 + (block_absmax(node_exact, QGZ_BLOCK) + block_absmax(hop1, QGZ_BLOCK)) / 14
        bound = bound * (1 + 1e-5) + 1e-6 * sum(c.abs() for c in chunks)
        err = (output.double() - exact).abs()
        sp = -(-s // QGZ_BLOCK) * QGZ_BLOCK
        res[label] = {
            "max_err_over_bound": float((err / bound).max()),
            "rel_err": float(err.norm() / exact.norm()),
            "intra": diff["intra_node_bytes"], "inter": diff["inter_node_bytes"],
            "expected_intra": (rpn - 1) * slot_bytes(k * sp, 4, QGZ_BLOCK),
            "expected_inter": (k - 1) * slot_bytes(sp, 4, QGZ_BLOCK),
            "bf16_reduce_scatter_bytes": (n - 1) * n * s * 2 // n,
        }
    # a unit whose chunk is below one block falls back to the exact reduce-scatter, and
    # says why once
    s = 32
    grads = [rank_values(99, q, n * s) for q in range(n)]
    u = unit(500, n * s, torch.empty(s))
    outs = []
    for _ in range(2):
        output = torch.empty(s)
        qgz(u, output, grads[rank].clone()).wait()
        outs.append(output)
    exact = sum(g.double().narrow(0, rank * s, s) for g in grads)
    res["fallback"] = {
        "max_abs_err": float((outs[0].double() - exact).abs().max()),
        "scale": float(exact.abs().max()),
        "log_lines": [ln for ln in cap.lines if "ordinary reduce-scatter" in ln],
        "fallback_reductions": qgz.fallback_reductions,
    }
    # NaN in one rank's gradient block: that block of the result is NaN everywhere
    s = 1024
    grads = [rank_values(7, q, n * s) for q in range(n)]
    grads[n - 1].view(n, s)[:, 5] = float("nan")   # the last rank: a NaN in every chunk
    output = torch.empty(s)
    qgz(unit(600, n * s, torch.empty(s)), output, grads[rank].clone()).wait()
    res["nan"] = {"first_block_all_nan": bool(output[:QGZ_BLOCK].isnan().all()),
                  "rest_finite": bool(output[QGZ_BLOCK:].isfinite().all())}
    out["qgz"] = res


def main():
    init_distributed(accelerator="cpu")
    rt = get_runtime()
    comm = rt.comm
    kernels = quantization_kernels(rt.kernels)
    out = {"rank": comm.rank, "kernel_set": rt.kernels.name,
           "quantize_impl": rt.kernels.info.get("quantize")}
    check_qwz(comm, kernels, out)
    check_fetch_and_hpz(comm, kernels, out)
    check_qgz(comm, kernels, out)
    report(out)
    shutdown()


if __name__ == "__main__":
    main()
