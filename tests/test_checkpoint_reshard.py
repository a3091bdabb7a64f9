"""Resharding without a conversion step: a checkpoint saved with N ranks at stage S loads on
M ranks at stage S' directly (tests/workers/ckpt_train.py, fp32, Adam).

Checks for each load:

1. every fragment the loading rank now owns holds exactly (bitwise) the saved values of
   the master weights, both Adam states and the frozen parameters, as reported by the
   saving job's ranks for the fragments they wrote;
2. counters and learning rate continue (10 steps saved, 20 after 10 more);
3. the continued run matches an uninterrupted 20-step run at the loading world size and
   stage to RTOL = 1e-5 (max |p - p_ref| / max |p_ref|). The only difference between the
   two is that the first 10 steps ran with N instead of M ranks: data-parallel reduction
   sums the same per-rank micro-batch gradients in another grouping, a few float32 ulps
   (~1e-7 relative) per step, which Adam turns into updates differing by about lr × that;
   a wrong or misplaced fragment moves parameters by ≥ 1e-3. The measured value is
   printed (pytest -s).

Covered: 4→2 (stage 1→2, 3→2), 2→4 (0→3, 3→1), 4→1 (1→3, 1→0), 2→1 (3→0), and under
mpirun 4→2 (1→3).
"""
from __future__ import annotations

import json
import os

import pytest

from zero_core.testing.ranks import mpirun_path, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "ckpt_train.py")
COMM = {"torchrun": "gloo", "mpirun": "mpi"}
RTOL = 1e-5
pytestmark = pytest.mark.multirank


def launch(tasks, nprocs, launcher="torchrun"):
    results = run_ranks(WORKER, nprocs, launcher, args=[json.dumps(tasks)],
                        env={"ZERO_CORE_COMM": COMM[launcher], "ZERO_CORE_COMM_TIMEOUT": "120"},
                        timeout=600)
    assert all(r.report is not None for r in results), "a rank did not report"
    return [r.report for r in results]


def saved_values(saver: list) -> dict:
    """(name, key) -> {element index: value} from every saving rank's fragments; each
    element must have been written by exactly one rank."""
    out: dict = {}
    for rank_report in saver:
        for name, start, end, keys in rank_report["fragments"]:
            for key, vals in keys.items():
                d = out.setdefault((name, key), {})
                for i, v in zip(range(start, end), vals):
                    assert i not in d, f"element {i} of {name}/{key} saved twice"
                    d[i] = v
    return out


def check_load(saver: list, loader: list, label: str) -> float:
    values = saved_values(saver)
    params = saver[0]["params"]
    for name, vals in params.items():  # every element of every parameter was saved once
        key = "master" if (name, "master") in values else "param"
        assert sorted(values[(name, key)]) == list(range(len(vals))), (label, name)
    worst = 0.0
    for rep in loader:
        assert rep["loaded_fragments"], label
        for name, start, end, keys in rep["loaded_fragments"]:
            for key, vals in keys.items():
                src = values.get((name, key)) or values[(name, "param" if key == "master" else "master")]
                assert vals == [src[i] for i in range(start, end)], (label, name, key, start)
        assert rep["loaded_params"] == params, label
        assert rep["loaded"]["global_steps"] == 10 and rep["loaded"]["lr"] == saver[0]["lr"]
        assert rep["global_steps"] == rep["uninterrupted"]["global_steps"] == 20
        assert rep["lr"] == rep["uninterrupted"]["lr"]
        assert rep["rel_diff"] <= RTOL, (label, rep["rel_diff"])
        worst = max(worst, rep["rel_diff"])
    print(f"{label}: rel diff vs uninterrupted {worst:.2e}")
    return worst


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard4")
    reps = launch([["reshard_save", str(d / "s1"), 1], ["reshard_save", str(d / "s3"), 3]], 4)
    return d, [[r[0] for r in reps], [r[1] for r in reps]]


@pytest.fixture(scope="module")
def two(four, tmp_path_factory):
    d4, (s1, s3) = four
    d = tmp_path_factory.mktemp("reshard2")
    reps = launch([["reshard_load", str(d4 / "s1"), 2], ["reshard_load", str(d4 / "s3"), 2],
                   ["reshard_save", str(d / "s3"), 3], ["reshard_save", str(d / "s0"), 0]], 2)
    return d, [[r[i] for r in reps] for i in range(4)]


def test_4_to_2_stage1_to_2_and_stage3_to_2(four, two):
    _, (s1, s3) = four
    _, (from_s1, from_s3, _, _) = two
    check_load(s1, from_s1, "4 ranks stage 1 -> 2 ranks stage 2")
    check_load(s3, from_s3, "4 ranks stage 3 -> 2 ranks stage 2")


def test_2_to_4_stage0_to_3_and_stage3_to_1(two):
    d2, (_, _, s3, s0) = two
    reps = launch([["reshard_load", str(d2 / "s0"), 3], ["reshard_load", str(d2 / "s3"), 1]], 4)
    check_load(s0, [r[0] for r in reps], "2 ranks stage 0 -> 4 ranks stage 3")
    check_load(s3, [r[1] for r in reps], "2 ranks stage 3 -> 4 ranks stage 1")


def test_to_one_rank(four, two):
    d4, (s1, _) = four
    d2, (_, _, s3, _) = two
    reps = launch([["reshard_load", str(d4 / "s1"), 3], ["reshard_load", str(d4 / "s1"), 0],
                   ["reshard_load", str(d2 / "s3"), 0]], 1)
    check_load(s1, [reps[0][0]], "4 ranks stage 1 -> 1 rank stage 3")
    check_load(s1, [reps[0][1]], "4 ranks stage 1 -> 1 rank stage 0")
    check_load(s3, [reps[0][2]], "2 ranks stage 3 -> 1 rank stage 0")


@pytest.mark.skipif(mpirun_path() is None, reason="mpirun not installed: pip install 'zero-core[mpi]'")
def test_mpirun_4_to_2_stage1_to_3(four):
    d4, (s1, _) = four
    reps = launch([["reshard_load", str(d4 / "s1"), 3]], 2, "mpirun")
    check_load(s1, [r[0] for r in reps], "mpirun: 4 ranks stage 1 -> 2 ranks stage 3")
