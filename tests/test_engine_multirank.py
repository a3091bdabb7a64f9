"""The ZeRO stage 0–2 engine on real ranks (gloo under torchrun-style launch, MPI under
mpirun) against a single-process plain-torch reference on the same global batches.

The worker (tests/workers/engine_train.py) trains a ~1.4k-parameter model with a tied
embedding/head, a frozen layer, two param groups (different lr and weight decay),
gradient clipping that is active, and buckets of 200 elements (several buckets, parameters
straddling bucket borders); each rank also trains the reference in-process.

Bounds, and why:

- fp32, RTOL_FP32 = 1e-5 (max |p - p_ref| / max |p_ref| after 10 Adam steps). The engine
  averages per-rank micro-batch means with sums in another order than the reference's
  single mean, so gradients differ by a few float32 ulps (~1e-7 relative); Adam turns a
  relative gradient error ε into an update error of about lr·ε per step. Measured ~4e-8;
  any real mistake (a missing micro-batch, a wrong scale, a bucket not reduced) is ≥ 1e-3.
- bf16, RTOL_BF16 = 2e-2: bf16 keeps 8 significant bits (unit roundoff 2^-9 ≈ 2e-3 for
  every stored parameter and every forward/backward value); 10× that allows the rounding
  to compound over the 6 steps. Measured ~6e-3.
- fp16, RTOL_FP16 = 3e-3: 11 significant bits (2^-12 ≈ 2.4e-4), same 10× headroom with a
  start loss scale that does not overflow. Measured ~3e-4.
"""
from __future__ import annotations

import os

import pytest

from zero_core.memory import PRECISION_BYTES, optimizer_k
from zero_core.testing.ranks import mpirun_path, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "engine_train.py")
RTOL_FP32, RTOL_BF16, RTOL_FP16 = 1e-5, 2e-2, 3e-3
COMM = {"torchrun": "gloo", "mpirun": "mpi"}

pytestmark = pytest.mark.multirank


def _launchers():
    out = ["torchrun"]
    out.append(pytest.param("mpirun", marks=pytest.mark.skipif(
        mpirun_path() is None, reason="mpirun not installed: pip install 'zero-core[mpi]'")))
    return out


def run(scenarios: str, nprocs: int, launcher: str):
    results = run_ranks(WORKER, nprocs, launcher, args=[scenarios],
                        env={"ZERO_CORE_COMM": COMM[launcher]}, timeout=600)
    reports = [r.report for r in results]
    assert all(rep is not None for rep in reports), "a rank did not report"
    return reports


def check_reference_run(res: dict, rtol: float, steps: int, gas: int):
    assert res["rel_diff"] <= rtol, res["rel_diff"]
    assert abs(res["norm"] - res["ref_norm"]) <= max(rtol, 1e-6) * res["ref_norm"]
    assert res["global_steps"] == steps and res["micro_steps"] == steps * gas
    assert res["skipped"] == 0
    assert res["tied"] and res["frozen_unchanged"]


def check_memory(rep: dict, stage: int, precision: str, k: int):
    """Ledger vs ARCHITECTURE §4 formula, per category: the ledger may exceed the formula only
    by the padding (elements × bytes per element of that category)."""
    led, form, pad = rep["ledger"], rep["formula"], rep["padding_elements"]
    b = PRECISION_BYTES[precision]
    per_elem = {"parameters": b, "gradients": b, "master_weights": 4 if precision != "fp32" else 0,
                "optimizer_states": k - 4}
    for cat, nbytes in per_elem.items():
        extra = led[cat] - form[cat]
        assert 0 <= extra <= pad * nbytes, (cat, led[cat], form[cat], pad)


def check_comm(res: dict, stage: int, nprocs: int, gas: int):
    """The ledger of one step: stage 0 all-reduces the padded gradient once per step;
    stages 1/2 reduce-scatter it (stage 2: every micro-step) and all-gather the parameters."""
    ops = res["comm"]["ops"]
    padded = res["memory"]["num_parameters"] + res["memory"]["padding_elements"]
    nbytes = 4 * padded
    frac = (nprocs - 1) / nprocs
    # besides: one all_reduce of three float64 (the squared gradient norm and two sums of
    # the per-rank sample counts, safety.check_batch_sizes) per step
    stats = 3 * 8
    if stage == 0:
        sent = ops["all_reduce"]["sent_bytes"]
        assert abs(sent - 2 * frac * (nbytes + stats)) <= ops["all_reduce"]["calls"]
        assert "reduce_scatter" not in ops
        return
    reductions = gas if stage == 2 else 1
    # gloo carries reduce_scatter as an all-to-all plus a local sum, and the ledger records
    # the wire op; both send (n-1)/n of the input
    rs_ops = [ops[op] for op in ("reduce_scatter", "all_to_all_single") if op in ops]
    assert len(rs_ops) == 1, ops
    rs, ag = rs_ops[0], ops["all_gather_into"]
    assert abs(rs["sent_bytes"] - reductions * frac * nbytes) <= rs["calls"]
    assert abs(ag["sent_bytes"] - frac * nbytes) <= ag["calls"]
    assert ops["all_reduce"]["calls"] == 1 and ops["all_reduce"]["payload_bytes"] == stats


def same_on_all_ranks(reports, path):
    values = []
    for rep in reports:
        v = rep
        for key in path:
            v = v[key]
        values.append(v)
    assert all(v == values[0] for v in values), (path, values)


@pytest.mark.parametrize("launcher", _launchers())
@pytest.mark.parametrize("nprocs", [2, 4])
def test_fp32_stages_match_reference(launcher, nprocs):
    scenarios = "fp32,gas,memory" if nprocs == 2 else "fp32,memory"
    reports = run(scenarios, nprocs, launcher)
    for stage in (0, 1, 2):
        res = reports[0]["fp32"][f"stage{stage}"]
        check_reference_run(res, RTOL_FP32, steps=10, gas=2)
        check_memory(res["memory"], stage, "fp32", 12)
        check_comm(res, stage, nprocs, gas=2)
        # after the all-gather every rank holds bit-identical parameters
        same_on_all_ranks(reports, ["fp32", f"stage{stage}", "checksum"])
    if nprocs == 2:
        # k micro-batches accumulated == one k-times larger batch (the reference)
        for stage in (1, 2):
            for gas in (1, 3):
                res = reports[0]["gas"][f"stage{stage}_gas{gas}"]
                check_reference_run(res, RTOL_FP32, steps=4, gas=gas)
    for name, rep in reports[0]["memory"].items():
        stage, precision, opt = name.split("_")
        check_memory(rep, int(stage[-1]), precision, optimizer_k(opt, 0.9))


def test_memory_single_rank():
    (rep,) = run("memory", 1, "torchrun")
    for name, mem in rep["memory"].items():
        stage, precision, opt = name.split("_")
        check_memory(mem, int(stage[-1]), precision, optimizer_k(opt, 0.9))
        # with one rank every stage holds the same model states
        assert mem["formula"]["model_states"] == rep["memory"][f"stage0_{precision}_{opt}"]["formula"]["model_states"]


@pytest.mark.parametrize("launcher", _launchers())
def test_mixed_precision_and_fp16_overflow(launcher):
    reports = run("bf16,fp16,overflow", 2, launcher)
    rep = reports[0]
    for stage in (0, 1, 2):
        check_reference_run(rep["bf16"][f"stage{stage}"], RTOL_BF16, steps=6, gas=2)
        check_reference_run(rep["fp16"][f"stage{stage}"], RTOL_FP16, steps=6, gas=2)
        ov = rep["overflow"][f"stage{stage}"]
        # the inf was injected on the last rank only, at step 2: every rank skips it
        assert ov["skipped"] == [0, 0, 1, 1]
        assert ov["scales"][2][1] == ov["scales"][2][0] / 2          # hysteresis 1: halved
        before, after = ov["sums"][2]
        assert before == after                                        # parameters untouched
        assert ov["sums"][3][0] != ov["sums"][3][1]                   # training resumes
        same_on_all_ranks(reports, ["overflow", f"stage{stage}"])


def test_user_optimizers_sgd_and_bad_input():
    reports = run("sgd,user_opt,errors,buffers", 2, "torchrun")
    rep = reports[0]
    for stage in (0, 2):
        check_reference_run(rep["sgd"][f"stage{stage}"], RTOL_FP32, steps=6, gas=2)
    # torch optimizers re-created over the partitions, per-group lr kept
    check_reference_run(rep["user_opt"]["adamw"], RTOL_FP32, steps=5, gas=2)
    check_reference_run(rep["user_opt"]["adagrad"], RTOL_FP32, steps=5, gas=2)
    check_reference_run(rep["user_opt"]["rmsprop_stage0"], RTOL_FP32, steps=4, gas=2)
    check_reference_run(rep["user_opt"]["adagrad_bf16"], RTOL_BF16, steps=4, gas=2)
    assert rep["user_opt"]["adamw"]["lr"] == [1e-2, 5e-3]
    err = rep["errors"]
    assert "LBFGS" in err["lbfgs"] and "element-wise" in err["lbfgs"] and "stage 0" in err["lbfgs"]
    assert err["lbfgs_stage0_ok"]
    assert "'emb.weight' differs across ranks" in err["differs"]
    assert "torch.manual_seed" in err["differs"]
    assert err["no_optimizer_is_none"] and "built without an optimizer" in err["no_optimizer"]
    # buffers come from rank 0 (rank r set gain to 1 + r)
    assert [r["buffers"]["gain"] for r in reports] == [1.0, 1.0]
