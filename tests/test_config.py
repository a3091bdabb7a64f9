"""Configuration parsing: DeepSpeed keys and defaults, the batch-size triple, and errors that
name the key, the value and what would be valid."""
import dataclasses
import itertools
import json
import random
import re

import pytest
import torch

import zero_core.config as config_module
import zero_core.config.keys as keys_module
from zero_core.config import (NEUTRAL_VALUES, NOT_YET_IMPLEMENTED, SUPPORTED_KEYS, Config,
                              parse_config)
from zero_core.config.keys import NO_EFFECT_KEYS
from zero_core.errors import ConfigError, ConfigWarning


def error_of(config, world_size=1) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(config, world_size)
    return str(info.value)


# --- defaults and inputs ---------------------------------------------------------------------

def test_defaults():
    cfg = parse_config(None, world_size=3)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
            cfg.train_batch_size) == (1, 1, 3)
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 10  # DeepSpeed 0.19's
    assert not cfg.wall_clock_breakdown
    assert cfg.fp16 == config_module.FP16Config(enabled=False, loss_scale=0.0,
                                                initial_scale_power=16, loss_scale_window=1000,
                                                hysteresis=2, min_loss_scale=1.0)
    assert not cfg.bf16.enabled
    assert cfg.optimizer is None and cfg.scheduler is None
    z = cfg.zero_optimization
    assert (z.stage, z.reduce_bucket_size) == (0, 5_000_000)
    assert z.overlap_comm and z.reduce_scatter
    assert (cfg.accelerator, cfg.comm_backend, cfg.comm_timeout) == (None, None, None)
    assert cfg.topology.ranks_per_node is None
    assert cfg.precision == "fp32" and cfg.compute_dtype is torch.float32
    assert parse_config({}, 3) == cfg


def test_json_file_pathlike_and_config_passthrough(tmp_path):
    data = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    from_path = parse_config(path, world_size=4)
    assert from_path == parse_config(str(path), world_size=4) == parse_config(data, 4)
    assert from_path.train_batch_size == 24 and from_path.zero_optimization.reduce_bucket_size == 5 * 10 ** 7
    assert parse_config(from_path, world_size=4) is from_path
    assert "resolved for world size 4" in error_of(from_path, world_size=2)
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,,}')
    assert "not valid JSON" in error_of(bad) and "line 1" in error_of(bad)
    assert "cannot read the config file" in error_of(str(tmp_path / "missing.json"))
    assert "must be a dict" in error_of([1, 2])
    assert parse_config('{"train_micro_batch_size_per_gpu": 2}', 2).train_batch_size == 4
    (tmp_path / "list.json").write_text("[1]")
    assert "JSON object" in error_of(tmp_path / "list.json")


def test_config_is_frozen():
    cfg = parse_config({"optimizer": {"type": "sgd"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gradient_clipping = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.lr = 1.0


def test_a_typical_deepspeed_config_moves_over():
    ds = {
        "train_batch_size": 64, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
        "steps_per_print": 2000, "wall_clock_breakdown": False,
        "fp16": {"enabled": True, "auto_cast": False, "loss_scale": 0, "loss_scale_window": 500,
                 "initial_scale_power": 12, "hysteresis": 2, "min_loss_scale": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999],
                                                  "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                 "warmup_num_steps": 500, "total_num_steps": 10000}},
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                              "overlap_comm": True, "reduce_scatter": True,
                              "reduce_bucket_size": 2e8, "contiguous_gradients": True},
        "tensorboard": {"enabled": False, "output_path": "logs/"},
    }
    cfg = parse_config(ds, world_size=8)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (64, 2, 4)
    assert cfg.precision == "fp16" and cfg.compute_dtype is torch.float16
    assert cfg.fp16.initial_scale == 2.0 ** 12 and cfg.fp16.dynamic
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.betas == (0.8, 0.999)
    assert cfg.optimizer.weight_decay == 3e-7 and cfg.optimizer.adamw_mode
    assert cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.scheduler.params["total_num_steps"] == 10000
    assert cfg.scheduler.params["warmup_type"] == "log"
    assert cfg.zero_optimization.stage == 2


# --- batch size triple -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(10))
def test_any_two_of_the_batch_triple_give_the_third(seed):
    rng = random.Random(seed)
    mb, ga, ws = rng.randint(1, 16), rng.randint(1, 8), rng.randint(1, 12)
    tb = mb * ga * ws
    full = {"train_batch_size": tb, "train_micro_batch_size_per_gpu": mb,
            "gradient_accumulation_steps": ga}
    for keys in itertools.combinations(full, 2):
        cfg = parse_config({k: full[k] for k in keys}, world_size=ws)
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                cfg.gradient_accumulation_steps) == (tb, mb, ga), keys
    cfg = parse_config(full, world_size=ws)
    assert cfg.train_batch_size == tb
    # one alone: accumulation is 1
    assert parse_config({"train_micro_batch_size_per_gpu": mb}, ws).train_batch_size == mb * ws
    only_tb = parse_config({"train_batch_size": mb * ws}, ws)
    assert (only_tb.train_micro_batch_size_per_gpu, only_tb.gradient_accumulation_steps) == (mb, 1)


def test_batch_triple_errors():
    msg = error_of({"train_batch_size": 33, "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": 2}, world_size=4)
    assert "'train_batch_size' = 33" in msg and "4 × 2 × 4 = 32" in msg
    msg = error_of({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 3}, world_size=2)
    assert "'train_batch_size' = 32" in msg and "3 × 2" in msg and "try 30 or 36" in msg
    msg = error_of({"train_batch_size": 10, "gradient_accumulation_steps": 2}, world_size=3)
    assert "'train_batch_size' = 10" in msg and "2 × 3" in msg and "try 6 or 12" in msg
    msg = error_of({"train_batch_size": 7}, world_size=2)  # world size does not divide it
    assert "'train_batch_size' = 7" in msg and "world_size = 1 × 2" in msg
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert f"'{key}' = 0" in error_of({key: 0})
        assert f"'{key}' = 2.5" in error_of({key: 2.5})
    assert "world_size" in error_of({}, world_size=0)


# --- values --------------------------------------------------------------------------------------

def test_integral_floats_accepted_for_integers_and_types_checked():
    cfg = parse_config({"zero_optimization": {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 1e3},
                        "steps_per_print": 1e2})
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.stage3_prefetch_bucket_size, int)
    assert isinstance(cfg.steps_per_print, int) and cfg.steps_per_print == 100
    msg = error_of({"zero_optimization": {"reduce_bucket_size": 1.5}})
    assert "'zero_optimization.reduce_bucket_size' = 1.5" in msg and "whole" in msg
    msg = error_of({"zero_optimization": {"overlap_comm": "yes"}})
    assert "'zero_optimization.overlap_comm' = 'yes'" in msg and "true or false" in msg
    msg = error_of({"zero_optimization": {"stage": True}})
    assert "'zero_optimization.stage' = True" in msg and "integer" in msg
    msg = error_of({"gradient_clipping": -1})
    assert "'gradient_clipping' = -1" in msg and ">= 0" in msg
    msg = error_of({"gradient_clipping": "auto"})
    assert "Hugging Face" in msg and "'gradient_clipping'" in msg
    assert "'comm_timeout' = 0" in error_of({"comm_timeout": 0})
    assert "'accelerator' = ''" in error_of({"accelerator": ""})
    assert "'zero_optimization' = 2" in error_of({"zero_optimization": 2})


def test_zero_stage_and_bucket_sizes():
    for stage in (0, 1, 2, 3):
        assert parse_config({"zero_optimization": {"stage": stage}}).zero_optimization.stage == stage
    for stage in (-1, 4):
        msg = error_of({"zero_optimization": {"stage": stage}})
        assert f"'zero_optimization.stage' = {stage}" in msg and "0, 1, 2 or 3" in msg


def test_stage3_keys_and_their_spellings():
    z = parse_config({"zero_optimization": {"stage": 3}}).zero_optimization
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold,
            z.stage3_max_live_parameters, z.stage3_max_reuse_distance,
            z.stage3_gather_16bit_weights_on_model_save) == (50_000_000, 100_000, 10**9, 10**9, False)
    long = parse_config({"zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": 1e3, "stage3_param_persistence_threshold": 7,
        "stage3_max_live_parameters": 5e3, "stage3_max_reuse_distance": 0,
        "stage3_gather_16bit_weights_on_model_save": True}})
    short = parse_config({"zero_optimization": {
        "stage": 3, "prefetch_bucket_size": 1000, "param_persistence_threshold": 7,
        "max_live_parameters": 5000, "max_reuse_distance": 0,
        "stage3_gather_fp16_weights_on_model_save": True}})
    assert long == short and long.zero_optimization.stage3_max_live_parameters == 5000
    msg = error_of({"zero_optimization": {"stage3_max_live_parameters": 10,
                                          "max_live_parameters": 10}})
    assert "max_live_parameters" in msg and "keep one spelling" in msg
    # 0 is valid in DeepSpeed (keep nothing gathered beyond what runs); negative is not
    assert parse_config({"zero_optimization": {"stage3_max_live_parameters": 0}}) \
        .zero_optimization.stage3_max_live_parameters == 0
    msg = error_of({"zero_optimization": {"stage3_max_live_parameters": -1}})
    assert "'zero_optimization.stage3_max_live_parameters' = -1" in msg
    for key in ("reduce_bucket_size",):
        msg = error_of({"zero_optimization": {key: 0}})
        assert f"'zero_optimization.{key}' = 0" in msg and ">= 1" in msg


def test_precision():
    assert parse_config({"bf16": {"enabled": True}}).compute_dtype is torch.bfloat16
    old = parse_config({"bfloat16": {"enabled": True}})
    assert old.precision == "bf16" and old.bf16.enabled
    msg = error_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16 and bf16 cannot both be enabled" in msg and "'bf16.enabled'" in msg
    msg = error_of({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert "'bfloat16.enabled'" in msg
    assert "two spellings" in error_of({"bf16": {}, "bfloat16": {}})
    assert parse_config({"fp16": {"enabled": False}, "bf16": {"enabled": True}}).precision == "bf16"


def test_fp16_values():
    cfg = parse_config({"fp16": {"enabled": True, "loss_scale": 256, "hysteresis": 1,
                                 "consecutive_hysteresis": True, "min_loss_scale": 0.5}})
    assert not cfg.fp16.dynamic and cfg.fp16.initial_scale == 256.0
    assert cfg.fp16.consecutive_hysteresis and cfg.fp16.min_loss_scale == 0.5
    assert "'fp16.loss_scale' = -1" in error_of({"fp16": {"loss_scale": -1}})
    assert "'fp16.min_loss_scale' = 0" in error_of({"fp16": {"min_loss_scale": 0}})
    assert "'fp16.hysteresis' = 0" in error_of({"fp16": {"hysteresis": 0}})
    assert "'fp16.loss_scale_window' = 0" in error_of({"fp16": {"loss_scale_window": 0}})
    msg = error_of({"fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 8}})
    assert "'fp16.initial_scale_power' = 2" in msg and "below fp16.min_loss_scale" in msg


def test_optimizer():
    adam = parse_config({"optimizer": {"type": "adam", "params": {"lr": 0.01}}}).optimizer
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
    assert adam.type == "Adam" and adam.adamw_mode and adam.lr == 0.01
    assert (adam.betas, adam.eps, adam.weight_decay, adam.bias_correction) == ((0.9, 0.999), 1e-8, 0.0, True)
    l2 = parse_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False,
                                                                "bias_correction": False}}}).optimizer
    assert not l2.adamw_mode and not l2.bias_correction and l2.lr == 1e-3
    assert parse_config({"optimizer": {"type": "ADAMW"}}).optimizer.type == "AdamW"
    msg = error_of({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert "'optimizer.params.adam_w_mode' = False" in msg and "type 'Adam'" in msg
    sgd = parse_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9,
                                                                "nesterov": True,
                                                                "weight_decay": 1e-4}}}).optimizer
    assert (sgd.type, sgd.momentum, sgd.nesterov, sgd.weight_decay) == ("SGD", 0.9, True, 1e-4)
    msg = error_of({"optimizer": {"type": "sgd", "params": {"nesterov": True}}})
    assert "'optimizer.params.nesterov'" in msg and "momentum > 0" in msg
    msg = error_of({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}})
    assert "unknown config key 'optimizer.params.momentum'" in msg and "for Adam" in msg
    assert "betas" in msg  # lists what is valid
    msg = error_of({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}})
    assert "'optimizer.params.betas'" in msg and "for SGD" in msg
    msg = error_of({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}})
    assert "'optimizer.params.betas[1]' = 1.0" in msg and "[0, 1)" in msg
    assert "'optimizer.params.betas' = 0.9" in error_of({"optimizer": {"type": "Adam", "params": {"betas": 0.9}}})
    assert "'optimizer.params.eps' = 0" in error_of({"optimizer": {"type": "Adam", "params": {"eps": 0}}})
    msg = error_of({"optimizer": {"type": "Muon"}})
    assert "Muon optimizer is not implemented yet" in msg and "Adam, AdamW, SGD, Lamb" in msg
    lamb = parse_config({"optimizer": {"type": "lamb", "params": {"lr": 0.01, "max_coeff": 0.3,
                                                                  "min_coeff": 0.08}}}).optimizer
    assert (lamb.type, lamb.lr, lamb.max_coeff, lamb.min_coeff) == ("Lamb", 0.01, 0.3, 0.08)
    msg = error_of({"optimizer": {"type": "Lamb", "params": {"max_coeff": 0.01, "min_coeff": 0.1}}})
    assert "'optimizer.params.min_coeff' = 0.1" in msg and "max_coeff" in msg
    msg = error_of({"optimizer": {"type": "Lamb", "params": {"max_grad_norm": 1.0}}})
    assert "'optimizer.params.max_grad_norm'" in msg and "gradient_clipping" in msg
    msg = error_of({"optimizer": {"type": "Adamm"}})
    assert "'optimizer.type' = 'Adamm'" in msg and "did you mean 'Adam'" in msg
    assert "'optimizer.type' is missing" in error_of({"optimizer": {"params": {"lr": 1}}})
    msg = error_of({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}})
    assert "'optimizer.params.amsgrad'" in msg and "not implemented yet" in msg
    assert parse_config({"optimizer": {"type": "Adam", "params": {"amsgrad": False}}}).optimizer == \
        parse_config({"optimizer": {"type": "Adam"}}).optimizer


def test_scheduler():
    warm = parse_config({"scheduler": {"type": "WarmupLR"}}).scheduler
    assert warm.params == {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                           "warmup_type": "log", "last_batch_iteration": -1}
    decay = parse_config({"scheduler": {"type": "WarmupDecayLR",
                                        "params": {"total_num_steps": 5e3,
                                                   "warmup_min_lr": [0.0, 1e-5]}}}).scheduler
    assert decay.params["total_num_steps"] == 5000 and decay.params["warmup_max_lr"] == 0.001
    assert decay.params["warmup_min_lr"] == (0.0, 1e-5)
    cos = parse_config({"scheduler": {"type": "WarmupCosineLR",
                                      "params": {"total_num_steps": 10, "warmup_type": "linear"}}})
    assert cos.scheduler.params == {"total_num_steps": 10, "warmup_min_ratio": 0.0,
                                    "warmup_num_steps": 1000, "cos_min_ratio": 1e-4,
                                    "warmup_type": "linear", "last_batch_iteration": -1}
    msg = error_of({"scheduler": {"type": "WarmupCosineLR"}})
    assert "'scheduler.params.total_num_steps' is missing" in msg
    msg = error_of({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})
    assert "'scheduler.params.warmup_type' = 'cosine'" in msg and '"log" or "linear"' in msg
    msg = error_of({"scheduler": {"type": "WarmupCosineLR",
                                  "params": {"total_num_steps": 10, "cos_min_ratio": 2}}})
    assert "'scheduler.params.cos_min_ratio' = 2" in msg and "[0, 1]" in msg
    msg = error_of({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}})
    assert "unknown config key 'scheduler.params.total_num_steps'" in msg and "for WarmupLR" in msg
    msg = error_of({"scheduler": {"type": "WarmupLr"}})
    assert "did you mean 'WarmupLR'" in msg
    assert "OneCycle LR scheduler is not implemented yet" in error_of({"scheduler": {"type": "OneCycle"}})
    msg = error_of({"scheduler": {"type": "WarmupDecayLR",
                                  "params": {"total_num_steps": 5, "warmup_min_lr": [0, 0],
                                             "warmup_max_lr": [1, 1, 1]}}})
    assert "'scheduler.params.warmup_max_lr'" in msg and "3 entries" in msg


def test_topology_and_zero_core_keys():
    cfg = parse_config({"accelerator": "cpu", "comm_backend": "mpi", "comm_timeout": 30,
                        "topology": {"ranks_per_node": 2}}, world_size=4)
    assert (cfg.accelerator, cfg.comm_backend, cfg.comm_timeout) == ("cpu", "mpi", 30.0)
    assert cfg.topology.ranks_per_node == 2
    msg = error_of({"topology": {"ranks_per_node": 3}}, world_size=4)
    assert "'topology.ranks_per_node' = 3" in msg and "1, 2, 4" in msg
    assert parse_config({"topology": {"ranks_per_node": None}}).topology.ranks_per_node is None


# --- unknown and not-yet-implemented keys ----------------------------------------------------------

def test_unknown_keys_get_a_suggestion():
    msg = error_of({"fp16": {"loss_scale_windw": 10}})
    assert "'fp16.loss_scale_windw'" in msg and "did you mean 'loss_scale_window'" in msg
    msg = error_of({"zero_optimization": {"Stage": 1}})
    assert "did you mean 'stage'" in msg


def test_unknown_top_level_keys_warn_as_deepspeed_ignores_them():
    # DeepSpeed reads the top-level keys it knows and ignores the others (configs carry
    # launcher settings such as cuda_visible_devices there): a named warning, not an error
    with pytest.warns(ConfigWarning) as caught:
        cfg = parse_config({"cuda_visible_devices": "0,1", "train_micro_batch_size": 4})
    messages = [str(w.message) for w in caught]
    assert any("'cuda_visible_devices'" in m and "ignored" in m for m in messages)
    assert any("did you mean 'train_micro_batch_size_per_gpu'" in m for m in messages)
    assert cfg == parse_config({})


NOT_IMPLEMENTED_CASES = [
    ({"zero_optimization": {"stage3_model_persistence_threshold": 1e6}},
     "zero_optimization.stage3_model_persistence_threshold"),
    ({"zero_optimization": {"stage3_some_future_option": 1}}, "zero_optimization.stage3_some_future_option"),
    ({"zero_optimization": {"allgather_partitions": False}}, "zero_optimization.allgather_partitions"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     "fp16.fp16_master_weights_and_grads"),
    ({"amp": {"enabled": True}}, "amp"),
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal"),
    ({"data_types": {"keep_in_fp32_modules": ["lm_head"]}}, "data_types.keep_in_fp32_modules"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel"),
    ({"compile": {"deepcompile": True}}, "compile"),    ({"sparse_gradients": True}, "sparse_gradients"),
    ({"pipeline": {"stages": "auto"}}, "pipeline"),
    ({"autotuning": {"enabled": True}}, "autotuning"),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
     "compression_training"),
    ({"data_efficiency": {"enabled": True}}, "data_efficiency"),
]


@pytest.mark.parametrize("config,path", NOT_IMPLEMENTED_CASES,
                         ids=[p for _, p in NOT_IMPLEMENTED_CASES])
def test_not_yet_implemented_keys_are_refused_by_name(config, path):
    msg = error_of(config)
    assert f"config key '{path}'" in msg and "not implemented yet" in msg


def test_neutral_values_ask_for_nothing_and_are_accepted():
    plain = parse_config({"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}})
    same = parse_config({
        "zero_optimization": {"stage": 1, "allgather_partitions": True,
                              "zero_quantized_weights": False, "zero_quantized_gradients": False,
                              "zero_hpz_partition_size": 1, "round_robin_gradients": False},
        "fp16": {"enabled": True, "auto_cast": False},
        "prescale_gradients": False, "gradient_predivide_factor": 1,
        "comms_logger": {"enabled": False, "verbose": True}, "flops_profiler": {"enabled": False},
    })
    assert same == plain
    assert parse_config({"bfloat16": {"enabled": True, "bf16_optimizer_states": False}}) == \
        parse_config({"bf16": {"enabled": True}})
    msg = error_of({"zero_optimization": {"zero_hpz_partition_size": 2}})
    assert "only 1 (the feature off) is accepted" in msg
    # DeepSpeed's logging sections default to off: without "enabled" they ask for nothing
    assert parse_config({"comms_logger": {"verbose": True}}) == parse_config({})
    # switch-off and size-1 settings of whole sections (DeepSpeedExamples and HF configs)
    assert parse_config({"compile": {"deepcompile": False}, "tensor_parallel": {"autotp_size": 1},
                         "sequence_parallel_size": 1, "hybrid_engine": {"enabled": False},
                         "compression_training": {"weight_quantization": {
                             "shared_parameters": {"enabled": False}}},
                         "checkpoint": {"load_universal": False}}) == parse_config({})


def test_no_effect_keys_are_accepted_at_any_value_and_documented():
    base = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "bf16": {"enabled": True}, "checkpoint": {"tag_validation": "Fail"},
            "optimizer": {"type": "AdamW"}}  # optimizer.legacy_fusion needs its section whole
    for path, reason in NO_EFFECT_KEYS.items():
        assert len(reason) > 10, f"{path}: say why it has no effect"
        for value in (True, 7, "x", {"a": 1}):
            config = json.loads(json.dumps(base))
            *sections, key = path.split(".")
            node = config
            for name in sections:
                node = node.setdefault(name, {})
            node[key] = value
            assert parse_config(config) == parse_config(base), (path, value)
    # the accepted keys really leave the config as it was
    base = {"zero_optimization": {"stage": 2}}
    noisy = {"zero_optimization": {"stage": 2, "round_robin_gradients": True,
                                   "memory_efficient_linear": False,
                                   "offload_optimizer": {"device": "none", "cpuadam_cores_perc": 0.8}},
             "zero_force_ds_cpu_optimizer": False, "aio": {"block_size": 1048576},
             "checkpoint": {"writer": {"type": "fast"}, "parallel_write": {"pipeline_stage": True}}}
    assert parse_config(noisy) == parse_config(base)


def test_key_tables_are_consistent_with_the_parser_and_the_docstring():
    doc = keys_module.__doc__  # the key reference table lives with the key tables
    sections = {table.split(":")[0] for table in SUPPORTED_KEYS}
    checked = 0
    for table, keys in SUPPORTED_KEYS.items():
        section = table.split(":")[0]
        for key in keys:
            dotted = f"{section}.{key}" if section else key
            if dotted in sections:
                continue  # a section such as "fp16": its keys have the rows
            if dotted == "bfloat16":
                assert "also spelled ``bfloat16``" in doc
                continue
            assert re.search(rf"^{re.escape(dotted)}\s", doc, re.M), f"{dotted} missing from the table"
            checked += 1
        pending = NOT_YET_IMPLEMENTED.get(table, {})
        assert not set(keys) & set(pending), f"{table}: keys both supported and pending"
    assert checked > 50
    for path in NO_EFFECT_KEYS:
        section, _, key = path.rpartition(".")
        tables = [t for t in SUPPORTED_KEYS if t.split(":")[0] == section]
        assert not any(key in SUPPORTED_KEYS[t] for t in tables), f"{path}: supported and no-effect"
    for path in NEUTRAL_VALUES:
        section, _, key = path.rpartition(".")
        tables = [t for t in NOT_YET_IMPLEMENTED if t.split(":")[0] == section]
        assert any(key in NOT_YET_IMPLEMENTED[t] for t in tables), path


def test_every_supported_key_parses_and_round_trips():
    everything = {
        "train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5, "steps_per_print": 5, "wall_clock_breakdown": True,
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 50,
                 "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 2},
        "bf16": {"enabled": False},
        "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "betas": [0.85, 0.95], "eps": 1e-6,
                                                 "weight_decay": 0.1, "adam_w_mode": False,
                                                 "bias_correction": False, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 1e-6, "warmup_max_lr": [2e-4], "warmup_num_steps": 7,
                                 "warmup_type": "linear", "last_batch_iteration": -1,
                                 "total_num_steps": 70}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000, "allgather_bucket_size": 2000,
                              "overlap_comm": False, "contiguous_gradients": False,
                              "reduce_scatter": False, "stage3_prefetch_bucket_size": 300,
                              "stage3_param_persistence_threshold": 10,
                              "stage3_max_live_parameters": 4000, "stage3_max_reuse_distance": 50,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "accelerator": "cpu", "comm_backend": "gloo", "comm_timeout": 12.5,
        "topology": {"ranks_per_node": 1},
    }
    cfg = parse_config(everything, world_size=2)
    assert cfg.to_dict()["optimizer"]["params"]["adam_w_mode"] is False
    again = parse_config(json.loads(json.dumps(cfg.to_dict())), world_size=2)
    assert again == cfg
    for opt in ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.5, "dampening": 0.1,
                                           "weight_decay": 0.0, "nesterov": False}},):
        c = parse_config({"optimizer": opt})
        assert parse_config(json.loads(json.dumps(c.to_dict()))) == c
    c = parse_config({"scheduler": {"type": "WarmupCosineLR",
                                    "params": {"total_num_steps": 9, "warmup_min_ratio": 0.1,
                                               "cos_min_ratio": 0.2}}})
    assert parse_config(json.loads(json.dumps(c.to_dict()))) == c


def test_values_the_hf_trainer_and_accelerate_fill_in():
    # warmup_num_steps 0 (TrainingArguments' default warmup) is DeepSpeed's minimum warmup
    cfg = parse_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})
    assert cfg.scheduler.params["warmup_num_steps"] == 0
    assert "'scheduler.params.warmup_num_steps' = -1" in error_of(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}})
    # Accelerate fills steps_per_print with float("inf"): never
    assert parse_config({"steps_per_print": float("inf")}).steps_per_print is None
    assert "'steps_per_print' = 0" in error_of({"steps_per_print": 0})


def test_offload_param_below_stage_3_is_ignored_aloud_as_deepspeed_ignores_it():
    with pytest.warns(ConfigWarning, match="no effect at ZeRO stage 2"):
        cfg = parse_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert not cfg.zero_optimization.offload_param.enabled


def test_a_misspelt_stage3_key_is_unknown_with_a_suggestion_not_unimplemented():
    msg = error_of({"zero_optimization": {"stage": 3, "stage3_param_persitence_threshold": 10}})
    assert "unknown config key" in msg and "did you mean 'stage3_param_persistence_threshold'" in msg
    # a real, unimplemented stage3_* option still says so
    assert "not implemented yet" in error_of({"zero_optimization": {"stage3_some_future_option": 1}})
