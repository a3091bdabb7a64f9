"""LoRA actors (peft) at stage 3, with the reference computed by disabling the adapter
(issue 27 §3).

One 2-rank launch (tests/workers/lora_stage3.py): a tiny GPT-2 wrapped with peft LoRA on
c_attn (r=4), trained at ZeRO stage 3 (fp32, AdamW from the config) for two steps, each
rank on its own micro-batch, against a single-process reference (the same peft model in
plain torch, torch.optim.AdamW over the LoRA parameters, fed both ranks' batches).
"""
from __future__ import annotations

import os

import pytest

from zero_core.testing.ranks import run_ranks

# peft is in the test extra (the workers import it, not pytest: importing it here would cost
# every test run its import time); without it the launch fails, it is not skipped
pytestmark = pytest.mark.multirank

WORKER = os.path.join(os.path.dirname(__file__), "workers", "lora_stage3.py")


@pytest.fixture(scope="module")
def reports():
    results = run_ranks(WORKER, 2, "torchrun", env={"ZERO_CORE_COMM": "gloo"}, timeout=300)
    return [r.report for r in results]


def test_lora_weights_match_the_single_process_reference(reports):
    for rep in reports:
        assert rep["world_size"] == 2
        assert len(rep["lora_names"]) == 4  # lora_A and lora_B of both blocks' c_attn
        assert all("lora_" in n for n in rep["lora_names"])
        for name, err in rep["lora_err"].items():
            assert err <= 1e-5, (name, err)
        # the check has teeth: every LoRA weight moved well beyond the tolerance
        for name, moved in rep["lora_moved"].items():
            assert moved > 1e-3, (name, moved)
        # the mean of the ranks' micro-batch losses is the reference's loss on both batches
        for step, ref in enumerate(rep["ref_losses"]):
            mean = sum(r["losses"][step] for r in reports) / len(reports)
            assert mean == pytest.approx(ref, rel=1e-5)


def test_base_weights_unchanged(reports):
    for rep in reports:
        frozen = rep["frozen_equal"]
        assert frozen and all(frozen.values()), [n for n, ok in frozen.items() if not ok]
        assert not set(frozen) & set(rep["lora_names"])


def test_optimizer_state_only_for_lora_parameters(reports):
    for rep in reports:
        assert rep["trainable_param_names"] == rep["lora_names"]
        trainable = [u for u in rep["units"] if u["trainable"]]
        frozen = [u for u in rep["units"] if not u["trainable"]]
        assert rep["trainable_units"] == len(trainable) > 0 and frozen
        assert sorted(n for u in trainable for n in u["names"]) == rep["lora_names"]
        assert not any("lora_" in n for u in frozen for n in u["names"])
        # AdamW: exp_avg and exp_avg_sq (fp32) of this rank's share of the LoRA units only
        lora_padded = sum(u["padded_numel"] for u in trainable)
        ledger = rep["ledger"]
        assert ledger["optimizer_states"] == 2 * 4 * lora_padded // rep["world_size"]
        assert ledger["master_weights"] == 0
        assert ledger["gradients"] == 4 * lora_padded // rep["world_size"]
        frozen_padded = sum(u["padded_numel"] for u in frozen)
        assert ledger["frozen_parameters"] == 4 * frozen_padded // rep["world_size"]


def test_disable_adapter_gives_the_base_model(reports):
    for rep in reports:
        # inside engine.module.disable_adapter(): exactly the model before LoRA was added
        assert rep["disabled_equals_base"], rep["disabled_max_diff"]
        # outside it the trained adapter acts: different logits, the reference's values
        assert rep["enabled_max_diff_from_base"] > 1e-3
        assert rep["enabled_err_vs_ref"] <= 1e-5
