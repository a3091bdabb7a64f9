"""Bytes one rank moves per optimizer step, by link class: intra-node, inter-node, host↔device
and disk.

The collectives' bytes are the ledger's convention (ARCHITECTURE §4; ``interfaces/ledger.py``):
a collective on a group that spans nodes counts all of this rank's sent bytes as
inter-node, so on more than one node every world-group collective is inter-node, and on one
node everything is intra-node. Sources, so that each figure has one definition:

- stages 0–2: ``zero_core.memory.comm_bytes_per_step`` on the padded layout;
- stage 3: ``zero_core.zeropp.volume.zero3_inter_node_bytes`` on the engine's fetch units
  (persistent units are gathered once per step, the others in forward and again in
  backward, but for those the forward leaves gathered: ``Layout.kept_for_backward``);
- ZeRO++ (qwZ + hpZ + qgZ, several nodes): ``zeropp_inter_node_bytes`` for what crosses
  nodes; what stays in the node is hpZ's backward all-gather, (H-1)·P/H elements per
  non-persistent unit, and qgZ's first hop, (R-1) int4 slots of K chunks per unit — an
  estimate of the wire format (``zeropp/wire.py``), not yet checked against the ledger;
- every stage adds the norm all-reduce (``volume.norm_allreduce_bytes``).

Offload moves, per step, the reduced gradient partition down to the host and the updated
parameter partition back up (host↔device); with nvme the master and optimizer states are
also read from and written back to disk once per step, and at stage 3 the parameter
partitions are read for every gather and written once.
"""
from __future__ import annotations

from zero_core.memory import PRECISION_BYTES, comm_bytes_per_step
from zero_core.partitioning.layout import round_up
from zero_core.plan.memory import Layout
from zero_core.zeropp.volume import norm_allreduce_bytes, zero3_inter_node_bytes, \
    zeropp_inter_node_bytes
from zero_core.zeropp.wire import QGZ_BITS, QGZ_BLOCK, slot_bytes


def collective_bytes(lay: Layout, stage: int, world_size: int, ranks_per_node: int,
                     precision: str, zeropp: bool = False) -> dict:
    """{"intra": bytes, "inter": bytes} per rank and step (module docstring)."""
    n, r = world_size, ranks_per_node
    nodes = n // r
    b = PRECISION_BYTES[precision]
    if n == 1:
        return {"intra": 0, "inter": 0}
    if stage < 3:
        total = comm_bytes_per_step(stage, lay.padded, n, precision) + norm_allreduce_bytes(n)
        return {"intra": total, "inter": 0} if nodes == 1 else {"intra": 0, "inter": total}
    every = [p for p, _ in lay.units]
    regathered = lay.regathered
    if not zeropp or nodes == 1:
        total = zero3_inter_node_bytes(every, regathered, every, n, b)
        return {"intra": total, "inter": 0} if nodes == 1 else {"intra": 0, "inter": total}
    quantized = [p for p in every if p // n >= QGZ_BLOCK]    # smaller chunks fall back
    fallback = [p for p in every if p // n < QGZ_BLOCK]
    inter = zeropp_inter_node_bytes(every, quantized, n, r)
    inter += sum((n - 1) * p * b // n for p in fallback)
    intra = sum((r - 1) * (p // r) * b for p in regathered)
    intra += sum((r - 1) * nodes * slot_bytes(round_up(p // n, QGZ_BLOCK), QGZ_BITS, QGZ_BLOCK)
                 for p in quantized)
    return {"intra": intra, "inter": inter}


def offload_bytes(lay: Layout, states: dict, world_size: int, precision: str,
                  offload: str, stage: int = 0) -> dict:
    """{"host_device": bytes, "disk": bytes} per rank and step for *offload* none/cpu/nvme."""
    if offload == "none":
        return {"host_device": 0, "disk": 0}
    # the reduced gradient partition down, the updated parameter partition up, each in
    # the compute dtype (the gradient accumulator's dtype is the compute dtype by default)
    b = PRECISION_BYTES[precision]
    host_device = 2 * lay.padded / world_size * b
    if offload != "nvme":
        return {"host_device": host_device, "disk": 0}
    disk = 2 * (states["master_weights"] + states["optimizer_states"])
    if stage == 3:
        # the parameter partitions: read for every gather (as collective_bytes counts
        # them), written once after the step
        every = sum(p for p, _ in lay.units)
        regathered = sum(lay.regathered)
        disk += (every + regathered + every) / world_size * b
    return {"host_device": host_device, "disk": disk}
