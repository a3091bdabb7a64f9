"""fill_auto_values (zero_core/integrations/transformers/auto_values.py): HF's "auto" config
values, in this process, with fresh random arguments each run.

The expected values are the formulas transformers 5.24 applies (HfTrainerDeepSpeedConfig
.trainer_config_process / trainer_config_finalize) and accelerate 1.15's DeepSpeedPlugin
defaults, written out here; the arguments are a SimpleNamespace with TrainingArguments'
field names (one test uses a real TrainingArguments, to catch a renamed field).
"""
from __future__ import annotations

import copy
import math
import random
from types import SimpleNamespace

import pytest

from zero_core.errors import ConfigError
from zero_core.integrations.transformers import fill_auto_values
from zero_core.integrations.transformers.auto_values import (AutoValueMismatchError,
                                                             UnfillableAutoError)

RNG = random.Random()


def random_args(**over):
    a = dict(per_device_train_batch_size=RNG.randint(1, 16),
             gradient_accumulation_steps=RNG.randint(1, 8), world_size=RNG.randint(1, 64),
             max_grad_norm=RNG.uniform(0.1, 5.0), learning_rate=10 ** RNG.uniform(-6, -2),
             adam_beta1=RNG.uniform(0.8, 0.95), adam_beta2=RNG.uniform(0.95, 0.9999),
             adam_epsilon=10 ** RNG.uniform(-10, -6), weight_decay=RNG.uniform(0, 0.3),
             warmup_steps=RNG.randint(1, 500), save_on_each_node=False,
             auto_find_batch_size=False, fp16=False, bf16=False, fp16_full_eval=False,
             bf16_full_eval=False)
    a.update(over)
    return SimpleNamespace(**a)


def model_with(**config):
    return SimpleNamespace(config=SimpleNamespace(**config))


def all_auto(stage=3):
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto"}},
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": stage, "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": "auto",
            "offload_optimizer": {"device": "auto"}}}


def test_every_key_filled_with_transformers_value():
    a = random_args(bf16=True)
    hidden, steps = RNG.randint(8, 8192), RNG.randint(1000, 100000)
    raw = all_auto()
    before = copy.deepcopy(raw)
    cfg = fill_auto_values(raw, a, model=model_with(hidden_size=hidden), num_training_steps=steps)
    assert raw == before, "the input config must not change"
    assert cfg["train_micro_batch_size_per_gpu"] == a.per_device_train_batch_size
    assert cfg["gradient_accumulation_steps"] == a.gradient_accumulation_steps
    assert cfg["train_batch_size"] == (a.world_size * a.per_device_train_batch_size
                                       * a.gradient_accumulation_steps)
    assert cfg["gradient_clipping"] == a.max_grad_norm
    assert cfg["optimizer"]["params"] == {"lr": a.learning_rate,
                                          "betas": [a.adam_beta1, a.adam_beta2],
                                          "eps": a.adam_epsilon, "weight_decay": a.weight_decay}
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": a.learning_rate,
                                          "warmup_num_steps": a.warmup_steps,
                                          "total_num_steps": steps}
    assert cfg["fp16"]["enabled"] is False and cfg["bf16"]["enabled"] is True
    z = cfg["zero_optimization"]
    assert z["reduce_bucket_size"] == hidden * hidden
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * hidden * hidden)
    assert isinstance(z["stage3_prefetch_bucket_size"], int)
    assert z["stage3_param_persistence_threshold"] == 10 * hidden
    assert z["stage3_gather_16bit_weights_on_model_save"] is False
    assert z["offload_optimizer"]["device"] == "none"


def test_hidden_size_sources():
    """hidden_size, else max(hidden_sizes), else the text_config's (transformers' order)."""
    sizes = [RNG.randint(8, 512) for _ in range(4)]
    cfg = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    a = random_args()
    assert fill_auto_values(cfg, a, model_with(hidden_sizes=sizes), 10)[
        "zero_optimization"]["reduce_bucket_size"] == max(sizes) ** 2
    text = model_with(text_config=SimpleNamespace(hidden_size=sizes[0]))
    assert fill_auto_values(cfg, a, text, 10)["zero_optimization"]["reduce_bucket_size"] == sizes[0] ** 2


def test_stage_auto_is_accelerates_default_and_stage3_keys_need_stage_3():
    a = random_args()
    cfg = fill_auto_values({"zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"}},
                           a, model_with(hidden_size=64), 10)
    assert cfg["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 4096}
    with pytest.raises(UnfillableAutoError, match="stage3_param_persistence_threshold.*stage 3"):
        fill_auto_values({"zero_optimization": {"stage": 2,
                                                "stage3_param_persistence_threshold": "auto"}},
                         a, model_with(hidden_size=64), 10)


def test_warmup_steps():
    """transformers: warmup_steps >= 1 counts steps, below 1 is a fraction of the run
    (rounded up), and at least 1 step goes to DeepSpeed."""
    cfg = {"scheduler": {"params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    steps = RNG.randint(100, 1000)
    frac = RNG.uniform(0.01, 0.5)

    def warm(w):
        return fill_auto_values(cfg, random_args(warmup_steps=w), None, steps)[
            "scheduler"]["params"]["warmup_num_steps"]
    assert warm(0) == 1
    assert warm(frac) == max(1, math.ceil(steps * frac))
    assert warm(17) == 17


def test_precision_flags_and_bfloat16_alias():
    raw = {"fp16": {"enabled": "auto"}, "bfloat16": {"enabled": "auto"}}
    cfg = fill_auto_values(raw, random_args(fp16_full_eval=True), None, 10)
    assert cfg == {"fp16": {"enabled": True}, "bfloat16": {"enabled": False}}
    cfg = fill_auto_values(raw, random_args(bf16=True), None, 10)
    assert cfg == {"fp16": {"enabled": False}, "bfloat16": {"enabled": True}}


def test_save_on_each_node_sets_node_local_storage():
    cfg = fill_auto_values({}, random_args(save_on_each_node=True), None, 10)
    assert cfg == {"checkpoint": {"use_node_local_storage": True}}


def test_mismatches_are_all_listed_and_agreement_passes():
    a = random_args()
    agreeing = {"train_micro_batch_size_per_gpu": a.per_device_train_batch_size,
                "gradient_accumulation_steps": a.gradient_accumulation_steps,
                "gradient_clipping": a.max_grad_norm,
                "optimizer": {"params": {"lr": a.learning_rate,
                                         "betas": [a.adam_beta1, a.adam_beta2]}},
                "scheduler": {"params": {"total_num_steps": 50, "warmup_num_steps": a.warmup_steps}}}
    assert fill_auto_values(agreeing, a, None, 50) == agreeing
    wrong = copy.deepcopy(agreeing)
    wrong["gradient_accumulation_steps"] += 1
    wrong["optimizer"]["params"]["lr"] *= 2
    wrong["optimizer"]["params"]["betas"] = [0.5, 0.5]
    wrong["scheduler"]["params"]["total_num_steps"] = 51
    wrong["bf16"] = {"enabled": True}
    with pytest.raises(AutoValueMismatchError) as info:
        fill_auto_values(wrong, a, None, 50)
    lines = [ln for ln in str(info.value).splitlines() if ln.strip().startswith("- config")]
    assert len(lines) == 5, str(info.value)
    for key in ("gradient_accumulation_steps", "optimizer.params.lr", "optimizer.params.betas",
                "scheduler.params.total_num_steps", "bf16.enabled"):
        assert any(f"config {key}=" in ln for ln in lines), (key, lines)
    assert isinstance(info.value, ConfigError)


def test_auto_find_batch_size_skips_the_batch_comparisons():
    a = random_args(auto_find_batch_size=True)
    cfg = {"train_micro_batch_size_per_gpu": a.per_device_train_batch_size + 1,
           "train_batch_size": 12345}
    assert fill_auto_values(cfg, a, None, 10) == cfg


@pytest.mark.parametrize("raw, model, steps, key", [
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, None, 10,
     "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}},
     model_with(n_embd=32), 10, "zero_optimization.stage3_prefetch_bucket_size"),
    ({"scheduler": {"params": {"total_num_steps": "auto"}}}, None, None,
     "scheduler.params.total_num_steps"),
    ({"amp": {"enabled": "auto"}}, None, 10, "amp.enabled"),
])
def test_unfillable_autos_are_named(raw, model, steps, key):
    with pytest.raises(UnfillableAutoError) as info:
        fill_auto_values(raw, random_args(), model, steps)
    assert f"- {key}:" in str(info.value), str(info.value)


def test_fractional_warmup_without_run_length_is_unfillable():
    with pytest.raises(UnfillableAutoError, match="warmup_num_steps"):
        fill_auto_values({"scheduler": {"params": {"warmup_num_steps": "auto"}}},
                         random_args(warmup_steps=0.1), None, None)


def test_not_a_dict_is_refused():
    with pytest.raises(ConfigError, match="json.load"):
        fill_auto_values("ds_config.json", random_args())


def test_real_training_arguments():
    """The field names read exist on transformers' TrainingArguments (world size 1 here)."""
    from transformers import GPT2Config, TrainingArguments
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[],
                             per_device_train_batch_size=3, gradient_accumulation_steps=5,
                             learning_rate=7e-4, warmup_steps=0.25)
    cfg = fill_auto_values(all_auto(), args, SimpleNamespace(config=GPT2Config(n_embd=48)), 40)
    assert cfg["train_batch_size"] == 15 and cfg["optimizer"]["params"]["lr"] == 7e-4
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 10
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 48 * 48
