"""Multi-rank worker for tests/test_multinode.py: MiCS and node-aware collectives on 4 ranks
seen as 2 nodes x 2 (``ZERO_CORE_RANKS_PER_NODE=2``).

Usage: ``python multinode_train.py <scenario>[,<scenario>...] [checkpoint dir]``. The
training scenarios reuse the stage 0-2 and stage 3 workers' models and single-process
references (engine_train.py, stage3_train.py): each trains the engine and, in the same
process, plain torch on the same global batches, and reports the relative difference plus
the step's communication report (per-link bytes) and the engine's partition layout.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_train  # noqa: E402
import stage3_train  # noqa: E402

import zero_core  # noqa: E402
from zero_core.testing.ranks import report  # noqa: E402


def low_stage(stage: int, **zero) -> dict:
    """Stage 1 or 2 with *zero* keys against the single-process reference."""
    out = engine_train.train_and_compare(
        stage, zero_optimization={"stage": stage, "reduce_bucket_size": 200, **zero})
    return _slim(out)


def stage3(**kwargs) -> dict:
    return _slim(stage3_train.train_and_compare(**kwargs))


def _slim(out: dict) -> dict:
    keep = ("rel_diff", "norm", "ref_norm", "norms", "ref_norms", "skipped", "comm",
            "ranks_agree", "checksum")
    rep = {k: out[k] for k in keep if k in out}
    rep["model_states"] = (out["memory"]["formula"] or {}).get("model_states")
    return rep


def unit_sizes() -> dict:
    """Stage 3's padded fetch units, one step's ledger under each setting, and how the
    stage sees its partition group."""
    out = {}
    for name, zero in (("flat", {"node_aware_collectives": False}), ("node_aware", {}),
                       ("mics", {"mics_shard_size": 2})):
        cfg = stage3_train.stage3_config("fp32", 1, **zero)
        model = stage3_train.make_model(7)
        zero_core.register_external_parameter(model, model.mix.weight)
        engine, _, _, _ = zero_core.initialize(model=model, config=cfg,
                                               model_parameters=stage3_train.groups_of(model))
        ids, tgt = stage3_train.global_batch(7, 0, stage3_train.MICRO * engine.world_size)
        r = engine.global_rank
        rows = slice(r * stage3_train.MICRO, (r + 1) * stage3_train.MICRO)
        for _ in range(2):     # the second step is the steady state (no first-use gathers)
            engine.backward(stage3_train.ce(engine(ids[rows]), tgt[rows]))
            engine.step()
        units = engine.parts.units
        out[name] = {
            "units": [{"index": u.index, "padded": u.padded_numel, "persistent": u.persistent,
                       "trainable": u.trainable} for u in units],
            "gathers": engine.parts.gatherer.gathers,
            "ledger": engine.comm_report(),
            "partition_rank": engine.build_context.rank,
            "partition_size": engine.build_context.world_size,
        }
        engine.destroy()
    return out


def checkpoint(tmp: str) -> dict:
    """Save a MiCS run (stage 3, shard 2) and load it into plain stage 3, MiCS at stage 2
    and plain stage 1; a plain stage-3 save loads into MiCS. Every load must give the
    saved model's values exactly; the MiCS save must hold one copy (files of the second
    shard group carry no model state)."""
    seed = 11

    def build(stage, **zero):
        cfg = stage3_train.stage3_config("fp32", 1, **zero)
        cfg["zero_optimization"]["stage"] = stage
        model = stage3_train.make_model(seed)
        zero_core.register_external_parameter(model, model.mix.weight)
        engine, _, _, _ = zero_core.initialize(model=model, config=cfg,
                                               model_parameters=stage3_train.groups_of(model))
        return engine, model

    def train(engine, steps=2):
        world, r = engine.world_size, engine.global_rank
        for step in range(steps):
            ids, tgt = stage3_train.global_batch(seed, step, stage3_train.MICRO * world)
            rows = slice(r * stage3_train.MICRO, (r + 1) * stage3_train.MICRO)
            engine.backward(stage3_train.ce(engine(ids[rows]), tgt[rows]))
            engine.step()

    def values(model):
        return [p.detach().clone() for p in stage3_train.full_params(model)]

    engine, model = build(3, mics_shard_size=2)
    train(engine)
    saved = values(model)
    engine.save_checkpoint(tmp, tag="mics")
    engine.destroy()
    if engine.global_rank == 0:   # for the launch at another world size (load_elsewhere)
        torch.save(saved, os.path.join(tmp, "mics_values.pt"))
    with open(os.path.join(tmp, "mics", "metadata.json")) as f:
        index = json.load(f)["ranks"]
    fragments_per_rank = [len(r["fragments"]) for r in index]
    out = {}
    for name, stage, zero in (("to_plain3", 3, {}), ("to_mics2", 2, {"mics_shard_size": 2}),
                              ("to_plain1", 1, {}), ("to_mics3", 3, {"mics_shard_size": 2})):
        engine, model = build(stage, **zero)
        engine.load_checkpoint(tmp, tag="mics")
        got = values(model)
        out[name] = max(float((a - b).abs().max()) for a, b in zip(got, saved))
        train(engine, 1)    # and it trains on from there
        engine.destroy()
    engine, model = build(3)
    train(engine)
    saved = values(model)
    engine.save_checkpoint(tmp, tag="plain")
    engine.destroy()
    engine, model = build(3, mics_shard_size=2)
    engine.load_checkpoint(tmp, tag="plain")
    out["plain_to_mics"] = max(float((a - b).abs().max())
                               for a, b in zip(values(model), saved))
    engine.destroy()
    return {"loaded": out, "fragments_per_rank": fragments_per_rank}


def collectives() -> dict:
    """The partition communicator's all-gather and reduce-scatter, node-aware (every rank)
    and MiCS (shard 2), on fresh random float64 inputs: the error against the result built
    by hand from every rank's input (each rank makes everyone's from the shared seed), and
    the ledger's per-link bytes of each call."""
    from zero_core.config.schema import ZeroConfig
    from zero_core.interfaces.ledger import CommLedger
    from zero_core.runtime.partition_comm import build_sharding
    rt = zero_core.get_runtime()
    out = {}
    for name, zero in (("node_aware", ZeroConfig(stage=3)),
                       ("mics", ZeroConfig(stage=3, mics_shard_size=2))):
        pc = build_sharding(rt.comm, zero, 3).comm
        order = pc.order            # global ranks by partition index
        shard = 1000 + 8 * torch.randint(0, 50, (1,), generator=torch.Generator().manual_seed(5)).item()
        g = torch.Generator().manual_seed(99)
        inputs = {r: torch.randn(shard, dtype=torch.float64, generator=g)
                  for r in range(rt.world_size)}
        grads = {r: torch.randn(shard * len(order), dtype=torch.float64, generator=g)
                 for r in range(rt.world_size)}
        before = rt.comm.ledger.snapshot()
        full = torch.empty(shard * len(order), dtype=torch.float64)
        pc.all_gather_into(full, inputs[rt.rank])
        mid = rt.comm.ledger.snapshot()
        mine = torch.empty(shard, dtype=torch.float64)
        handle = pc.reduce_scatter(mine, grads[rt.rank], "sum", async_op=True)
        handle.wait()
        after = rt.comm.ledger.snapshot()
        want_full = torch.cat([inputs[r] for r in order])
        want_mine = sum(grads[r] for r in order).narrow(0, pc.rank * shard, shard)
        gather = CommLedger.difference(mid, before)
        reduce = CommLedger.difference(after, mid)
        out[name] = {
            "partition_rank": pc.rank, "order": list(order), "shard_bytes": shard * 8,
            "gather_error": float((full - want_full).abs().max()),
            "reduce_error": float((mine - want_mine).abs().max()),
            "gather": {k: gather[k] for k in ("inter_node_bytes", "intra_node_bytes")},
            "reduce": {k: reduce[k] for k in ("inter_node_bytes", "intra_node_bytes")}}
    return out


def load_elsewhere(tmp: str) -> dict:
    """At another world size: the 4-rank MiCS checkpoint of :func:`checkpoint` into plain
    stage 3 and into MiCS with one rank per copy; the largest difference from the values it
    saved, per target."""
    saved = torch.load(os.path.join(tmp, "mics_values.pt"))
    out = {}
    for name, zero in (("plain3", {}), ("mics1", {"mics_shard_size": 1})):
        cfg = stage3_train.stage3_config("fp32", 1, **zero)
        model = stage3_train.make_model(11)
        zero_core.register_external_parameter(model, model.mix.weight)
        engine, _, _, _ = zero_core.initialize(model=model, config=cfg,
                                               model_parameters=stage3_train.groups_of(model))
        engine.load_checkpoint(tmp, tag="mics")
        got = stage3_train.full_params(model)
        out[name] = max(float((a - b).abs().max()) for a, b in zip(got, saved))
        engine.destroy()
    return out


SCENARIOS = {
    "collectives": collectives,
    "stage3_node_aware": lambda: stage3(),
    "stage3_flat": lambda: stage3(node_aware_collectives=False),
    "stage3_mics": lambda: stage3(mics_shard_size=2),
    "stage3_mics_init": lambda: stage3(mics_shard_size=2, init=True),
    "stage3_mics_bf16": lambda: stage3(precision="bf16", steps=6, mics_shard_size=2),
    "stage3_mics_hier": lambda: stage3(mics_shard_size=4, mics_hierarchical_params_gather=True),
    "stage3_mics_qwz": lambda: stage3(mics_shard_size=2, zero_quantized_weights=True),
    "stage3_node_aware_init": lambda: stage3(init=True),
    "stage3_node_aware_hpz": lambda: stage3(zero_hpz_partition_size=2),
    "stage3_node_aware_qwz_hpz": lambda: stage3(zero_quantized_weights=True,
                                                zero_hpz_partition_size=2),
    "stage3_mics_offload": lambda: stage3(mics_shard_size=2,
                                          offload_optimizer={"device": "cpu"},
                                          offload_param={"device": "cpu"}),
    "stage2_mics_offload": lambda: low_stage(2, mics_shard_size=2,
                                             offload_optimizer={"device": "cpu"}),
    "stage2_mics": lambda: low_stage(2, mics_shard_size=2),
    "stage1_mics": lambda: low_stage(1, mics_shard_size=2),
    "stage2_node_aware": lambda: low_stage(2),
    "stage1_node_aware": lambda: low_stage(1),
    "units": unit_sizes,
}


def main():
    out = {}
    for name in sys.argv[1].split(","):
        if name in ("checkpoint", "load_elsewhere"):
            out[name] = globals()[name](sys.argv[2])
        else:
            out[name] = SCENARIOS[name]()
    report(out)
    zero_core.runtime.context.shutdown()


if __name__ == "__main__":
    main()
