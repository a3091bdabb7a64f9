"""What ``zero-core plan`` prints: the ranked table and recommended config (text), or all of
it as one JSON document (``--json``).

A candidate's configuration reads "stage S [+ offload D] [+ ZeRO++] [+ node-aware |
+ MiCS(G) | + flat]": "node-aware" is the engine's default on several nodes (two-hop partition
collectives), "MiCS(G)" the model states sharded over G ranks and replicated across the
N/G groups (``mics_shard_size``), "flat" the world-group collectives across nodes
(``node_aware_collectives: false``). In the JSON each candidate also says
``mics_shard_size`` (0: off) and ``node_aware`` (null where it does not apply).
The intra/inter columns are bytes one rank sends per step, by link class (``comm.py``)."""
from __future__ import annotations

import json

from zero_core.plan.cluster import Cluster
from zero_core.plan.model import ModelSpec
from zero_core.plan.planner import Candidate, ds_config, recommended


#: the configuration column ("stage 3 + offload nvme + node-aware" and a space)
WIDTH = 37


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g}"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def as_json(spec: ModelSpec, cluster: Cluster, candidates: list[Candidate], micro_batch: int,
            precision: str, extra: dict | None = None) -> dict:
    best = recommended(candidates)
    return {"model": spec.describe(), "cluster": cluster.describe(),
            "micro_batch": micro_batch, "precision": precision,
            "candidates": [{"config": c.label, "stage": c.stage, "offload": c.offload,
                            "zeropp": c.zeropp, "mics_shard_size": c.mics,
                            "node_aware": c.node_aware, "fits": c.fits, "why_not": c.why_not,
                            "memory": c.memory, "comm": c.comm, "time": c.time}
                           for c in candidates],
            "recommended": None if best is None else
            ds_config(best, micro_batch, precision, cluster.ranks_per_node),
            **(extra or {})}


def as_text(spec: ModelSpec, cluster: Cluster, candidates: list[Candidate], micro_batch: int,
            precision: str, extrapolation: list[dict] | None = None) -> str:
    info = spec.describe()
    lines = [f"model   {info['name']}: {info['parameters']:,} parameters, {info['layers']} "
             f"layers, hidden {info['hidden']}, vocab {info['vocab']}, seq {info['seq']}",
             f"cluster {cluster.name}: {cluster.ranks} ranks, {cluster.ranks_per_node} per node, "
             f"{_gb(cluster.device_memory)} GB device memory per rank, "
             f"{cluster.flops * cluster.efficiency / 1e12:.3g} TFLOP/s per rank used",
             f"run     micro-batch {micro_batch} per rank, {precision}, Adam", "",
             f"{'#':>2}  {'configuration':<{WIDTH}}{'fits':<5}{'device GB':>10}{'states GB':>10}"
             f"{'act GB':>8}{'host GB':>9}{'intra MB':>10}{'inter MB':>10}{'step':>11}"]
    for i, c in enumerate(candidates, 1):
        m = c.memory
        lines.append(f"{i:>2}  {c.label:<{WIDTH}}{'yes' if c.fits else 'no':<5}"
                     f"{_gb(m['device_total']):>10}{_gb(m['device_model_states']):>10}"
                     f"{_gb(m['activations']['total']):>8}{_gb(m['host']):>9}"
                     f"{c.comm['intra'] / 1e6:>10.4g}{c.comm['inter'] / 1e6:>10.4g}"
                     f"{_seconds(c.time['total']):>11}")
        if c.why_not:
            lines.append(f"    does not fit: {'; '.join(c.why_not)}")
    best = recommended(candidates)
    lines.append("")
    if best is None:
        lines.append("nothing fits: add ranks, offload to nvme, shorten the sequence or the "
                     "micro-batch, or turn on activation checkpointing (--checkpointing)")
    else:
        lines.append(f"recommended: {best.label} (predicted {_seconds(best.time['total'])} per "
                     f"step: compute {_seconds(best.time['compute'])}, communication "
                     f"{_seconds(best.time['communication'])}, offload "
                     f"{_seconds(best.time['offload'])}, optimizer "
                     f"{_seconds(best.time['optimizer'])})")
        lines.append(json.dumps(ds_config(best, micro_batch, precision, cluster.ranks_per_node),
                                indent=2))
        if best.offload == "nvme":
            lines.append("(set offload nvme_path to a directory on a fast local disk)")
    if extrapolation:
        lines += ["", f"the same model on {cluster.name}'s hardware at more ranks:",
                  f"{'ranks':>6}  {'best configuration':<{WIDTH}}{'fits':<5}{'device GB':>10}"
                  f"{'inter MB':>10}{'step':>11}"]
        for row in extrapolation:
            lines.append(f"{row['ranks']:>6}  {row['config']:<{WIDTH}}"
                         f"{'yes' if row['fits'] else 'no':<5}{_gb(row['device_bytes']):>10}"
                         f"{row['inter_bytes'] / 1e6:>10.4g}{_seconds(row['step_s']):>11}")
    return "\n".join(lines) + "\n"
