"""Predicted time of one optimizer step (one micro-batch per rank, no accumulation).

    compute  = F · Ψ · tokens / (flops · efficiency)
               F = 6 (forward 2 + backward 4 FLOP per parameter and token; Kaplan et al.
               2020), 8 with activation checkpointing (the forward again);
               tokens = micro-batch × sequence, per rank
    comm     = intra bytes / intra_bandwidth + inter bytes / inter_bandwidth
    offload  = host↔device bytes / host_device_bandwidth
               + disk bytes · ranks per node / disk_bandwidth (the node's disk is shared)
    step     = compute + (1 - overlap) · comm + offload

*overlap* is the cluster's stated fraction of communication hidden behind compute (0 for
CPU ranks, which share their cores with the collectives). The attention's s² FLOPs, the
optimizer step itself and collective latency are not modelled: this is a bandwidth and
FLOP-rate model, right for models large enough that those terms are small.
"""
from __future__ import annotations

from zero_core.plan.cluster import Cluster


def step_time(num_parameters: int, tokens: int, cluster: Cluster, comm: dict, offload: dict,
              checkpointing: bool = False) -> dict:
    """Seconds per step, by part (module docstring)."""
    flop_factor = 8 if checkpointing else 6
    compute = flop_factor * num_parameters * tokens / (cluster.flops * cluster.efficiency)
    communication = (comm["intra"] / cluster.intra_bandwidth
                     + comm["inter"] / cluster.inter_bandwidth)
    moved = (offload["host_device"] / cluster.host_device_bandwidth
             + offload["disk"] * cluster.ranks_per_node / cluster.disk_bandwidth)
    total = compute + (1 - cluster.overlap) * communication + moved
    return {"compute": compute, "communication": communication, "offload": moved,
            "total": total}
