"""MiCS (``mics_shard_size``) and node-aware collectives on 4 ranks seen as 2 nodes x 2
(``ZERO_CORE_RANKS_PER_NODE=2``), over gloo (torchrun-style launch) and MPI (mpirun), against
the single-process plain-torch reference (tests/workers/multinode_train.py).

Bounds: fp32 RTOL_FP32 = 1e-5 and bf16 RTOL_BF16 = 2e-2, for the reasons given in
tests/test_stage3_multirank.py (the engine sums per-rank means in another order: ulps; bf16
stores 8 significant bits). qwZ quantizes every gathered weight to int8 with one scale per
block of 256 (2^-8 relative at worst, once per gather, not compounding into the master):
RTOL_QWZ = 2e-2, measured ~6e-3; a unit gathered from the wrong shard is >= 1e-1.

Per-link bytes (the ledger's convention, zero_core/interfaces/ledger.py), with S the bytes
of one rank's shard, N = 4 ranks, K = 2 nodes, L = 2 ranks per node, MiCS shard G = 2:

    node-aware all-gather       inter (K-1)·S                intra (L-1)·K·S
    node-aware reduce-scatter   intra (L-1)/L·N·S            inter (K-1)/K·(N·S/L)
    MiCS all-gather             inter 0                      intra (G-1)·S
    MiCS reduce-scatter         inter 0                      intra (G-1)/G·G·S
    MiCS step (engine)          inter = 2(R-1)/R · Σ trainable padded units / G · 4 bytes
                                        + the norm all-reduce (36 bytes at 4 ranks)
"""
from __future__ import annotations

import os

import pytest

from zero_core.testing.ranks import mpirun_path, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "multinode_train.py")
COMM = {"torchrun": "gloo", "mpirun": "mpi"}
RTOL_FP32, RTOL_BF16, RTOL_QWZ = 1e-5, 2e-2, 2e-2
N, K, L, G = 4, 2, 2, 2
NORM_BYTES = 2 * (N - 1) * 3 * 8 // N   # the step's one all-reduce of three float64

pytestmark = pytest.mark.multirank

FP32 = ("stage3_node_aware", "stage3_flat", "stage3_mics", "stage3_mics_init",
        "stage3_mics_hier", "stage3_node_aware_init", "stage3_node_aware_hpz",
        "stage3_mics_offload",
        "stage2_mics_offload", "stage2_mics", "stage1_mics",
        "stage2_node_aware", "stage1_node_aware")
PLANS = {
    "torchrun": ",".join(FP32 + ("stage3_mics_bf16", "stage3_mics_qwz",
                                 "stage3_node_aware_qwz_hpz", "collectives", "units",
                                 "checkpoint")),
    "mpirun": "stage3_node_aware,stage3_mics,stage1_mics,collectives",
}
_CACHE: dict = {}
_CHECKPOINTS: dict = {}


def launch(launcher: str, tmp_path_factory) -> list[dict]:
    if launcher == "mpirun" and mpirun_path() is None:
        pytest.skip("mpirun not installed: pip install 'zero-core[mpi]'")
    if launcher not in _CACHE:
        tmp = _CHECKPOINTS[launcher] = str(tmp_path_factory.mktemp("multinode"))
        res = run_ranks(WORKER, N, launcher, args=[PLANS[launcher], tmp], timeout=900,
                        env={"ZERO_CORE_RANKS_PER_NODE": str(L),
                             "ZERO_CORE_COMM": COMM[launcher]})
        _CACHE[launcher] = [r.report for r in res]
    return _CACHE[launcher]


LAUNCHERS = [pytest.param("torchrun", id="gloo"), pytest.param("mpirun", id="mpi")]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_configuration_equals_the_single_process_reference(launcher, tmp_path_factory):
    reps = launch(launcher, tmp_path_factory)
    names = [n for n in PLANS[launcher].split(",") if n in FP32]
    assert names
    for rep in reps:
        for name in names:
            assert rep[name]["rel_diff"] <= RTOL_FP32, (name, rep[name]["rel_diff"])
            assert rep[name]["skipped"] == 0, name
    # every rank ends with the same model (stage 3 checks the gathered values)
    for name in names:
        if name.startswith("stage3"):
            assert all(rep[name]["ranks_agree"] for rep in reps), name


def test_bf16_and_qwz_compose(tmp_path_factory):
    """bf16 under MiCS; qwZ under MiCS, and qwZ + hpZ with node-aware gathers."""
    for rep in launch("torchrun", tmp_path_factory):
        assert rep["stage3_mics_bf16"]["rel_diff"] <= RTOL_BF16
        for name in ("stage3_mics_qwz", "stage3_node_aware_qwz_hpz"):
            qwz = rep[name]["rel_diff"]
            assert 1e-6 < qwz <= RTOL_QWZ, name   # it really quantized, and stayed close


def test_mics_holds_the_model_states_of_its_shard_group(tmp_path_factory):
    """Model-state bytes per rank under MiCS are plain ZeRO's at world size G: twice the
    4-rank figure for the same stage (the formula the engine reports, from its layout)."""
    rep = launch("torchrun", tmp_path_factory)[0]
    assert rep["stage3_mics"]["model_states"] == 2 * rep["stage3_flat"]["model_states"]
    assert rep["stage1_mics"]["model_states"] > rep["stage1_node_aware"]["model_states"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_partition_collectives_deliver_and_follow_their_formulas(launcher, tmp_path_factory):
    for rank, rep in enumerate(launch(launcher, tmp_path_factory)):
        na, mics = rep["collectives"]["node_aware"], rep["collectives"]["mics"]
        # local-rank-major numbering: partition index l*K + n
        assert na["order"] == [0, 2, 1, 3]
        assert na["partition_rank"] == (rank % L) * K + rank // L
        assert mics["order"] == [2 * (rank // G), 2 * (rank // G) + 1]
        for got in (na, mics):
            assert got["gather_error"] == 0.0
            assert got["reduce_error"] <= 1e-12
        s = na["shard_bytes"]
        assert na["gather"] == {"inter_node_bytes": (K - 1) * s,
                                "intra_node_bytes": (L - 1) * K * s}
        assert na["reduce"] == {"intra_node_bytes": (L - 1) * N * s // L,
                                "inter_node_bytes": (K - 1) * (N * s // L) // K}
        s = mics["shard_bytes"]
        assert mics["gather"] == {"inter_node_bytes": 0, "intra_node_bytes": (G - 1) * s}
        assert mics["reduce"] == {"inter_node_bytes": 0, "intra_node_bytes": (G - 1) * s}


def test_engine_inter_node_bytes(tmp_path_factory):
    """One steady-state stage-3 step: node-aware sends at most 0.55x of the flat
    collectives' inter-node bytes (formula: (K-1)/(N-1) = 1/3 for the partition traffic);
    MiCS sends exactly one gradient all-reduce across the copies plus the norm."""
    for rep in launch("torchrun", tmp_path_factory):
        u = rep["units"]
        flat, aware, mics = (u[k]["ledger"] for k in ("flat", "node_aware", "mics"))
        assert aware["inter_node_bytes"] <= 0.55 * flat["inter_node_bytes"]
        assert flat["intra_node_bytes"] == 0      # every flat collective spans the nodes
        trainable = sum(x["padded"] for x in u["mics"]["units"] if x["trainable"])
        replicas = N // G
        want = 2 * (replicas - 1) * (trainable // G) * 4 // replicas + NORM_BYTES
        assert mics["inter_node_bytes"] == want
        assert (u["mics"]["partition_size"], u["node_aware"]["partition_size"]) == (G, N)


def test_checkpoints_reshard_between_mics_and_plain(tmp_path_factory):
    """A MiCS save loads into plain stage 3, MiCS at stage 2 and plain stage 1 with the
    saved values exactly, and a plain save into MiCS; only the first shard group wrote
    model state."""
    rep = launch("torchrun", tmp_path_factory)[0]["checkpoint"]
    assert rep["loaded"] == {"to_plain3": 0.0, "to_mics2": 0.0, "to_plain1": 0.0,
                             "to_mics3": 0.0, "plain_to_mics": 0.0}
    written = rep["fragments_per_rank"]
    assert all(n > 0 for n in written[:G]) and written[G:] == [0] * (N - G)


def test_a_mics_checkpoint_loads_at_another_world_size(tmp_path_factory):
    """The 4-rank MiCS save, on 2 ranks: into plain stage 3 and into MiCS with one rank
    per copy (shard size 1: every rank holds everything), with the saved values exactly."""
    launch("torchrun", tmp_path_factory)
    res = run_ranks(WORKER, 2, "torchrun", args=["load_elsewhere", _CHECKPOINTS["torchrun"]],
                    timeout=300, env={"ZERO_CORE_RANKS_PER_NODE": "1", "ZERO_CORE_COMM": "gloo"})
    for r in res:
        assert r.report["load_elsewhere"] == {"plain3": 0.0, "mics1": 0.0}
