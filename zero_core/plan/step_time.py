"""Predicted time of one optimizer step (one micro-batch per rank, no accumulation).

    compute   = F · Ψ · tokens / (flops · efficiency)
                F = 6 (forward 2 + backward 4 FLOP per parameter and token; Kaplan et al.
                2020), 8 with activation checkpointing (the forward again);
                tokens = micro-batch × sequence, per rank
    comm      = intra bytes / intra_bandwidth + inter bytes / inter_bandwidth
    offload   = host↔device bytes / host_device_bandwidth
                + disk bytes · ranks per node / disk_bandwidth (the node's disk is shared)
    optimizer = elements this rank steps (Ψ at stage 0, its partition Ψ/N above, Ψ/G
                under MiCS) / optimizer_rate (host_optimizer_rate when offloaded)
    hidden    = min(overlap · comm, compute)
    step      = compute + comm - hidden + offload + optimizer
              = max(compute + (1 - overlap) · comm, comm) + offload + optimizer

*overlap* is the cluster's stated fraction of communication that can run behind compute
(0 for CPU ranks, which share their cores with the collectives); communication can only
hide behind compute that exists, so at most ``compute`` seconds of it are hidden. Hence the
step is never shorter than its compute or its communication alone:

    step ≥ max(compute, comm) + offload + optimizer

(when overlap · comm ≤ compute the step is compute + (1 - overlap) · comm ≥ comm, since
compute ≥ overlap · comm; otherwise it is comm + offload + optimizer, and comm > compute).
Offload and the optimizer step are not overlapped: they run after the gradients are reduced
and before the next forward needs the parameters.

The attention's s² FLOPs and collective latency are not modelled apart: the measured
training rate (``--measure``) includes what a transformer block spends beyond its 6Ψ FLOPs,
and latency is small for models large enough to need ZeRO.
"""
from __future__ import annotations

from zero_core.plan.cluster import Cluster


def step_time(num_parameters: int, tokens: int, cluster: Cluster, comm: dict, offload: dict,
              checkpointing: bool = False, stepped_elements: float = 0.0,
              optimizer_on_host: bool = False) -> dict:
    """Seconds per step, by part (module docstring); *stepped_elements*: what this rank's
    optimizer updates, on the host when *optimizer_on_host*. ``hidden``: the seconds of
    communication that run behind compute."""
    flop_factor = 8 if checkpointing else 6
    compute = flop_factor * num_parameters * tokens / (cluster.flops * cluster.efficiency)
    communication = (comm["intra"] / cluster.intra_bandwidth
                     + comm["inter"] / cluster.inter_bandwidth)
    moved = (offload["host_device"] / cluster.host_device_bandwidth
             + offload["disk"] * cluster.ranks_per_node / cluster.disk_bandwidth)
    rate = cluster.host_optimizer_rate if optimizer_on_host else cluster.optimizer_rate
    optimizer = stepped_elements / rate
    # the max form, not compute + comm - hidden: rounding can never take it below either
    busy = max(compute + (1 - cluster.overlap) * communication, communication)
    hidden = max(compute + communication - busy, 0.0)
    total = busy + moved + optimizer
    return {"compute": compute, "communication": communication, "offload": moved,
            "optimizer": optimizer, "hidden": hidden, "total": total}
