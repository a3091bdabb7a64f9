"""The gradient path's dtypes as DeepSpeed configures them, on 2 real ranks (gloo), ZeRO
stages 0-3: ``communication_data_type`` (what the reduction carries) and
``data_types.grad_accum_dtype`` (what the optimizer's gradient accumulates in).

One launch of tests/workers/grad_dtypes.py builds every engine. Its model's gradients are
known exactly (each parameter enters the loss as ``sum(w * x)``, the loss factor is a power
of two), so the references are float64 sums of the per-rank gradients, rounded where the
configuration says a rounding happens. Bounds, and why:

- a configured rounding is modelled exactly, so "equal" means bit-equal (max |diff| = 0):
  bf16 + fp32 communication lands in bf16 as the float64 sum rounded once; fp32 + bf16
  communication is each rank's gradient rounded to bf16, summed, rounded to bf16 once;
- bytes per element come from the communicator's ledger: 4 for fp32, 2 for bf16;
- fp32 accumulation with fp32 communication gives the float64 sum within fp32 rounding,
  REL_FP32 = 1e-6 (a few fp32 ulps of the largest element; measured 0);
- the bf16 default differs measurably from fp32 accumulation: more than REL_BF16_VISIBLE
  = 5e-4 of the largest element (bf16's unit roundoff is 2^-9 ≈ 2e-3; measured 3e-3 to
  6e-3), i.e. hundreds of times REL_FP32;
- the memory ledger right after initialize: fp32 accumulation adds exactly 2 bytes per
  accumulator element (stage 1: the full padded gradient, stages 2-3: this rank's
  partition) to "gradients" and "model_states", and changes nothing else.
"""
from __future__ import annotations

import os

import pytest

from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "grad_dtypes.py")
RANKS = 2
REL_FP32, REL_BF16_VISIBLE = 1e-6, 5e-4

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def reports():
    results = run_ranks(WORKER, RANKS, "torchrun", env={"ZERO_CORE_COMM": "gloo"},
                        timeout=300)
    reps = [r.report for r in results]
    assert all(rep is not None and rep["world"] == RANKS for rep in reps), "a rank did not report"
    return reps


def each(reports, key):
    return [rep[key] for rep in reports]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_training_reduces_in_fp32(reports, stage):
    for r in each(reports, f"comm32/s{stage}"):
        assert r["bytes_per_element"] == 4.0, r
        assert r["expected"]["max_abs"] == 0.0, r          # the fp32 sum, rounded to bf16 once
        assert r["expected"]["dtypes"] == ["bfloat16"], r  # lands in the bf16 accumulator
        assert r["vs_exact_sum"]["rel"] > 0.0, r           # and that rounding is visible


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_training_reduces_in_bf16(reports, stage):
    for r in each(reports, f"comm16/s{stage}"):
        assert r["bytes_per_element"] == 2.0, r
        assert r["expected"]["max_abs"] == 0.0, r
        assert r["expected"]["dtypes"] == ["float32"], r
        # an fp32 reduction would be within ~1e-7 of the exact sum
        assert r["vs_exact_sum"]["rel"] > REL_BF16_VISIBLE, r


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_accumulation_gives_the_fp32_sum(reports, stage):
    for r in each(reports, f"acc32_comm32/s{stage}"):
        assert r["vs_exact_sum"]["rel"] <= REL_FP32, r
        assert r["vs_exact_sum"]["dtypes"] == ["float32"], r
        assert r["bytes_per_element"] == 4.0, r
    # DeepSpeed's default communication dtype (bf16) with fp32 accumulation: each reduction
    # rounded to bf16 once, summed in fp32 (stage 1: local fp32 sums reduced once)
    for acc32, acc16 in zip(each(reports, f"acc32/s{stage}"), each(reports, f"acc16/s{stage}")):
        assert acc32["vs_fp32_accumulation"]["rel"] <= REL_FP32, acc32
        assert acc32["vs_fp32_accumulation"]["dtypes"] == ["float32"], acc32
        assert acc32["bytes_per_element"] == 2.0, acc32
        # the bf16 default accumulates with a rounding per micro-step: measurably off
        assert acc16["vs_fp32_accumulation"]["dtypes"] == ["bfloat16"], acc16
        assert acc16["vs_fp32_accumulation"]["rel"] > REL_BF16_VISIBLE, acc16


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_ledger_counts_the_fp32_accumulator(reports, stage):
    for acc32, acc16, both32 in zip(each(reports, f"acc32/s{stage}"),
                                    each(reports, f"acc16/s{stage}"),
                                    each(reports, f"acc32_comm32/s{stage}")):
        elements = acc32["padded_elements"] // (1 if stage == 1 else RANKS)
        grown = {cat: acc32["ledger_at_init"][cat] - acc16["ledger_at_init"][cat]
                 for cat in acc16["ledger_at_init"]}
        assert grown == {**{cat: 0 for cat in grown}, "gradients": 2 * elements,
                         "model_states": 2 * elements}, (grown, elements)
        assert both32["ledger_at_init"] == acc32["ledger_at_init"]   # comm dtype: no state
        assert acc32["ledger_after_step"]["gradients"] == acc32["ledger_at_init"]["gradients"]


def test_refusals_name_the_key_and_the_way_out(reports):
    for rep in reports:
        s0 = rep["refused/s0_accum"]
        assert s0 is not None and "data_types.grad_accum_dtype" in s0 and "stage 0" in s0 \
            and "zero_optimization.stage 1, 2 or 3" in s0, s0
        qgz = rep["refused/s3_qgz"]
        assert qgz is not None and "communication_data_type" in qgz \
            and "zero_quantized_gradients" in qgz, qgz
