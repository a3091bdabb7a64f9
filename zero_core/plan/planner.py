"""The plan: every candidate configuration of one model on one cluster, predicted, ranked,
and the best one written as a DeepSpeed-style config.

Candidates: stages 0–3; at stages 1–3 also with ``offload_optimizer`` to cpu and to nvme
(at stage 3 with ``offload_param`` to the same place); at stage 3 on more than one node also
ZeRO++ (qwZ + hpZ over the node's ranks + qgZ). ZeRO++ on one node is not offered: qgZ falls
back to the plain reduce-scatter there and hpZ's partition would be the primary one.

On more than one node (K nodes of L > 1 ranks) the stage 1–3 candidates are the engine's
default there, node-aware collectives (``node_aware_collectives``: every partition
all-gather across nodes then inside the node, every reduce-scatter the reverse; labelled
"node-aware"), and MiCS is offered too at stages 1–3 without offload: ``mics_shard_size``
G = L, labelled "MiCS(G)" — the model states of plain ZeRO at world size G (the layout,
padding included, is the engine's at G), gathers and reduce-scatters inside the node, one
all-reduce of the gradient partition across the N/G copies (``comm.py``). The flat
collectives across nodes (``node_aware_collectives: false``) are not offered: by the byte
model they never beat node-aware ones while a rank's intra-node bandwidth is at least its
inter-node one (node-aware moves (K-1)/(N-1) of the flat inter-node bytes and the rest,
(L-1)·P·b/L, inside the node); :func:`evaluate` predicts them with ``node_aware=False``.
Stage 0 (one all-reduce on the world) and ZeRO++ (qgZ has its own two hops) are neither.

A candidate fits when its device bytes per rank (model states left on the device, hpZ,
activations, buffers) are within the device memory, its host bytes times the ranks of a node
within the node's host memory (plus the device bytes where devices are host memory), and
its disk bytes times the ranks of a node within the node's disk. Ranking: candidates that
fit before those that do not, then by predicted step time, then by device bytes.

The recommended config (:func:`ds_config`) carries what the candidate needs beyond the
defaults: ``offload_*``, the ZeRO++ keys, ``mics_shard_size`` for MiCS, and
``node_aware_collectives: false`` only for a flat candidate on several nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zero_core.plan import comm as plan_comm
from zero_core.plan import memory as plan_memory
from zero_core.plan.cluster import Cluster
from zero_core.plan.model import ModelSpec, PlanError
from zero_core.plan.step_time import step_time

PRECISIONS = ("fp32", "bf16", "fp16")
#: where the recommended config puts nvme swap files; the user must point it at a real disk
NVME_PATH = "/local_nvme"


@dataclass(frozen=True)
class Candidate:
    """One configuration's predictions (bytes per rank, seconds per step)."""

    stage: int
    offload: str
    zeropp: bool
    memory: dict
    comm: dict
    time: dict
    fits: bool
    why_not: list = field(default_factory=list)
    mics: int = 0                  # MiCS shard size G (0: off)
    node_aware: bool | None = None  # two-hop partition collectives; None: not applicable

    @property
    def label(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        if self.zeropp:
            parts.append("ZeRO++")
        if self.mics:
            parts.append(f"MiCS({self.mics}{', hierarchical' if self.node_aware else ''})")
        elif self.node_aware:
            parts.append("node-aware")
        elif self.node_aware is False:
            parts.append("flat")
        return " + ".join(parts)


def _options(cluster: Cluster):
    """(stage, offload, zeropp, mics) of every candidate (module docstring)."""
    several = cluster.nodes > 1 and cluster.ranks_per_node > 1
    for stage in range(4):
        for offload in plan_memory.OFFLOAD if stage else ("none",):
            yield stage, offload, False, 0
            if stage == 3 and cluster.nodes > 1:
                yield stage, offload, True, 0
        if stage and several:
            yield stage, "none", False, cluster.ranks_per_node


def _node_aware(cluster: Cluster, stage: int, zeropp: bool, mics: int,
                node_aware: bool | None) -> bool | None:
    """Whether the candidate's partition collectives run in two hops: None where the
    choice does not exist (one node, one rank per node, stage 0, ZeRO++'s qgZ, a MiCS shard
    group inside one node)."""
    if stage == 0 or zeropp or cluster.nodes == 1 or cluster.ranks_per_node == 1:
        return None
    if mics and mics <= cluster.ranks_per_node:
        return None
    if mics:   # mics_hierarchical_params_gather, off by default
        return bool(node_aware)
    return True if node_aware is None else bool(node_aware)


def evaluate(spec: ModelSpec, cluster: Cluster, micro_batch: int, precision: str,
             stage: int, offload: str = "none", zeropp: bool = False,
             checkpointing: bool = False, flash_attention: bool = False,
             sizes: plan_memory.ZeroSizes | None = None, layout=None, *, mics: int = 0,
             node_aware: bool | None = None) -> Candidate:
    """Predict one configuration (see the module docstring for *fits*). *mics*: MiCS's
    shard size G (0 or -1: off); *node_aware*: the partition collectives on several nodes
    (None: the engine's default, node-aware; False: flat). *layout*: the engine's layout at
    the partition's world size (G under MiCS), built when not given."""
    sizes = sizes or plan_memory.default_sizes()
    mics = mics if mics and mics > 0 and stage >= 1 else 0
    hops = _node_aware(cluster, stage, zeropp, mics, node_aware)
    n = mics or cluster.ranks          # the world the model states are partitioned over
    lay = layout or plan_memory.layout(spec, stage, n, precision, sizes)
    states = plan_memory.model_states(stage, lay.padded, n, precision)
    where = plan_memory.placement(states, stage, offload, lay.padded / n, precision, sizes)
    hpz = plan_memory.hpz_bytes(lay, precision, cluster.ranks_per_node) if zeropp else 0
    acts = plan_memory.activation_bytes(spec, micro_batch, precision, checkpointing,
                                        flash_attention)
    bufs = plan_memory.buffer_bytes(lay, stage, precision, sizes, n)
    device = where["device"] + hpz + acts["total"] + bufs["total"]
    host_node = where["host"] * cluster.ranks_per_node
    if cluster.shared_host_device:
        host_node += device * cluster.ranks_per_node
    disk_node = where["disk"] * cluster.ranks_per_node
    why = []
    if device > cluster.device_memory:
        why.append(f"device {device / 1e9:.3g} GB > {cluster.device_memory / 1e9:.3g} GB")
    if host_node > cluster.host_memory:
        why.append(f"host {host_node / 1e9:.3g} GB per node > {cluster.host_memory / 1e9:.3g} GB")
    if disk_node > cluster.disk:
        why.append(f"disk {disk_node / 1e9:.3g} GB per node > {cluster.disk / 1e9:.3g} GB")
    collectives = plan_comm.collective_bytes(lay, stage, cluster.ranks,
                                             cluster.ranks_per_node, precision, zeropp,
                                             node_aware=hops is not False, mics=mics)
    moved = plan_comm.offload_bytes(lay, states, n, precision, offload, stage)
    tokens = micro_batch * spec.seq
    stepped = lay.padded if stage == 0 else lay.padded / n
    times = step_time(lay.num_parameters, tokens, cluster, collectives, moved, checkpointing,
                      stepped, optimizer_on_host=offload != "none")
    memory = {"model_states": states, "padding_elements": lay.padding,
              "device_model_states": where["device"], "host": where["host"],
              "disk": where["disk"], "offloaded": where["moved"], "hpz_secondary": hpz,
              "activations": acts, "buffers": bufs, "device_total": device,
              "host_per_node": host_node, "disk_per_node": disk_node}
    return Candidate(stage, offload, zeropp, memory, {**collectives, **moved}, times,
                     not why, why, mics, hops)


def plan(spec: ModelSpec, cluster: Cluster, micro_batch: int = 1, precision: str = "bf16",
         checkpointing: bool = False, flash_attention: bool = False,
         sizes: plan_memory.ZeroSizes | None = None) -> list[Candidate]:
    """Every candidate, ranked (module docstring)."""
    if precision not in PRECISIONS:
        raise PlanError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if micro_batch < 1:
        raise PlanError(f"micro-batch {micro_batch} must be at least 1 sample per rank")
    sizes = sizes or plan_memory.default_sizes()
    layouts = {}
    out = []
    for stage, offload, zeropp, mics in _options(cluster):
        key = (stage, mics or cluster.ranks)
        if key not in layouts:
            layouts[key] = plan_memory.layout(spec, stage, key[1], precision, sizes)
        out.append(evaluate(spec, cluster, micro_batch, precision, stage, offload, zeropp,
                            checkpointing, flash_attention, sizes, layouts[key], mics=mics))
    return sorted(out, key=lambda c: (not c.fits, c.time["total"], c.memory["device_total"]))


def recommended(candidates: list[Candidate]) -> Candidate | None:
    """The best candidate that fits, or None."""
    return next((c for c in candidates if c.fits), None)


def ds_config(c: Candidate, micro_batch: int, precision: str, ranks_per_node: int) -> dict:
    """*c* as a DeepSpeed-style config that ``zero_core.config.parse_config`` accepts."""
    zero: dict = {"stage": c.stage}
    if c.offload != "none":
        where = {"device": c.offload, **({"nvme_path": NVME_PATH} if c.offload == "nvme" else {})}
        zero["offload_optimizer"] = dict(where)
        if c.stage == 3:
            zero["offload_param"] = dict(where)
    if c.zeropp:
        zero.update(zero_quantized_weights=True, zero_hpz_partition_size=ranks_per_node,
                    zero_quantized_gradients=True)
    if c.mics:
        zero["mics_shard_size"] = c.mics
        if c.node_aware:   # a shard group of whole nodes, gathered node-aware
            zero["mics_hierarchical_params_gather"] = True
    elif c.node_aware is False:
        zero["node_aware_collectives"] = False
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": zero}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def extrapolate(spec: ModelSpec, cluster: Cluster, ranks: list[int], micro_batch: int = 1,
                precision: str = "bf16", checkpointing: bool = False) -> list[dict]:
    """The best fitting candidate (or the smallest on the device) at each number of ranks
    of *cluster*'s hardware."""
    rows = []
    for n in ranks:
        c = plan(spec, cluster.with_ranks(n), micro_batch, precision, checkpointing)
        best = recommended(c) or min(c, key=lambda x: x.memory["device_total"])
        rows.append({"ranks": n, "config": best.label, "fits": best.fits,
                     "device_bytes": best.memory["device_total"],
                     "inter_bytes": best.comm["inter"], "step_s": best.time["total"]})
    return rows
