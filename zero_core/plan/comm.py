"""Bytes one rank moves per optimizer step, by link class: intra-node, inter-node, host↔device
and disk.

The collectives' bytes are the ledger's convention (ARCHITECTURE §4; ``interfaces/ledger.py``):
a collective on a group that spans nodes counts all of this rank's sent bytes as
inter-node; one inside a node, as intra-node. Per rank, a ring all-gather sends (n-1)·B_in,
a reduce-scatter (n-1)/n·B_in, an all-reduce 2(n-1)/n·B (n: the group's ranks).

How the partition collectives run (``runtime/partition_comm.py``), for a unit or bucket of P
padded elements of b bytes, on N = K·L ranks (K nodes of L ranks):

- **one node** (K = 1): every collective is on the world group, intra-node:
  all-gather and reduce-scatter (N-1)·P·b/N each.
- **flat** (``node_aware_collectives: false``, several nodes): the same collectives on the
  world group, which spans nodes: (N-1)·P·b/N each, all inter-node.
- **node-aware** (the default at stages 1–3 on several nodes with L > 1): an all-gather is
  an all-gather across nodes among the K ranks of equal local rank, then one inside the
  node; a reduce-scatter the reverse::

      all-gather      inter (K-1)·P·b/N    intra (L-1)·P·b/L
      reduce-scatter  intra (L-1)·P·b/L    inter (K-1)·P·b/N

  (the inter-node part is (K-1)/(N-1) of the flat one: 1/3 at 2 nodes × 2 ranks).
- **MiCS** (``mics_shard_size`` G): the model states are partitioned over shard groups of G
  consecutive ranks, so the layout is the one at world size G (padding to G). Gathers and
  reduce-scatters run inside the shard group: (G-1)·P·b/G each, intra-node when G ≤ L
  (a shard group of whole nodes, G = K'·L, runs them as above: node-aware with
  ``mics_hierarchical_params_gather``, flat otherwise). Then, once per step, each rank
  all-reduces its reduced gradient partition (padded Ψ/G elements of the gradient dtype,
  the compute dtype by default) over its replica group of R = N/G ranks:
  2(R-1)/R·(Ψ_padded/G)·b, inter-node when the job spans nodes.

What each stage runs (the padded sizes are the engine's own layout):

- stage 0: one all-reduce of the gradients on the world group (never node-aware, never
  MiCS): ``zero_core.memory.comm_bytes_per_step``;
- stages 1–2: a reduce-scatter of every gradient bucket and an all-gather of the updated
  parameters, P = the padded total (flat / one node: ``comm_bytes_per_step``);
- stage 3: an all-gather of every unit in forward, again in backward for the units the
  forward does not leave gathered (``Layout.regathered``; persistent units are gathered
  once), a reduce-scatter of every unit (flat / one node:
  ``zero_core.zeropp.volume.zero3_inter_node_bytes``);
- ZeRO++ (qwZ + hpZ + qgZ, several nodes; qgZ switches node-aware collectives off, it has
  its own two hops): ``zeropp_inter_node_bytes`` for what crosses nodes; what stays in the
  node is hpZ's backward all-gather, (H-1)·P/H elements per non-persistent unit, and qgZ's
  first hop, (R-1) int4 slots of K chunks per unit — an estimate of the wire format
  (``zeropp/wire.py``), not yet checked against the ledger;
- every configuration adds the norm all-reduce on the whole world
  (``volume.norm_allreduce_bytes``), inter-node on several nodes.

Offload moves, per step, the reduced gradient partition down to the host and the updated
parameter partition back up (host↔device); with nvme the master and optimizer states are
also read from and written back to disk once per step, and at stage 3 the parameter
partitions are read for every gather and written once. Under MiCS the partition is the
shard group's, 1/G.
"""
from __future__ import annotations

from zero_core.memory import PRECISION_BYTES, comm_bytes_per_step
from zero_core.partitioning.layout import round_up
from zero_core.plan.memory import Layout
from zero_core.plan.model import PlanError
from zero_core.zeropp.volume import norm_allreduce_bytes, zero3_inter_node_bytes, \
    zeropp_inter_node_bytes
from zero_core.zeropp.wire import QGZ_BITS, QGZ_BLOCK, slot_bytes


def _split(group: int, ranks_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) of a partition group of *group* consecutive ranks: inside one
    node when it is at most a node, else whole nodes."""
    if group <= ranks_per_node:
        return 1, group
    return group // ranks_per_node, ranks_per_node


def all_gather_bytes(p: int, group: int, ranks_per_node: int, b: int,
                     node_aware: bool) -> tuple[float, float]:
    """(intra, inter) bytes one rank sends to all-gather *p* padded elements of *b* bytes
    partitioned over a group of *group* consecutive ranks (module docstring)."""
    k, l = _split(group, ranks_per_node)
    if group == 1:
        return 0, 0
    if k == 1:
        return (group - 1) * p * b / group, 0
    if not node_aware or l == 1:
        return 0, (group - 1) * p * b / group
    return (l - 1) * p * b / l, (k - 1) * p * b / group


def reduce_scatter_bytes(p: int, group: int, ranks_per_node: int, b: int,
                         node_aware: bool) -> tuple[float, float]:
    """(intra, inter) bytes one rank sends to reduce-scatter *p* padded elements of *b*
    bytes over a group of *group* consecutive ranks: by the ledger's convention the same
    figures as :func:`all_gather_bytes` (module docstring), the hops in reverse order."""
    return all_gather_bytes(p, group, ranks_per_node, b, node_aware)


def all_reduce_bytes(elements: float, group: int, b: int) -> float:
    """Bytes one rank sends to all-reduce *elements* of *b* bytes over *group* ranks."""
    return 2 * (group - 1) * elements * b / group if group > 1 else 0


def collective_bytes(lay: Layout, stage: int, world_size: int, ranks_per_node: int,
                     precision: str, zeropp: bool = False, node_aware: bool = True,
                     mics: int = 0) -> dict:
    """{"intra": bytes, "inter": bytes} per rank and step (module docstring).

    *lay*: the engine's layout at the partition's world size: *world_size* (N), or the shard
    size under MiCS. *node_aware*: the partition collectives run in two hops on several
    nodes (stages 1–3; ignored under ZeRO++, whose qgZ switches it off, and for a MiCS shard
    group inside one node, where it means ``mics_hierarchical_params_gather``). *mics*: the
    shard size G (0 or -1: off)."""
    n, r = world_size, ranks_per_node
    nodes = n // r
    b = PRECISION_BYTES[precision]
    if n == 1:
        return {"intra": 0, "inter": 0}
    norm = norm_allreduce_bytes(n)
    out = {"intra": 0.0, "inter": 0.0}
    out["intra" if nodes == 1 else "inter"] += norm
    mics = mics if mics and mics > 0 else 0
    if mics and (n % mics or (mics > r and mics % r)):
        raise PlanError(f"MiCS shard size {mics}: must divide the {n} ranks and lie inside one "
                        f"node of {r} ranks or be whole nodes")
    if mics and zeropp:
        raise PlanError("MiCS with ZeRO++'s hpZ and qgZ is refused by the engine "
                        "(config/zero_sections.py); plan one or the other")
    if mics and stage >= 1:
        group = mics
        replicas = n // group
    else:
        group, replicas = n, 1
    if stage == 0:
        out["intra" if nodes == 1 else "inter"] += comm_bytes_per_step(0, lay.padded, n,
                                                                       precision)
        return out
    if stage == 3 and zeropp and nodes > 1 and not mics:
        return _zeropp_bytes(lay, n, r, b)
    two_hops = node_aware and r > 1
    if not mics and (nodes == 1 or not two_hops):
        # the world group's collectives (one node, or flat on several): the ledger-checked
        # sources
        if stage < 3:
            total = comm_bytes_per_step(stage, lay.padded, n, precision)
        else:
            every = [p for p, _ in lay.units]
            total = zero3_inter_node_bytes(every, lay.regathered, every, n, b) - norm
        out["intra" if nodes == 1 else "inter"] += total
        return out
    if stage < 3:
        gathers, reduced = [lay.padded], [lay.padded]
    else:
        every = [p for p, _ in lay.units]
        gathers, reduced = every + lay.regathered, every
    for p in gathers:
        intra, inter = all_gather_bytes(p, group, r, b, two_hops)
        out["intra"] += intra
        out["inter"] += inter
    for p in reduced:
        intra, inter = reduce_scatter_bytes(p, group, r, b, two_hops)
        out["intra"] += intra
        out["inter"] += inter
    if replicas > 1:
        # the replica group (one rank of every shard group) spans nodes on several nodes
        out["intra" if nodes == 1 else "inter"] += all_reduce_bytes(lay.padded // group,
                                                                    replicas, b)
    return out


def _zeropp_bytes(lay: Layout, n: int, r: int, b: int) -> dict:
    """ZeRO++ (qwZ + hpZ + qgZ) at stage 3 on several nodes (module docstring)."""
    nodes = n // r
    every = [p for p, _ in lay.units]
    quantized = [p for p in every if p // n >= QGZ_BLOCK]    # smaller chunks fall back
    fallback = [p for p in every if p // n < QGZ_BLOCK]
    inter = zeropp_inter_node_bytes(every, quantized, n, r)
    inter += sum((n - 1) * p * b // n for p in fallback)
    intra = sum((r - 1) * (p // r) * b for p in lay.regathered)
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
