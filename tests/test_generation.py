"""Stage-3 generation (issue 27 §1-§3): tokens equal the unpartitioned model's, the bytes
each decode step gathers equal the formula, the hybrid engine's switches, the context
manager, the inference engine, and ranks that leave the decode loop apart.

The formula (zero_core/stage3/generation_cache.py), per forward pass without autograd,
fp32 (4 bytes), N ranks: all-gather bytes = 4 · (N-1)/N · Σ padded elements of the units
outside the kept set, which fills in the first pass: units first-fit in first-use order
up to capacity = B when the model's units fit in B, else B − the largest unit. So over T
decode passes: the first gathers every unit, each later one the units not kept.
"""
from __future__ import annotations

import os

import pytest

from zero_core.config import parse_config
from zero_core.errors import ConfigError
from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "generation.py")


def kept_elements(sizes: list[int], budget: int) -> int:
    """The kept set's elements, stated here from the rule (not the engine's code)."""
    if sum(sizes) <= budget:
        return sum(sizes)
    room, kept = max(0, budget - max(sizes)), 0
    for n in sizes:
        if kept + n <= room:
            kept += n
    return kept


@pytest.fixture(scope="module")
def reports():
    results = run_ranks(WORKER, 2, "torchrun", env={"ZERO_CORE_COMM": "gloo"}, timeout=300)
    return [r.report for r in results]


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", ["fits", "half", "zero"])
def test_decode_steps_gather_exactly_the_formula(reports, scenario):
    for rep in reports:
        r = rep[scenario]
        share = (rep["world_size"] - 1) / rep["world_size"]
        sizes, budget = r["sizes"], r["budget"]
        assert sum(sizes) == rep["model_numel"]
        assert r["tokens_equal"], r["tokens"]
        kept = kept_elements(sizes, budget)
        assert r["passes"] == 6
        want = (sum(sizes) + (r["passes"] - 1) * (sum(sizes) - kept)) * 4 * share
        assert r["bytes"] == want, (scenario, r["bytes"], want)
        # kept units stay gathered after generate until training resumes, then none
        assert r["live_after"] == kept and r["live_after_train"] == 0
    # the three budgets really differ: everything kept, some kept, nothing kept
    r = reports[0]
    assert kept_elements(r["fits"]["sizes"], r["fits"]["budget"]) == r["model_numel"]
    assert 0 < kept_elements(r["half"]["sizes"], r["half"]["budget"]) < r["model_numel"]
    assert kept_elements(r["zero"]["sizes"], 0) == 0


@pytest.mark.multirank
def test_hybrid_engine_gathers_once_and_releases_as_configured(reports):
    for rep in reports:
        once = rep["model_numel"] * 4 * (rep["world_size"] - 1) / rep["world_size"]
        h = rep["hybrid"]
        released, kept = h["release=True"], h["release=False"]
        for call in (released["first"], released["second"], kept["first"], kept["second"]):
            assert call["tokens_equal"], call["tokens"]
        # release_inference_cache true: each call gathers the model once and frees it
        assert released["first"]["bytes"] == released["second"]["bytes"] == once
        assert released["first"]["live_after"] == 0
        # false: the second call finds the model gathered; training releases it
        assert kept["first"]["bytes"] == once and kept["second"]["bytes"] == 0
        assert kept["second"]["live_after"] == rep["model_numel"]
        assert kept["live_after_train"] == 0
        assert "hybrid_engine.max_out_tokens = 64" in h["max_out_tokens_error"]


@pytest.mark.multirank
def test_gathered_for_generation_then_training(reports):
    for rep in reports:
        g = rep["gathered"]
        assert g["tokens_equal"] and g["live_after"] == 0 and g["hooks_back"]
        assert g["bytes"] == rep["model_numel"] * 4 * (rep["world_size"] - 1) / rep["world_size"]
        assert g["loss"] == pytest.approx(g["ref_loss"], rel=1e-6)


@pytest.mark.multirank
def test_inference_engine_has_no_optimizer(reports):
    for rep in reports:
        i = rep["inference"]
        assert i["optimizer_is_none"] and i["logits_equal"] and i["trainable_units"] == 0
        assert "built without an optimizer" in i["backward_error"]
        # parameters only, partitioned: 4 bytes x Ψ / N, which the ledger counts as frozen
        want = i["model_numel"] * 4 / rep["world_size"]
        assert i["memory"]["formula"] == {"parameters": want, "model_states": want}
        assert i["memory"]["ledger"]["frozen_parameters"] == want
        assert i["memory"]["ledger"]["optimizer_states"] == 0


@pytest.mark.multirank
def test_ranks_leaving_the_decode_loop_apart(reports):
    for rank, rep in enumerate(reports):
        d = rep["diverging"]
        # engine.generate: synced_gpus keeps the ranks stepping; each gets its own length
        assert d["synced"]["tokens_equal"]
        assert len(d["synced"]["tokens"][0]) == 6 + 3 + 2 * rank
        # the model's generate without synced_gpus: a named error on every rank, no hang
        assert d["error"] is not None and "different steps" in d["error"]


def test_hybrid_engine_section_as_deepspeed_chat_writes_it():
    chat = {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
            "release_inference_cache": False, "pin_parameters": True,
            "tp_gather_partition_size": 8}
    assert parse_config({"hybrid_engine": chat}) == parse_config({})
    # disabled, tensor parallel values are accepted as DeepSpeed accepts them
    parse_config({"hybrid_engine": {**chat, "inference_tp_size": 2}})
    cfg = parse_config({"hybrid_engine": {**chat, "enabled": True,
                                          "release_inference_cache": True}})
    assert cfg.hybrid_engine.enabled and cfg.hybrid_engine.release_inference_cache
    with pytest.raises(ConfigError, match="inference_tp_size.*tensor parallelism"):
        parse_config({"hybrid_engine": {**chat, "enabled": True, "inference_tp_size": 2}})
    with pytest.raises(ConfigError, match="hybrid_engine.max_out_tokens"):
        parse_config({"hybrid_engine": {"max_out_tokens": 0}})
    with pytest.raises(ConfigError, match="unknown config key 'hybrid_engine.pin_params'"):
        parse_config({"hybrid_engine": {"pin_params": True}})
    assert parse_config({"generation": {"max_live_parameters": 0}}).generation.max_live_parameters == 0
    with pytest.raises(ConfigError, match="generation.max_live_parameters"):
        parse_config({"generation": {"max_live_parameters": -1}})
