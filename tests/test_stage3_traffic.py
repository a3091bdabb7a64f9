"""Plain ZeRO-3's communication per optimizer step, by the ledger, against the formula
(issue 17 §2), on real ranks.

Per step and rank, with b bytes per element (the compute dtype), N ranks, Ψ_g the elements
of parameters gathered on use and Ψ_p those of persistent parameters (fewer elements
than stage3_param_persistence_threshold), Ψ = Ψ_g + Ψ_p all trainable:

* all-gather:     (2 Ψ_g − Ψ_kept + Ψ_p) · b · (N-1)/N: every unit in forward, and again
  in backward unless the forward left it gathered. Ψ_kept, with stage3_max_reuse_distance
  0: the unit used last in forward (its next use is backward's first request, 0 elements
  away), and before it the trailing units the live window (stage3_max_live_parameters)
  still holds with it — the prefetcher would gather those again before their next use
  anyway, so the coordinator keeps them (as DeepSpeed's does). With a large reuse
  distance and window, Ψ_kept = Ψ_g. Persistent parameters are gathered once per step,
  after the step changed them;
* reduce-scatter: Ψ · b · (N-1)/N (gloo and MPI carry it as an all-to-all);
* the step's one all-reduce: 3 float64 (gradient norm and the two sample counts).

So zero_core.memory.comm_bytes_per_step's 3Ψ elements is the bound, reached but for
Ψ_kept. Equality is exact: the model's units carry no padding (the test checks that
precondition), and a gather issued but not used — a prefetch that was discarded, a unit
re-gathered while still gathered — would add a whole unit's bytes.
"""
from __future__ import annotations

import os

import pytest

from zero_core.memory import comm_bytes_per_step
from zero_core.testing.ranks import mpirun_path, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "stage3_traffic.py")
BYTES = {"fp32": 4, "bf16": 2}
# units the forward leaves gathered, in blocks (of 4): what each scenario exercises
KEPT_BLOCKS = {"regather-fp32": 2, "regather-bf16": 2, "one-unit-window-fp32": 1,
               "window-keeps-all-fp32": 4, "keep-fp32": 4, "persistent-norms-fp32": 2,
               "all-persistent-bf16": 0}

pytestmark = pytest.mark.multirank

WHERE = [pytest.param(("torchrun", 2, "gloo"), id="gloo-2"),
         pytest.param(("mpirun", 4, "mpi"), id="mpi-4",
                      marks=pytest.mark.skipif(mpirun_path() is None,
                                               reason="mpirun not installed"))]


@pytest.mark.parametrize("where", WHERE)
def test_stage3_step_sends_exactly_the_formula(where):
    launcher, nprocs, comm = where
    results = run_ranks(WORKER, nprocs, launcher, env={"ZERO_CORE_COMM": comm}, timeout=300)
    for res in results:
        for name, r in res.report.items():
            n = r["world_size"]
            assert n == nprocs
            # the precondition of an exact count: no unit is padded; and one unit per block
            assert r["unit_padded_numel"] == r["unit_numel"] == r["trainable_elements"], r
            assert r["units"] - r["persistent_units"] == (4 if r["gathered_elements"] else 0), r
            precision = name.rsplit("-", 1)[1]
            b, share = BYTES[precision], (n - 1) / n
            ops = r["comm"]["ops"]
            gathered = sum(ops[o]["sent_bytes"] for o in ops if o.startswith("all_gather"))
            reduced = sum(ops[o]["sent_bytes"] for o in ("reduce_scatter", "all_to_all_single")
                          if o in ops)
            kept = r["kept_elements"]
            assert kept == KEPT_BLOCKS[name] * r["gathered_elements"] // 4, (name, kept)
            want = (2 * r["gathered_elements"] - kept + r["persistent_elements"]) * b * share
            assert gathered == want, (name, ops)
            assert reduced == r["trainable_elements"] * b * share, (name, ops)
            assert ops["all_reduce"]["payload_bytes"] == 3 * 8, (name, ops)
            assert set(ops) <= {"all_gather_into", "reduce_scatter", "all_to_all_single",
                                "all_reduce"}, (name, ops)
            if r["persistent_elements"] == 0:
                bound = comm_bytes_per_step(3, r["trainable_elements"], n, precision)
                assert gathered + reduced == bound - kept * b * share, name


def test_the_planner_keeps_what_the_engine_keeps():
    """zero-core plan's count of units left gathered for the backward
    (plan/memory.kept_for_backward) on the worker's block model, for every scenario the
    engine test above measures: the planner's traffic is the engine's."""
    import dataclasses
    import importlib.util

    from zero_core.plan import memory as plan_memory
    spec = importlib.util.spec_from_file_location("stage3_traffic_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    base = plan_memory.default_sizes()
    for name, (_, threshold, reuse, max_live) in worker.SCENARIOS.items():
        # a block: the Linear's weight and the LayerNorm's two WIDTH-element parameters,
        # each persistent when smaller than the threshold
        linear = worker.WIDTH * worker.WIDTH
        block = linear + (2 * worker.WIDTH if worker.WIDTH >= threshold else 0)
        units = ((block, False),) * worker.BLOCKS if linear >= threshold else ()
        sizes = dataclasses.replace(base, persistence_threshold=threshold,
                                    max_reuse_distance=reuse, max_live_parameters=max_live)
        assert plan_memory.kept_for_backward(units, sizes) == KEPT_BLOCKS[name], name
    # no prefetch: only the unit whose next use is the very next request stays
    sizes = dataclasses.replace(base, max_reuse_distance=0, prefetch_bucket_size=0)
    assert plan_memory.kept_for_backward(((100, False),) * 4, sizes) == 1
    # the prefetcher's reach counts the later units twice (forward and backward requests)
    sizes = dataclasses.replace(base, max_reuse_distance=0, prefetch_bucket_size=300)
    assert plan_memory.kept_for_backward(((100, False),) * 4, sizes) == 2
