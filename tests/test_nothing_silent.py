"""Nothing fails silently (issue 16): faults injected into real 2-rank jobs, gloo and MPI.

One launch per backend runs every scenario of tests/workers/nothing_silent.py:

* an inf or NaN gradient on one rank at one step (fp32, bf16; stages 1-3): the step is
  skipped on every rank — parameters, fp32 master, optimizer states and step counts
  bit-identical to before — counted in ``skipped_steps``, logged on rank 0 with the step
  and the first parameter hit, and training goes on; ``"raise"`` raises the same error on
  every rank; ``"ignore"`` applies it (the weights become non-finite: what the default
  prevents); ``max_consecutive_skips`` raises. The skip is decided on the device at the
  step itself; the warning or error comes with the next update (engine/update.py: the
  host reads a step's verdict one step later, so that no step waits for the device);
* ranks started with a different stage (2 vs 3, 1 vs 2), precision or model: one named
  error on every rank within seconds; different micro-batch sizes at a step: named, weights
  untouched, training goes on;
* ``step()`` without ``backward()``; ``backward()`` twice on one graph (retain_graph: the
  gradients add up, the update equals one backward of twice the loss; without it torch's
  error, and training goes on).
"""
from __future__ import annotations

import os

import pytest

from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "nothing_silent.py")
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module", params=[("torchrun", "gloo"), ("mpirun", "mpi")],
                ids=["gloo", "mpi"])
def reports(request):
    launcher, comm = request.param
    # a long collective timeout: the errors below must come from the checks, not a timeout
    res = run_ranks(WORKER, 2, launcher, env={"ZERO_CORE_COMM": comm,
                                              "ZERO_CORE_COMM_TIMEOUT": "60"}, timeout=300)
    return [r.report for r in res]


def by_scenario(reports, name):
    rows = list(zip(*reports))
    return [pair for pair in rows if pair[0]["scenario"] == name]


def test_a_non_finite_gradient_skips_the_step_bit_identically(reports):
    skips = [p for p in by_scenario(reports, "nonfinite") if p[0]["action"] == "skip"]
    assert {(p[0]["precision"], p[0]["stage"], p[0]["poison"]) for p in skips} == {
        (prec, stage, poison) for prec in ("fp32", "bf16") for stage in (1, 2, 3)
        for poison in ("inf", "nan")}
    for r0, r1 in skips:
        for rank, r in enumerate((r0, r1)):
            where = f"{r['precision']} stage {r['stage']} {r['poison']} rank {rank}"
            assert r["error"] is None, where
            assert r["unchanged"] and r["finite_after"], where
            assert r["skipped"] == 1 and r["global_steps"] == 3, where
            assert r["moved_after"] and r["finite_later"], where  # training went on
        # one warning, on rank 0, with the step and the one parameter that was poisoned
        kind = "inf" if r0["poison"] == "inf" else "NaN"
        assert len(r0["logged"]) == 1 and r1["logged"] == []
        assert (f"step 2: the global gradient norm is {kind} ({r0['precision']} training); "
                f"first parameter with a non-finite gradient: 'l2.weight'") in r0["logged"][0]


def test_raise_raises_on_every_rank_and_ignore_applies(reports):
    rows = {p[0]["action"]: p for p in by_scenario(reports, "nonfinite")
            if p[0]["action"] != "skip" and p[0]["precision"] == "fp32"}
    rows_bf16 = {p[0]["action"]: p for p in by_scenario(reports, "nonfinite")
                 if p[0]["action"] != "skip" and p[0]["precision"] == "bf16"}
    for table in (rows, rows_bf16):
        r0, r1 = table["raise"]
        assert r0["error"] == r1["error"] and r0["error"].startswith("NonFiniteGradientError: ")
        assert "'l2.weight'" in r0["error"] and "not updated" in r0["error"]
        # skipped on the device at step 2 (counted), raised at the next update
        assert r0["unchanged"] and r1["unchanged"] and r0["skipped"] == 1
        assert r0["moved_after"] and r0["finite_later"]
        for r in table["ignore"]:
            assert r["error"] is None and r["skipped"] == 0
            assert not r["finite_after"]  # applied as it is: this is what "skip" prevents


def test_consecutive_skips_raise(reports):
    ((r0, r1),) = by_scenario(reports, "consecutive")
    # both poisoned steps skipped on the device; the limit is reported with the next update
    assert r0["errors"][:2] == [None, None] and r0["skipped"] == 2
    assert r0["errors"][2] == r1["errors"][2]
    assert "2 skipped steps in a row (safety.max_consecutive_skips = 2)" in r0["errors"][2]


@pytest.mark.parametrize("name,expected", [
    ("stage 2 vs 3", "config key 'zero_optimization.stage': 2 on rank 0; 3 on rank 1"),
    ("stage 1 vs 2", "config key 'zero_optimization.stage': 1 on rank 0; 2 on rank 1"),
    ("fp32 vs bf16", "config key 'bf16.enabled': false on rank 0; true on rank 1"),
    ("model", "model: number of parameters 4 on rank 0; 6 on rank 1"),
])
def test_ranks_that_disagree_are_named_within_seconds(reports, name, expected):
    (pair,) = [p for p in by_scenario(reports, "disagree") if p[0]["name"] == name]
    assert pair[0]["error"] == pair[1]["error"], pair
    assert pair[0]["error"].startswith("RankDisagreementError: ")
    assert expected in pair[0]["error"]
    assert max(r["seconds"] for r in pair) < 10


def test_different_micro_batch_sizes_are_named(reports):
    ((r0, r1),) = by_scenario(reports, "batch_mismatch")
    assert r0["error"] == r1["error"] and "rank 0: 4, rank 1: 3" in r0["error"]
    assert r0["error"].startswith("ZeroCoreError: step 1:")
    assert r0["unchanged"] and r1["unchanged"] and r0["global_steps"] == 3


def test_step_without_backward_is_named(reports):
    ((r0, r1),) = by_scenario(reports, "no_backward")
    for r in (r0, r1):
        assert "no engine.backward(loss) since the last update" in r["error"]
        assert r["unchanged"] and r["global_steps"] == 1


def test_backward_twice_behaves_as_torch(reports):
    pairs = by_scenario(reports, "backward_twice")
    assert [p[0]["stage"] for p in pairs] == [0, 1, 2, 3]
    for pair in pairs:
        for r in pair:
            assert r["twice_equals_double"], r
            assert "backward through the graph a second time" in r["second_error"]
            assert r["trains_on"]
