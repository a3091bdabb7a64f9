"""``zero-core plan`` on several nodes: node-aware collectives and MiCS (zero_core/plan/comm.py,
planner.py), and the step model's floor (step_time.py: a step is never shorter than its
compute or its communication alone).

The byte figures are checked against numbers worked out by hand from the ledger's
convention (all-gather (n-1)·B_in, reduce-scatter (n-1)/n·B_in, all-reduce 2(n-1)/n·B per
rank; a group spanning nodes counts as inter-node) on small explicit layouts."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from zero_core import cli
from zero_core.config import parse_config
from zero_core.plan import cluster as clusters
from zero_core.plan import comm as plan_comm
from zero_core.plan import memory as plan_memory
from zero_core.plan import model, planner
from zero_core.plan.memory import Layout
from zero_core.runtime.partition_comm import plan_partition

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt  # noqa: E402

# the norm all-reduce of three float64 on 4 ranks: 2·3/4·24 bytes
NORM4 = 36
# stage 3, three units in forward order (padded elements, persistent); the forward leaves
# the last non-persistent one gathered, so only the first is gathered again in backward
UNITS = ((1024, False), (64, True), (2048, False))
S3 = Layout(num_parameters=3100, padded=3136, units=UNITS, kept_for_backward=1)
S12 = Layout(num_parameters=4000, padded=4096, max_bucket=4096)


def small_cluster(ranks=4, per_node=2, **kw):
    return dataclasses.replace(clusters.gpu_cluster(ranks, per_node), **kw)


def odd_spec():
    return model.from_preset("tiny", n_embd=36, vocab_size=250, block_size=30)


def test_layouts_of_the_hand_computed_cases():
    assert S3.regathered == [1024] and S3.kept == [2048]
    assert plan_comm.norm_allreduce_bytes(4) == NORM4


def test_node_aware_stage3_bytes_by_hand():
    # N = 4 ranks, K = 2 nodes of L = 2, bf16 (b = 2). Gathers: 1024 + 64 + 2048 in
    # forward, 1024 again in backward = 4160 elements; reduce-scatters: 3136 elements.
    # all-gather:     inter (K-1)·P·b/N = P/2   intra (L-1)·P·b/L = P
    # reduce-scatter: intra (L-1)·P·b/L = P     inter (K-1)·P·b/N = P/2
    got = plan_comm.collective_bytes(S3, 3, 4, 2, "bf16")
    assert got == {"intra": 4160 + 3136, "inter": (4160 + 3136) / 2 + NORM4}
    assert got == {"intra": 7296, "inter": 3684}
    # flat: (N-1)·P·b/N = 1.5·P per collective, all of it inter-node
    flat = plan_comm.collective_bytes(S3, 3, 4, 2, "bf16", node_aware=False)
    assert flat == {"intra": 0, "inter": 1.5 * 7296 + NORM4}
    assert got["inter"] <= 0.55 * flat["inter"]
    # one node of 4: the flat figures, intra-node
    one = plan_comm.collective_bytes(S3, 3, 4, 4, "bf16")
    assert one == {"intra": 1.5 * 7296 + NORM4, "inter": 0}


@pytest.mark.parametrize("stage", [1, 2])
def test_node_aware_stage12_bytes_by_hand(stage):
    # one reduce-scatter of the 4096 padded gradient elements and one all-gather of the
    # updated parameters, bf16, 2 nodes × 2 ranks: inter 2·4096·2/4, intra 2·4096·2/2
    got = plan_comm.collective_bytes(S12, stage, 4, 2, "bf16")
    assert got == {"intra": 8192, "inter": 4096 + NORM4}
    flat = plan_comm.collective_bytes(S12, stage, 4, 2, "bf16", node_aware=False)
    assert flat == {"intra": 0, "inter": 2 * 0.75 * 4096 * 2 + NORM4}
    # fp32: every figure but the norm doubles
    got32 = plan_comm.collective_bytes(S12, stage, 4, 2, "fp32")
    assert got32 == {"intra": 16384, "inter": 8192 + NORM4}
    # stage 0 is one all-reduce on the world, node-aware or not: 2·3/4·4096·2 inter
    assert plan_comm.collective_bytes(S12, 0, 4, 2, "bf16") == \
        {"intra": 0, "inter": 12288 + NORM4}


def test_node_aware_at_four_nodes_by_hand():
    # N = 16, K = 4 nodes of L = 4, one bucket of 4096: inter 2·(K-1)·P·b/N = 3072,
    # intra 2·(L-1)·P·b/L = 12288; the norm 2·15/16·24 (integer division: 45)
    got = plan_comm.collective_bytes(S12, 2, 16, 4, "bf16")
    assert got == {"intra": 12288, "inter": 3072 + 45}


def test_mics_bytes_by_hand():
    # G = 2 (the ranks of a node), R = 2 copies on N = 4; the layouts are those at G
    # stage 3: gathers and reduce-scatters inside the node, (G-1)·P·b/G = P each:
    # 4160 + 3136 intra; across the copies one all-reduce of this rank's padded partition,
    # 2·(R-1)/R·(3136/G)·b = 3136 inter, plus the norm on the world
    got = plan_comm.collective_bytes(S3, 3, 4, 2, "bf16", mics=2)
    assert got == {"intra": 7296, "inter": 3136 + NORM4}
    # stages 1-2: reduce-scatter + all-gather of 4096 inside the node, 4096 each; the
    # all-reduce of 4096/2 elements across the copies: 2·½·2048·2 = 4096
    for stage in (1, 2):
        assert plan_comm.collective_bytes(S12, stage, 4, 2, "bf16", mics=2) == \
            {"intra": 8192, "inter": 4096 + NORM4}
    # G = 2 on 4 nodes of 2 (N = 8, R = 4): all-reduce 2·3/4·(3136/2)·2; norm 2·7/8·24 = 42
    got = plan_comm.collective_bytes(S3, 3, 8, 2, "bf16", mics=2)
    assert got == {"intra": 7296, "inter": 1.5 * 3136 + 42}
    # a shard group smaller than a node, on one node: everything stays inside
    one = plan_comm.collective_bytes(S12, 1, 4, 4, "bf16", mics=2)
    assert one == {"intra": 8192 + 4096 + NORM4, "inter": 0}
    # MiCS at stage 0 is no MiCS (the config refuses it); with ZeRO++ it is refused
    assert plan_comm.collective_bytes(S12, 0, 4, 2, "bf16", mics=2) == \
        plan_comm.collective_bytes(S12, 0, 4, 2, "bf16")
    with pytest.raises(model.PlanError, match="MiCS"):
        plan_comm.collective_bytes(S3, 3, 4, 2, "bf16", zeropp=True, mics=2)
    with pytest.raises(model.PlanError, match="shard size 3"):
        plan_comm.collective_bytes(S3, 3, 4, 2, "bf16", mics=3)


def test_mics_shard_group_of_whole_nodes_by_hand():
    # G = 4 = two nodes of 2, N = 8 (R = 2): flat gathers in the shard group are inter-node,
    # (G-1)·P·b/G = 1.5·P; with mics_hierarchical_params_gather they split as node-aware
    # ones over K = 2 nodes of the group: inter (K-1)·P·b/G = P/2, intra (L-1)·P·b/L = P
    flat = plan_comm.collective_bytes(S3, 3, 8, 2, "bf16", node_aware=False, mics=4)
    allreduce = 2 * 1 / 2 * (3136 // 4) * 2
    assert flat == {"intra": 0, "inter": 1.5 * 7296 + allreduce + 42}
    hier = plan_comm.collective_bytes(S3, 3, 8, 2, "bf16", node_aware=True, mics=4)
    assert hier == {"intra": 7296, "inter": 7296 / 2 + allreduce + 42}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_node_aware_sends_at_most_055_of_flat_across_two_nodes(stage):
    spec, cluster = odd_spec(), small_cluster()
    aware = planner.evaluate(spec, cluster, 1, "bf16", stage)
    flat = planner.evaluate(spec, cluster, 1, "bf16", stage, node_aware=False)
    assert aware.node_aware is True and flat.node_aware is False
    assert aware.label == f"stage {stage} + node-aware"
    assert flat.comm["intra"] == 0 and aware.comm["intra"] > 0
    assert aware.comm["inter"] <= 0.55 * flat.comm["inter"]
    # what a rank holds does not change
    assert aware.memory == flat.memory


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mics_crosses_nodes_once_per_step(stage):
    """MiCS(G = ranks per node) on 4 nodes of 4: the only inter-node bytes are the gradient
    all-reduce across the R = 4 copies of the padded partition at G, and the norm."""
    spec, cluster, g = odd_spec(), small_cluster(16, 4), 4
    c = planner.evaluate(spec, cluster, 1, "bf16", stage, mics=g)
    lay = plan_memory.layout(spec, stage, g, "bf16")
    r = 16 // g
    assert c.label == f"stage {stage} + MiCS(4)" and c.node_aware is None
    assert c.comm["inter"] == pytest.approx(2 * (r - 1) / r * (lay.padded / g) * 2
                                            + plan_comm.norm_allreduce_bytes(16))
    # and inside the node, plain ZeRO's collectives at world size G
    alone = plan_comm.collective_bytes(lay, stage, g, g, "bf16")
    assert c.comm["intra"] == pytest.approx(alone["intra"] - plan_comm.norm_allreduce_bytes(g))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_mics_memory_is_plain_zero_at_world_g(stage, precision):
    spec = odd_spec()
    mics = planner.evaluate(spec, small_cluster(16, 8), 1, precision, stage, mics=8)
    plain = planner.evaluate(spec, small_cluster(8, 8), 1, precision, stage)
    for key in ("model_states", "padding_elements", "device_model_states", "buffers",
                "activations", "device_total", "host"):
        assert mics.memory[key] == plain.memory[key], key
    if stage == 3 and precision == "bf16":   # 16Ψ/G on the padded layout at G
        lay = plan_memory.layout(spec, 3, 8, "bf16")
        assert mics.memory["model_states"]["model_states"] == 16 * lay.padded / 8
    # and more than plain ZeRO on all 16 ranks
    wide = planner.evaluate(spec, small_cluster(16, 8), 1, precision, stage)
    assert mics.memory["device_model_states"] > wide.memory["device_model_states"]


def test_candidates_on_several_nodes():
    ranked = planner.plan(odd_spec(), small_cluster(16, 8))
    labels = {c.label for c in ranked}
    assert {f"stage {s} + MiCS(8)" for s in (1, 2, 3)} <= labels
    assert {"stage 1 + node-aware", "stage 3 + offload nvme + node-aware", "stage 0",
            "stage 3 + ZeRO++"} <= labels
    assert not any(c.node_aware is False for c in ranked)   # flat is not offered
    # one node: neither MiCS nor node-aware
    one = planner.plan(odd_spec(), small_cluster(8, 8))
    assert all(c.mics == 0 and c.node_aware is None for c in one)
    # one rank per node: node-aware is the flat collective, MiCS would be no sharding
    single = planner.plan(odd_spec(), small_cluster(4, 1))
    assert all(c.mics == 0 and c.node_aware is None for c in single)


def _measured():
    return {"ranks": 2, "train_flops": 2e10, "optimizer_rate": 1e8, "intra_bandwidth": 2e9,
            "memcpy_bandwidth": 5e9, "disk_bandwidth": 5e8}


def _clusters():
    """(name, cluster factory by ranks): the presets, plus one that claims to hide all
    communication (overlap 1) and one whose compute is nearly free."""
    yield "gpu-cluster", lambda n: clusters.gpu_cluster(n, min(8, n))
    yield "overlap-1", lambda n: dataclasses.replace(clusters.gpu_cluster(n, min(8, n)),
                                                     overlap=1.0)
    yield "fast-compute", lambda n: dataclasses.replace(clusters.gpu_cluster(n, min(8, n)),
                                                        flops=1e18, overlap=0.9)
    yield "this-machine", lambda n: clusters.this_machine(_measured(), n, min(2, n))


@pytest.mark.parametrize("name,make", list(_clusters()), ids=[n for n, _ in _clusters()])
def test_step_is_never_shorter_than_its_compute_or_its_communication(name, make):
    checked = 0
    for preset in sorted(gpt.PRESETS):
        spec = model.from_preset(preset)
        for n in (1, 2, 4, 8, 16, 64, 512):
            for c in planner.plan(spec, make(n)):
                t = c.time
                floor = max(t["compute"], t["communication"]) + t["offload"] + t["optimizer"]
                assert t["total"] >= floor, (name, preset, n, c.label, t)
                assert t["total"] <= t["compute"] + t["communication"] + t["offload"] \
                    + t["optimizer"] + 1e-15, (name, preset, n, c.label, t)
                assert 0 <= t["hidden"] <= min(t["compute"], t["communication"]) + 1e-15
                checked += 1
    assert checked > 250


def test_the_reported_case_no_longer_predicts_a_step_below_its_communication(capsys):
    assert cli.main(["plan", "--preset", "small", "--cluster", "gpu-cluster", "--ranks", "16",
                     "--ranks-per-node", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for c in out["candidates"]:
        assert c["time"]["total"] >= max(c["time"]["compute"], c["time"]["communication"])
    mics = [c for c in out["candidates"] if c["mics_shard_size"]]
    assert sorted(c["stage"] for c in mics) == [1, 2, 3]
    assert all(c["config"].endswith("MiCS(8)") for c in mics)
    assert parse_config(out["recommended"], world_size=16)


def test_every_candidates_config_parses_and_its_groups_are_legal():
    for cluster in (small_cluster(), small_cluster(16, 8), small_cluster(8, 8)):
        for c in planner.plan(odd_spec(), cluster):
            config = planner.ds_config(c, 1, "bf16", cluster.ranks_per_node)
            zc = parse_config(config, world_size=cluster.ranks).zero_optimization
            assert zc.stage == c.stage
            assert zc.mics_shard_size == (c.mics or -1)
            assert zc.node_aware_collectives
            if c.mics:
                groups = plan_partition(cluster.ranks, cluster.ranks_per_node, c.mics)
                assert groups.size == c.mics and groups.replicas == cluster.ranks // c.mics
    # a flat candidate says so; a MiCS group of whole nodes gathered node-aware too
    cluster = small_cluster(8, 2)
    flat = planner.evaluate(odd_spec(), cluster, 1, "bf16", 2, node_aware=False)
    zc = parse_config(planner.ds_config(flat, 1, "bf16", 2), world_size=8).zero_optimization
    assert zc.node_aware_collectives is False
    hier = planner.evaluate(odd_spec(), cluster, 1, "bf16", 3, mics=4, node_aware=True)
    assert hier.label == "stage 3 + MiCS(4, hierarchical)"
    zc = parse_config(planner.ds_config(hier, 1, "bf16", 2), world_size=8).zero_optimization
    assert zc.mics_shard_size == 4 and zc.mics_hierarchical_params_gather
    assert plan_partition(8, 2, 4, True).hierarchical


def test_mics_is_recommended_where_it_is_best():
    """16 ranks per node, a device that holds only stage 3, and a live window that makes
    plain stage 3 gather again in backward: MiCS(16)'s two passes inside the node beat
    node-aware stage 3's three, and the recommended config carries mics_shard_size."""
    sizes = dataclasses.replace(plan_memory.default_sizes(), max_reuse_distance=0,
                                max_live_parameters=10 ** 6)
    cluster = small_cluster(32, 16, device_memory=0.06e9)
    ranked = planner.plan(model.from_preset("bench"), cluster, sizes=sizes)
    best = planner.recommended(ranked)
    assert best.label == "stage 3 + MiCS(16)", [(c.label, c.fits) for c in ranked]
    aware = next(c for c in ranked if c.label == "stage 3 + node-aware")
    assert best.comm["inter"] < aware.comm["inter"]
    config = planner.ds_config(best, 1, "bf16", 16)
    assert config["zero_optimization"] == {"stage": 3, "mics_shard_size": 16}
    zc = parse_config(config, world_size=32).zero_optimization
    assert zc.mics_shard_size == 16 and zc.stage == 3
