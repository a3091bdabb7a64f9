"""DeepSpeed's ``elasticity`` section (zero_core/config/elasticity.py) against DeepSpeed's own
results: ``tests/fixtures/deepspeed_elasticity.json``, written by
``ci/tools/make_elasticity_fixture.py`` with DeepSpeed 0.19.7 (the last release with elastic
training). DeepSpeed is not needed here."""
from __future__ import annotations

import copy
import json
import pathlib
import warnings

import pytest

from zero_core.config import parse_config
from zero_core.config.elasticity import (SCHEDULER_ENV, candidate_batch_sizes, elastic_plan,
                                         parse_elasticity, valid_world_sizes)
from zero_core.errors import ConfigError, ConfigWarning

FIXTURE = json.loads((pathlib.Path(__file__).resolve().parent / "fixtures" /
                      "deepspeed_elasticity.json").read_text())
CASES = FIXTURE["cases"]
DOCS = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6],
        "min_gpus": 1, "max_gpus": 10000, "min_time": 20, "prefer_larger_batch": True,
        "ignore_non_elastic_batch_info": False, "version": 0.1}


def error_of(config, world_size=1) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(config, world_size)
    return str(info.value)


def triple(cfg):
    return {"train_batch_size": cfg.train_batch_size,
            "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps}


def test_the_fixture_is_deepspeeds():
    assert FIXTURE["deepspeed"] == "0.19.7" and len(CASES) >= 10
    assert sum(len(c["runs"]) for c in CASES) >= 60


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_deepspeed(case):
    config, plan = case["config"], case["plan"]
    section = config["elasticity"]
    if plan is None:  # disabled: the batch keys resolve as without the section
        for ws, expected in case["runs"].items():
            assert triple(parse_config(config, int(ws))) == expected
        return
    if "error" in plan or not plan["valid_world_sizes"]:
        # DeepSpeed refuses the section (or no world size can ever run it): so does zero-core
        for ws in case["runs"]:
            error_of(config, int(ws))
        return
    ours = elastic_plan(parse_elasticity(section))
    assert ours.train_batch_size == plan["train_batch_size"]
    assert list(ours.valid_world_sizes) == plan["valid_world_sizes"]
    checked = 0
    for ws, expected in case["runs"].items():
        ws = int(ws)
        if ws not in plan["valid_world_sizes"]:
            msg = error_of(config, ws)
            assert f"world size {ws} cannot train the elastic global batch " \
                   f"{plan['train_batch_size']}" in msg and "nearest valid world size" in msg
            if "error" in expected:  # DeepSpeed 0.1 refuses it too
                assert expected["error"] == "ElasticityIncompatibleWorldSize"
            else:  # DeepSpeed 0.2 falls back to another global batch: named, refused
                assert float(section.get("version", 0.2)) == 0.2
                assert f"another global batch ({expected['train_batch_size']})" in msg
            continue
        if "error" in expected:  # the batch keys next to the section
            assert expected["error"] == "ElasticityConfigError"
            assert "batch related parameters" in expected["message"]
            msg = error_of(config, ws)
            assert "enabled 'elasticity' section" in msg
            assert "elasticity.ignore_non_elastic_batch_info" in msg
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = parse_config(config, ws)
        assert triple(cfg) == expected, ws
        assert cfg.train_batch_size == plan["train_batch_size"]
        overridden = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                  "gradient_accumulation_steps")
                      if k in config and config[k] != expected[k]]
        assert len([w for w in caught if issubclass(w.category, ConfigWarning)]) == len(overridden)
        checked += 1
    assert checked or case["name"] == "batch_keys_refused"


def test_global_batch_stays_while_accumulation_changes():
    results = {ws: parse_config({"elasticity": DOCS, "optimizer": {"type": "AdamW"}}, ws)
               for ws in (1, 2, 4)}
    assert {c.train_batch_size for c in results.values()} == {1680}
    assert [c.gradient_accumulation_steps for c in results.values()] == [280, 140, 70]
    for ws, c in results.items():
        assert c.world_size == ws
        assert c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * ws == 1680
    # the resolved config round-trips (it no longer needs the section)
    again = parse_config(json.loads(json.dumps(results[2].to_dict())), 2)
    assert again == results[2]


def test_conflicting_batch_keys_are_refused_naming_both():
    msg = error_of({"elasticity": DOCS, "train_micro_batch_size_per_gpu": 4}, 2)
    assert "config key 'train_micro_batch_size_per_gpu' = 4" in msg
    assert "'elasticity'" in msg and "1680, 6 and 140 at world size 2" in msg
    assert "ignore_non_elastic_batch_info" in msg
    # with ignore_non_elastic_batch_info the elastic values win, aloud
    section = dict(DOCS, ignore_non_elastic_batch_info=True)
    with pytest.warns(ConfigWarning, match="'train_batch_size' = 64 is overridden by "
                                           "elasticity: 1680"):
        cfg = parse_config({"elasticity": section, "train_batch_size": 64}, 4)
    assert triple(cfg) == {"train_batch_size": 1680, "train_micro_batch_size_per_gpu": 6,
                           "gradient_accumulation_steps": 70}


def test_an_invalid_world_size_names_the_nearest_valid_ones():
    msg = error_of({"elasticity": DOCS}, 9)
    assert "world size 9" in msg and "the nearest valid world sizes are 8 and 10" in msg
    msg = error_of({"elasticity": dict(DOCS, max_gpus=12)}, 13)
    assert "the nearest valid world size is 12" in msg


def test_model_parallelism_is_refused_by_name():
    for version in (0.1, 0.2):
        msg = error_of({"elasticity": dict(DOCS, version=version, model_parallel_size=2,
                                           num_gpus_per_node=2)}, 2)
        assert "config key 'elasticity.model_parallel_size' = 2" in msg
        assert "model parallelism is not implemented" in msg


def test_unknown_keys_and_bad_values_are_errors():
    msg = error_of({"elasticity": dict(DOCS, prefer_large_batch=False)})  # DeepSpeed's docs' typo
    assert "unknown config key 'elasticity.prefer_large_batch'" in msg
    assert "did you mean 'prefer_larger_batch'" in msg
    # key names are checked in a disabled section too
    assert "did you mean 'max_gpus'" in error_of({"elasticity": {"enabled": False, "max_gpu": 8}})
    assert "'elasticity.version' = 0.3" in error_of({"elasticity": dict(DOCS, version=0.3)})
    assert "'elasticity.micro_batch_sizes' = 4" in error_of(
        {"elasticity": dict(DOCS, micro_batch_sizes=4)})
    assert "'elasticity.max_train_batch_size' is missing" in error_of(
        {"elasticity": {"enabled": True, "micro_batch_sizes": [2]}})


def test_a_disabled_section_has_no_effect():
    plain = parse_config({"train_batch_size": 8}, 2)
    assert parse_config({"train_batch_size": 8, "elasticity": dict(DOCS, enabled=False)}, 2) == plain
    assert parse_config({"train_batch_size": 8, "elasticity": {"max_train_batch_size": 10}}, 2) \
        == plain
    assert parse_config({"train_batch_size": 8, "elasticity": {"enabled": False}}, 2) == plain


def test_min_time_and_version_spellings_change_nothing():
    base = parse_config({"elasticity": DOCS}, 4)
    assert parse_config({"elasticity": dict(DOCS, min_time=0)}, 4) == base
    assert parse_config({"elasticity": dict(DOCS, version="0.1")}, 4) == base
    # version 0.2 with one GPU per node plans as 0.1
    assert parse_config({"elasticity": dict(DOCS, version=0.2, num_gpus_per_node=1)}, 4) == base


def test_the_resource_schedulers_config_must_agree(monkeypatch):
    monkeypatch.setenv(SCHEDULER_ENV, json.dumps(DOCS))
    assert parse_config({"elasticity": DOCS}, 2).train_batch_size == 1680
    monkeypatch.setenv(SCHEDULER_ENV, json.dumps(dict(DOCS, max_train_batch_size=1000)))
    msg = error_of({"elasticity": DOCS}, 2)
    assert "'elasticity.max_train_batch_size' = 2000 differs from the resource scheduler's 1000" \
        in msg
    monkeypatch.setenv(SCHEDULER_ENV, "{not json")
    assert SCHEDULER_ENV in error_of({"elasticity": DOCS}, 2)


def test_the_parts():
    # DeepSpeed's docs example: bases 2, 4, 6 and their lcm 12, each scaled by an HCN
    assert candidate_batch_sizes([2, 4, 6, 12], 2000) == [1440, 1680]
    assert candidate_batch_sizes([16, 4], 8) == [8]  # a base above the cap is dropped
    assert valid_world_sizes(12, [4, 12], 1, 100) == [1, 3]
    assert valid_world_sizes(1680, [6], 100, 300) == [140, 280]
    section = copy.deepcopy(DOCS)
    plan = elastic_plan(parse_elasticity(section))
    assert plan.batch(3) == (1680, 4, 140) and plan.batch(9) is None
