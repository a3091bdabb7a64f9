"""Unknown keys inside sections and switched-off sections (GitHub issue #32).

* A nested key DeepSpeed ignores (it reads that section key by key: ``LENIENT_SECTIONS``) is a
  ConfigWarning naming its dotted path, and the config is what it is without the key; in a
  section DeepSpeed validates as a whole it stays an error.
* A near-miss of a key read in the section is an error with a "did you mean" everywhere
  (the rule: zero_core/config/checks.py), so a typo never trains with a default.
* A section with ``"enabled": false`` is accepted whatever else it carries (its values are not
  read), for every section with that switch, refused features' sections included; its key
  names are still checked.

The config shapes are real: GPT-NeoX's fp16 block (configs/20B.yml), trlx's Apex-era fp16
keys, a DeepSpeed-Chat bf16 block carrying fp16's keys and its hybrid_engine block written
with ``"enabled": false`` (dschat/utils/ds_utils.py).
"""
from __future__ import annotations

import difflib
import warnings

import pytest

from zero_core.config import checks as checks_module
from zero_core.config import keys as keys_module
from zero_core.config.checks import NEAR_MISS_RATIO, _known_keys, _near_miss
from zero_core.config.deepspeed_sections import DEEPSPEED_SECTION_KEYS, LENIENT_SECTIONS
from zero_core.config.keys import _SWITCHABLE_SECTIONS, NOT_YET_IMPLEMENTED, SUPPORTED_KEYS
from zero_core.config.parser import parse_config
from zero_core.errors import ConfigError, ConfigWarning

NEOX_FP16 = {"fp16": True, "enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 12, "hysteresis": 2, "min_loss_scale": 1}

CHAT_HYBRID_ENGINE = {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                      "release_inference_cache": False, "pin_parameters": True,
                      "tp_gather_partition_size": 8}


def parse_warned(config, world_size=1):
    """(the parsed Config, the ConfigWarning messages parsing gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = parse_config(config, world_size)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def error_of(config) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(config)
    return str(info.value)


# --- 1. nested keys DeepSpeed ignores -----------------------------------------------------------

def test_gpt_neox_fp16_block_runs_with_a_warning_naming_the_key():
    with pytest.warns(ConfigWarning, match=r"config key 'fp16\.fp16' is not a key zero-core "
                                           r"reads; ignored, as DeepSpeed up to 0\.17\.0 "
                                           r"ignores it") as record:
        cfg = parse_config({"fp16": NEOX_FP16})
    assert [w.filename for w in record] == [__file__]  # points at the caller's line
    without = dict(NEOX_FP16)
    del without["fp16"]
    assert cfg == parse_config({"fp16": without})
    assert cfg.fp16.enabled and cfg.fp16.initial_scale_power == 12


def test_trlx_apex_fp16_keys_and_fp16_keys_in_a_bf16_block_are_ignored_aloud():
    cfg, messages = parse_warned({"fp16": {"enabled": True, "min_loss_scale": 0.5,
                                           "fp16_scale_tolerance": 0.25, "opt_level": "O2"}})
    assert cfg.fp16.min_loss_scale == 0.5
    assert sorted(m.split("'")[1] for m in messages) == ["fp16.fp16_scale_tolerance",
                                                         "fp16.opt_level"]
    chat_bf16 = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
                 "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1}
    cfg, messages = parse_warned({"bfloat16": chat_bf16})
    assert cfg == parse_config({"bf16": {"enabled": True}})
    assert {m.split("'")[1] for m in messages} == {f"bfloat16.{k}" for k in chat_bf16
                                                   if k != "enabled"}


@pytest.mark.parametrize("section", sorted(s for s in LENIENT_SECTIONS if s in SUPPORTED_KEYS))
def test_every_lenient_section_ignores_an_unknown_key_with_a_warning(section):
    base = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}}
    config = {**base, section: {**base.get(section, {}), "zz_note": 1}}
    assert _near_miss("zz_note", _known_keys(section)) is None
    cfg, messages = parse_warned(config)
    assert messages == [f"config key '{section}.zz_note' is not a key zero-core reads; "
                        f"ignored, {LENIENT_SECTIONS[section]}"]
    assert cfg == parse_config({**base, section: base.get(section, {})})


@pytest.mark.parametrize("config,path", [
    ({"zero_optimization": {"stage": 2, "zz_note": 1}}, "zero_optimization.zz_note"),
    ({"zero_optimization": {"offload_optimizer": {"zz_note": 1}}},
     "zero_optimization.offload_optimizer.zz_note"),
    ({"optimizer": {"type": "Adam", "params": {"zz_note": 1}}}, "optimizer.params.zz_note"),
    ({"scheduler": {"type": "WarmupLR", "params": {"zz_note": 1}}}, "scheduler.params.zz_note"),
    ({"tensorboard": {"enabled": False, "zz_note": 1}}, "tensorboard.zz_note"),
    ({"wandb": {"zz_note": 1}}, "wandb.zz_note"),
    ({"hybrid_engine": {**CHAT_HYBRID_ENGINE, "zz_note": 1}}, "hybrid_engine.zz_note"),
    ({"safety": {"zz_note": 1}}, "safety.zz_note"),
    ({"comms_logger": {"enabled": False, "zz_note": 1}}, "comms_logger.zz_note"),
    ({"tensor_parallel": {"autotp_size": 1, "zz_note": 1}}, "tensor_parallel.zz_note"),
])
def test_sections_deepspeed_validates_whole_still_refuse_an_unknown_key(config, path):
    msg = error_of(config)
    assert f"unknown config key '{path}'" in msg and "valid keys in" in msg


@pytest.mark.parametrize("config,path,meant", [
    ({"fp16": {"enabled": True, "loss_scale_windw": 500}}, "fp16.loss_scale_windw",
     "loss_scale_window"),
    ({"fp16": {"enabled": True, "min_scale": 4}}, "fp16.min_scale", "min_loss_scale"),
    ({"fp16": {"Enabled": True}}, "fp16.Enabled", "enabled"),
    ({"bf16": {"enabled": True, "check_overflow": False}}, "bf16.check_overflow",
     "check_grad_overflow"),
    ({"bf16": {"enabled": True, "immediate_grad_updates": True}}, "bf16.immediate_grad_updates",
     "immediate_grad_update"),                                     # a no-effect key's near-miss
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 10}},
     "zero_optimization.stage3_prefetch_bucket_sise", "stage3_prefetch_bucket_size"),
    ({"data_types": {"param_type": "fp32"}}, "data_types.param_type", "param_dtype"),
    ({"torch_autocast": {"enable": True}}, "torch_autocast.enable", "enabled"),
    ({"checkpoint": {"tag_validate": "Fail"}}, "checkpoint.tag_validate", "tag_validation"),
    ({"activation_checkpointing": {"partition_activation": True}},
     "activation_checkpointing.partition_activation", "partition_activations"),
    ({"elasticity": {"enabled": False, "max_gpu": 8}}, "elasticity.max_gpu", "max_gpus"),
    ({"optimizer": {"type": "AdamW", "param": {"lr": 0.1}}}, "optimizer.param", "params"),
    ({"hybrid_engine": {**CHAT_HYBRID_ENGINE, "max_out_token": 64}},
     "hybrid_engine.max_out_token", "max_out_tokens"),
    ({"flops_profiler": {"enable": True}}, "flops_profiler.enable", "enabled"),
    ({"amp": {"Enabled": True, "opt_level": "O1"}}, "amp.Enabled", "enabled"),
])
def test_a_near_miss_is_an_error_with_did_you_mean_in_every_section(config, path, meant):
    msg = error_of(config)
    assert f"unknown config key '{path}'; did you mean '{meant}'?" in msg


def test_the_near_miss_rule_is_the_suggestion_rule_and_separates_real_configs():
    """difflib ratio >= 0.6 (or the same letters in another case): what _suggest offers."""
    assert NEAR_MISS_RATIO == 0.6
    fp16 = _known_keys("fp16")
    ratio = lambda word: max(difflib.SequenceMatcher(None, word, k).ratio() for k in fp16)  # noqa: E731
    for typo in ("loss_scale_windw", "hysterisis", "initial_scale", "min_scale", "enable"):
        assert ratio(typo) >= NEAR_MISS_RATIO and _near_miss(typo, fp16) is not None, typo
    for foreign in ("fp16", "opt_level", "fp16_scale_tolerance", "type"):
        assert ratio(foreign) < NEAR_MISS_RATIO and _near_miss(foreign, fp16) is None, foreign
    assert "NEAR_MISS_RATIO" in checks_module.__doc__


# --- 2. switched-off sections -------------------------------------------------------------------

def test_deepspeed_chat_hybrid_engine_block_written_disabled_is_accepted():
    assert parse_config({"hybrid_engine": CHAT_HYBRID_ENGINE}) == parse_config({})
    # DeepSpeed's enable_cuda_graph and values zero-core refuses when the engine is on
    off = {**CHAT_HYBRID_ENGINE, "inference_tp_size": 4, "enable_cuda_graph": True,
           "max_out_tokens": 0}
    assert parse_warned({"hybrid_engine": off}) == (parse_config({}), [])
    msg = error_of({"hybrid_engine": {**CHAT_HYBRID_ENGINE, "enabled": True,
                                      "enable_cuda_graph": True}})
    assert "'hybrid_engine.enable_cuda_graph' (CUDA graphs for generation) is not " \
           "implemented yet" in msg
    assert parse_config({"hybrid_engine": {**CHAT_HYBRID_ENGINE, "enabled": True,
                                           "enable_cuda_graph": False}}).hybrid_engine.enabled
    # only a written "enabled": false switches reading off; absent, the values are checked
    assert "hybrid_engine.max_out_tokens" in error_of({"hybrid_engine": {"max_out_tokens": 0}})


@pytest.mark.parametrize("table", sorted(t for t, k in SUPPORTED_KEYS.items() if "enabled" in k))
def test_every_section_with_enabled_false_accepts_any_values(table):
    """Every other key of the section, and every not-yet-implemented one, at a value that
    would be refused if read: the config is the default one."""
    others = [k for k in SUPPORTED_KEYS[table] + tuple(NOT_YET_IMPLEMENTED.get(table, {}))
              if k != "enabled"]
    assert others, table
    section = {"enabled": False, **{k: "not read" for k in others}}
    cfg, messages = parse_warned({table: section})
    assert cfg == parse_config({}) and messages == []
    # the names are still checked: a near-miss is refused, an unknown key treated as in item 1
    assert "did you mean 'enabled'" in error_of({table: {**section, "enable": True}})


def test_disabled_precision_sections_do_not_refuse_what_applies_only_when_enabled():
    plain = parse_config({})
    assert parse_config({"fp16": {"enabled": False, "auto_cast": True,
                                  "fp16_master_weights_and_grads": True}}) == plain
    assert parse_config({"bf16": {"enabled": False, "bf16_master_weights_and_grads": True,
                                  "bf16_optimizer_states": True}}) == plain
    assert parse_config({"wandb": {"enabled": False, "project": "x"}}) == plain
    assert parse_config({"comet": {"enabled": False, "experiment_key": "short"}}) == plain
    # enabled, the same values are read and refused as before
    assert "fp16.auto_cast" in error_of({"fp16": {"auto_cast": True}})


def _switched_off_values(keys):
    # parallel sizes are switches too (_asks_for_nothing): 1 is their "off"
    return {k: 1 if k.endswith("_size") else "not read" for k in keys if k != "enabled"}


@pytest.mark.parametrize("name", sorted(n for n, k in DEEPSPEED_SECTION_KEYS.items()
                                        if "enabled" in k))
def test_a_refused_features_section_with_enabled_false_is_accepted(name):
    section = {"enabled": False, **_switched_off_values(DEEPSPEED_SECTION_KEYS[name])}
    cfg, messages = parse_warned({name: section})
    assert cfg == parse_config({}) and messages == []
    assert "not implemented yet" in error_of({name: {**section, "enabled": True}})
    assert "did you mean 'enabled'" in error_of({name: {**section, "enable": False}})


def test_unknown_keys_in_a_refused_features_section_follow_deepspeed():
    # flops_profiler is read key by key in DeepSpeed: ignored aloud
    cfg, messages = parse_warned({"flops_profiler": {"enabled": False, "zz_note": 1}})
    assert cfg == parse_config({})
    assert messages == ["config key 'flops_profiler.zz_note' is not a key zero-core reads; "
                        "ignored, as DeepSpeed ignores it"]
    # comms_logger is a pydantic model that forbids extra keys: an error, as there
    assert "unknown config key 'comms_logger.zz_note'" in error_of(
        {"comms_logger": {"enabled": False, "zz_note": 1}})
    # axolotl's torch.compile block (zero1_torch_compile.json): keys DeepSpeed 0.14.4 to 0.16.5
    # never read (the section only changes speed); DeepCompile switched on is still refused
    cfg, messages = parse_warned({"compile": {"disable": False, "backend": "inductor"}})
    assert cfg == parse_config({})
    assert [m.split("'")[1] for m in messages] == ["compile.disable", "compile.backend"]
    assert "DeepCompile" in error_of({"compile": {"deepcompile": True, "backend": "inductor"}})
    # a nested switch that is on still asks for the feature (DeepSpeed reads it)
    assert "not implemented yet" in error_of(
        {"data_efficiency": {"enabled": False, "data_routing": {"random_ltd": {"enabled": True}}}})


def test_the_leniency_tables_name_real_sections():
    for section, where in LENIENT_SECTIONS.items():
        assert section in SUPPORTED_KEYS or section in DEEPSPEED_SECTION_KEYS, section
        assert len(where) > 10, section
    assert set(DEEPSPEED_SECTION_KEYS) <= _SWITCHABLE_SECTIONS
    # the strict sections DeepSpeed validates with pydantic (extra keys forbidden)
    for strict in ("zero_optimization", "zero_optimization.offload_optimizer", "tensorboard",
                   "csv_monitor", "wandb", "comet", "hybrid_engine", "comms_logger",
                   "tensor_parallel", "optimizer.params", "scheduler.params", "safety"):
        assert strict not in LENIENT_SECTIONS
    assert "LENIENT_SECTIONS" in keys_module.__doc__
