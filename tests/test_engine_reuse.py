"""A model trained again after its stage-3 engine is done with it (issue 27 §3):
``engine.hand_back_model`` (Stage3Parts.hand_back_model) returns the model partitioned as ``zero_core.Init``
leaves it, from the engine's fp32 master, and the integrations build their next engine on
it — a second ``ZeroCoreTrainer.train()``, and Lightning's ``fit`` after ``validate``.

One 2-rank launch (torchrun-style, gloo) of tests/workers/engine_reuse.py, whose
docstring lists the runs. References: HF's own Trainer (DDP) doing the same two
``train()`` calls, given a new optimizer before the second as transformers' DeepSpeed
integration does; the plain-torch single-process reference of tests/workers/
lightning_common.py; for the hand-back's precision, the engine's master partitions read
with torch.distributed's own all_gather.

Bounds: 1e-5 relative against the independent references (summation order; measured
~2e-6 after the two HF runs, ~4e-8 for Lightning). Lightning's validate-then-fit against
fit alone: equal, bit for bit (the same fp32 master values go into the same steps), in
fp32 and in bf16-mixed.
"""
from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from zero_core.testing.ranks import run_ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "engine_reuse.py")
SEED = random.randrange(1, 10**6)   # fresh data and weights each session; messages carry it
TOL = 1e-5


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("engine_reuse"))
    results = run_ranks(WORKER, 2, "torchrun", args=(SEED, out), timeout=240)
    assert all(r.report is not None for r in results), "a rank did not report"
    return [r.report for r in results]


@pytest.mark.multirank
@pytest.mark.slow
def test_second_train_matches_hf_ddp(reports):
    """Two train() calls on one ZeroCoreTrainer and model, at stage 3 and stage 2: each
    builds its own engine, the second continues from the trained weights, and both
    match HF's DDP Trainer doing the same within 1e-5."""
    for rank, rep in enumerate(reports):
        hf = rep["hf"]
        assert hf["ref_moved"] > 100 * TOL, ("the second reference train() did not train", hf)
        for name, engine in (("zc3", "Stage3Parts"), ("zc2", "Stage0to2Parts")):
            r = hf[name]
            where = (name, rank, f"seed {SEED}")
            assert r["engine"] == engine and r["new_engine"] and r["steps"] == 2, where
            assert r["first_rel"] <= TOL, (where, r["first_rel"])
            assert r["final_rel"] <= TOL, (where, r["final_rel"])


@pytest.mark.multirank
@pytest.mark.slow
def test_handed_back_model_keeps_the_fp32_master(reports):
    """A bf16 stage-3 engine hands its model back: every parameter is in Init's form (a
    released PartitionedParameter with an fp32 partition of its own, no fetch unit), its
    values are the engine's fp32 master exactly (hundreds of them finer than bf16), the
    engine's hooks are gone, and a new engine starts from exactly those values."""
    for rank, rep in enumerate(reports):
        r = rep["precision"]
        where = (rank, f"seed {SEED}", r)
        assert r["units"] >= 2 and r["returned_model"] and r["names"], where
        assert r["init_form"] and r["own_dtypes"] == ["torch.float32"], where
        assert r["forward_after"] == "ParameterNotGatheredError", where
        assert r["equal_master"], where
        assert r["finer_than_bf16"] > 100, where
        assert r["second_engine_master_equal"] and r["second_engine_steps"] == 1, where


@pytest.mark.multirank
@pytest.mark.slow
def test_fit_after_validate_at_stage_3(reports):
    """validate then fit on one Trainer and ZeroCoreStrategy at stage 3: fit builds its
    engine from the evaluation engine's partitions and ends where fit alone on a fresh
    model ends (bit for bit, fp32 and bf16-mixed), and in fp32 within 1e-5 of the
    plain-torch reference."""
    for rank, rep in enumerate(reports):
        for precision, r in rep["lightning"].items():
            where = (precision, rank, f"seed {SEED}", r)
            assert r["new_engine"] and r["global_step"] == r["engine_steps"] == 4, where
            assert r["val"] is not None, where
            if rank == 0:   # stage 3's full state dict is gathered on rank 0
                assert r["vs_fit_alone"] == 0.0, where
                if precision == "32-true":
                    assert r["vs_ref"] <= TOL, where
