"""One rank of the emulated-cluster benchmark's stand-in worker (ci/bench/cluster.py).

It does, per step, the collectives a ZeRO-3 or ZeRO++ step does for a model of
``--params`` parameters, through zero-core's communicator, with no computation between
them: a measure of what the link costs each scheme, until the real stage-3 engine worker
replaces it (``ci/bench/cluster.py --worker``).

Per step, Ψ parameters, N ranks on K nodes of R ranks (payloads in bytes, per rank):

``zero3``   forward all-gather of the 16-bit parameter shard (2Ψ/N in, world group),
            backward all-gather again, reduce-scatter of 16-bit gradients (2Ψ in, world).
``zeropp``  qwZ: forward all-gather of the int8 shard with one fp32 scale per block
            (Ψ/N + 4Ψ/(N·block), world); hpZ: backward all-gather of the 16-bit secondary
            shard inside the node (2Ψ/R in, intra-node group); qgZ: int4 gradients with
            fp32 block scales exchanged by an all-to-all inside the node (Ψ/2 + scales),
            then, after the node-local reduction, across nodes among the ranks with the
            same local rank (Ψ/(2R) + scales, inter-node group).

Quantization itself is not done (only the bytes it produces are moved); buffers are
random. Each rank reports, in the protocol ci/bench/cluster.py reads:
``step_times_s`` (timed steps, seconds), ``ledger`` (zero-core ledger difference over the
timed steps), and on local rank 0 ``link_tx_bytes``: what this node's veth sent during the
timed steps (read from /sys inside the namespace; None outside an emulated cluster).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from zero_core.runtime.context import init_distributed, shutdown
from zero_core.testing.ranks import report

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def padded(numel: int, multiple: int) -> int:
    """*numel* rounded up to a multiple of *multiple* (collectives split evenly)."""
    return -(-numel // multiple) * multiple


def quantized_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of *numel* values block-quantized to *bits* with one fp32 scale per block."""
    return numel * bits // 8 + 4 * (-(-numel // block))


def link_tx_bytes() -> int | None:
    """Bytes this node's link end has sent (GLOO_SOCKET_IFNAME's counter), if there is one."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as fh:
            return int(fh.read())
    except (OSError, TypeError, ValueError):
        return None


def zero3_step(comm, params: int, dtype) -> callable:
    n = comm.world_size
    total = padded(params, n)
    shard = torch.randn(total // n).to(dtype)
    full = torch.empty(total, dtype=dtype)
    grads = torch.randn(total).to(dtype)
    grad_shard = torch.empty(total // n, dtype=dtype)

    def step():
        comm.all_gather_into(full, shard)            # forward
        comm.all_gather_into(full, shard)            # backward re-gather
        comm.reduce_scatter(grad_shard, grads, op="avg")
    return step


def zeropp_step(comm, params: int, dtype, block: int) -> callable:
    n, topo = comm.world_size, comm.topology
    r, k = topo.ranks_per_node, topo.num_nodes
    intra, inter = comm.intra_node_group(), comm.inter_node_group()
    total = padded(params, n * block)
    # qwZ: int8 shard + scales, carried as one byte buffer
    qw_shard = torch.randint(-127, 128, (quantized_bytes(total // n, 8, block),), dtype=torch.int8)
    qw_full = torch.empty(qw_shard.numel() * n, dtype=torch.int8)
    # hpZ: 16-bit secondary shard, gathered inside the node
    hp_shard = torch.randn(total // r).to(dtype)
    hp_full = torch.empty(total, dtype=dtype)
    # qgZ: int4 gradients + scales; hop 1 inside the node, hop 2 across nodes
    hop1_bytes = padded(quantized_bytes(total, 4, block), r)
    hop2_bytes = padded(quantized_bytes(total // r, 4, block), k)
    g1_in = torch.randint(-8, 8, (hop1_bytes,), dtype=torch.int8)
    g1_out = torch.empty_like(g1_in)
    g2_in = torch.randint(-8, 8, (hop2_bytes,), dtype=torch.int8)
    g2_out = torch.empty_like(g2_in)

    def step():
        comm.all_gather_into(qw_full, qw_shard)                    # forward, qwZ
        comm.all_gather_into(hp_full, hp_shard, group=intra)       # backward, hpZ
        comm.all_to_all_single(g1_out, g1_in, group=intra)         # qgZ hop 1
        comm.all_to_all_single(g2_out, g2_in, group=inter)         # qgZ hop 2
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=("zero3", "zeropp"), required=True)
    p.add_argument("--params", type=int, default=4_000_000, help="model parameters (count)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of parameters/gradients on the wire in ZeRO-3")
    p.add_argument("--block", type=int, default=256, help="quantization block (elements)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--comm", default="gloo")
    a = p.parse_args()

    rt = init_distributed(accelerator="cpu", comm_backend=a.comm)
    comm = rt.comm
    dtype = DTYPES[a.dtype]
    step = (zero3_step(comm, a.params, dtype) if a.variant == "zero3"
            else zeropp_step(comm, a.params, dtype, a.block))
    for _ in range(a.warmup):
        step()
    comm.barrier()
    ledger0, link0 = comm.ledger.snapshot(), link_tx_bytes()
    times = []
    for _ in range(a.steps):
        comm.barrier()  # steps start together: a step's time is then the slowest rank's
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    comm.barrier()
    link1 = link_tx_bytes()
    out = {"rank": comm.rank, "variant": a.variant, "params": a.params,
           "world_size": comm.world_size, "ranks_per_node": comm.topology.ranks_per_node,
           "step_times_s": times,
           "ledger": comm.ledger.difference(comm.ledger.snapshot(), ledger0),
           "link_tx_bytes": (link1 - link0 if link0 is not None and link1 is not None
                             and comm.launch.local_rank == 0 else None)}
    report(out)
    shutdown()


if __name__ == "__main__":
    main()
