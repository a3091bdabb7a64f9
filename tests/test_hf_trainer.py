"""ZeroCoreTrainer (zero_core/integrations/transformers/trainer.py) against Hugging Face's own
Trainer.

Two 2-rank launches, one per launcher — the torchrun-style launcher with gloo and mpirun
with zero-core's MPI communicator — each running tests/workers/hf_trainer_train.py: HF's
``Trainer`` (its DDP over accelerate's process group) as the reference, then
ZeroCoreTrainer at stage 2 and stage 3 with the Trainer's own optimizer and schedule, and
stage 3 with the config's optimizer/scheduler sections against HF's Trainer given the same
optimizer and DeepSpeed's schedule. A tiny GPT-2 (2 layers, 32 wide, vocab 64) on random
tokens (a fresh seed per session), fp32, 4 steps with accumulation 2 and clipping active,
checkpoints every 2 steps, then evaluate(), predict() and save_model().

In this process (world size 1): the 2-rank checkpoints resumed on 1 rank, and the named
errors. Bounds: 1e-5 relative, where the differences measured are ~1e-7 (summation order).
"""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from zero_core.testing.ranks import run_ranks

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
WORKER = os.path.join(WORKERS, "hf_trainer_train.py")
SEED = random.randrange(1, 10**6)
TOL = 1e-5


def runs(comm: str) -> tuple[str, ...]:
    """The ZeroCoreTrainer runs of a launch (the config-sections one only over gloo)."""
    return ("zc2", "zc3", "zc3cfg") if comm == "gloo" else ("zc2", "zc3")


sys.path.insert(0, WORKERS)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """comm -> (rank 0's report, output directory): one 2-rank launch per launcher."""
    done = {}

    def get(comm):
        if comm not in done:
            out = str(tmp_path_factory.mktemp(f"hf_trainer_{comm}"))
            launcher = "mpirun" if comm == "mpi" else "torchrun"
            # the config-sections pair runs in one launch only (the engine code is the same)
            extra = ("sections",) if comm == "gloo" else ()
            results = run_ranks(WORKER, 2, launcher=launcher, args=(comm, SEED, out, *extra),
                                timeout=240)
            done[comm] = (results[0].report, out)
        return done[comm]
    return get


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("comm", ["gloo", "mpi"])
def test_matches_hf_ddp(launches, comm):
    """Stage 2 and 3 (Trainer-built AdamW + linear schedule, HF's weight-decay groups) and
    stage 3 with the config's AdamW/WarmupDecayLR: parameters after 4 steps within 1e-5 of
    HF's DDP; the logged loss, grad_norm and learning_rate of every step too; evaluate()
    and predict() after training (through the engine) agree; clipping was active; HF's
    DeepSpeed code never ran; accelerate saw one 2-process job."""
    rep, _ = launches(comm)
    assert rep["deepspeed_imported"] is False
    assert rep["accelerate"] == {"distributed_type": "DistributedType.MULTI_CPU", "num_processes": 2}
    expected_engine = {"zc2": "Stage0to2Parts", "zc3": "Stage3Parts", "zc3cfg": "Stage3Parts"}
    for name in runs(comm):
        r = rep[name]
        where = f"{name} over {comm}, seed {SEED}"
        assert r["engine"] == expected_engine[name] and r["comm"] == comm, where
        assert r["param_rel"] <= TOL, (where, r["param_rel"])
        assert r["moved_rel"] > 100 * TOL, (where, "the reference did not train", r["moved_rel"])
        for key, rel in r["log_rel"].items():
            assert rel <= TOL, (where, key, rel)
        assert r["steps"] == r["ref_steps"] == [1, 2, 3, 4], where
        assert r["epochs"] == [0.5, 1.0, 1.5, 2.0], where
        assert min(r["grad_norms"]) > 0.5, (where, "max_grad_norm 0.5 should clip every step")
        assert r["eval_rel"] <= TOL, (where, r["eval_rel"])
        assert r["pred_shape"] == [4, 8, 64] and r["pred_diff"] <= TOL, (where, r["pred_diff"])
    # HF's linear schedule (warmup 1 of 4 steps) is logged as the rate each update used
    assert rep["zc2"]["lrs"] == pytest.approx([0.0, 3e-3, 2e-3, 1e-3], rel=1e-9)
    if comm == "gloo":
        # DeepSpeed's WarmupDecayLR: starts at min lr, warms up over max(2, 1) steps
        assert rep["zc3cfg"]["lrs"] == pytest.approx([0.0, 0.0, 1.5e-3, 3e-3], rel=1e-9)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("comm", ["gloo", "mpi"])
def test_checkpoints_and_save_model(launches, comm):
    """save_steps=2 wrote checkpoint-2 with HF's files (weights in HF's layout, trainer
    state, per-rank RNG state) and the engine's checkpoint (both ranks' partitions);
    save_model() wrote HF's layout, which GPT2LMHeadModel.from_pretrained loads with every
    parameter equal to the trained ones."""
    rep, out = launches(comm)
    for name in runs(comm):
        r = rep[name]
        files = set(r["checkpoint_files"])
        assert {"config.json", "model.safetensors", "trainer_state.json", "rng_state_0.pth",
                "rng_state_1.pth", "latest", "global_step2/metadata.json",
                "global_step2/rank_00000.safetensors",
                "global_step2/rank_00001.safetensors"} <= files, (name, sorted(files))
        assert os.path.isdir(os.path.join(out, name, "checkpoint-4")), name
        assert {"config.json", "model.safetensors", "training_args.bin"} <= set(r["saved_files"])
        assert r["reload_names_match"] and r["reload_diff"] == 0.0, (name, r["reload_diff"])


@pytest.mark.multirank
@pytest.mark.slow
def test_resume_on_one_rank_matches_uninterrupted(launches):
    """checkpoint-2 of the 2-rank stage-2 and stage-3 runs, resumed here on 1 rank (micro
    batch 4 instead of 2: the same global batches) by a fresh ZeroCoreTrainer whose model
    starts from other values: the engine reshards the checkpoint, training continues to
    step 4, and the parameters and the resumed steps' logs match the uninterrupted 2-rank
    run within 1e-5."""
    from hf_trainer_common import (N_TRAIN, TokenData, full_params, make_args, make_model,
                                   max_rel_diff, step_logs)
    from zero_core.integrations.transformers import ZeroCoreTrainer
    rep, src = launches("gloo")
    for stage in (2, 3):
        config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "gradient_clipping": "auto", "zero_optimization": {"stage": stage}}
        args = make_args(os.path.join(src, f"resume{stage}"), 1, SEED, weight_decay=0.01)
        trainer = ZeroCoreTrainer(model=make_model(SEED + 99), args=args,
                                  train_dataset=TokenData(SEED, N_TRAIN), zero_config=config)
        trainer.train(resume_from_checkpoint=os.path.join(src, f"zc{stage}", "checkpoint-2"))
        assert trainer.engine.world_size == 1 and trainer.engine.stage == stage
        assert trainer.state.global_step == 4
        uninterrupted = torch.load(os.path.join(src, f"zc{stage}_final.pt"))
        rel = max_rel_diff(full_params(trainer.model), uninterrupted)
        assert rel <= TOL, (stage, SEED, rel)
        resumed = {e["step"]: e for e in step_logs(trainer)}
        for ref in rep[f"zc{stage}"]["logs"][2:]:
            got = resumed[ref["step"]]
            for key in ("loss", "grad_norm", "learning_rate"):
                assert got[key] == pytest.approx(ref[key], rel=TOL, abs=1e-12), (stage, key)


# --- named errors, in this process ----------------------------------------------------------

def _tiny_trainer(tmp, zero_config, **arg_overrides):
    from transformers import TrainingArguments
    from hf_trainer_common import N_TRAIN, TokenData, make_model
    from zero_core.integrations.transformers import ZeroCoreTrainer
    args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], disable_tqdm=True,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=1, **arg_overrides)
    return ZeroCoreTrainer(model=make_model(SEED), args=args,
                           train_dataset=TokenData(SEED, N_TRAIN), zero_config=zero_config)


def test_unfillable_auto_is_named(tmp_path):
    """A stage-3-only "auto" in a stage-2 config (transformers would leave the string for
    DeepSpeed to choke on): train() refuses it by key before building an engine."""
    from zero_core.integrations.transformers.auto_values import UnfillableAutoError
    trainer = _tiny_trainer(str(tmp_path), {"zero_optimization": {
        "stage": 2, "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"}})
    with pytest.raises(UnfillableAutoError, match="stage3_prefetch_bucket_size") as info:
        trainer.train()
    assert "reduce_bucket_size" not in str(info.value)   # that one was filled (hidden²)
    assert trainer.engine is None


def test_argument_conflicts_are_listed(tmp_path):
    """Config values that contradict the TrainingArguments (accumulation, clipping, bf16):
    one error listing each with both values."""
    from zero_core.integrations.transformers.auto_values import AutoValueMismatchError
    trainer = _tiny_trainer(str(tmp_path), {
        "gradient_accumulation_steps": 4, "gradient_clipping": 0.25,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    with pytest.raises(AutoValueMismatchError) as info:
        trainer.train()
    text = str(info.value)
    for fragment in ("gradient_accumulation_steps=4", "gradient_accumulation_steps=2",
                     "gradient_clipping=0.25", "max_grad_norm=1.0", "bf16.enabled=True"):
        assert fragment in text, (fragment, text)


def test_unsupported_trainer_features_are_refused(tmp_path):
    """args.deepspeed next to zero_config (and FSDP): refused when the
    trainer is made, every one named, before accelerate could start DeepSpeed or FSDP."""
    from transformers import TrainingArguments
    from hf_trainer_common import make_model
    from zero_core.integrations.transformers import ZeroCoreTrainer
    from zero_core.integrations.transformers.trainer_config import UnsupportedTrainerFeature
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    # TrainingArguments(deepspeed=...) itself needs the deepspeed package: set it afterwards,
    # as a user's argument parser might
    args.deepspeed = {"zero_optimization": {"stage": 2}}
    args.fsdp = "full_shard"
    args.label_smoothing_factor = 0.1
    with pytest.raises(UnsupportedTrainerFeature) as info:
        ZeroCoreTrainer(model=make_model(SEED), args=args, zero_config={"zero_optimization": {"stage": 2}})
    text = str(info.value)
    assert "deepspeed" in text and "fsdp" in text, text
    assert "label_smoothing_factor" in text, text
    assert "deepspeed" not in sys.modules
    with pytest.raises(UnsupportedTrainerFeature, match="deepspeed"):
        args2 = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
        args2.deepspeed = "ds_config.json"
        ZeroCoreTrainer(model=make_model(SEED), args=args2, zero_config={})


def test_zero_config_is_required_and_read(tmp_path):
    """zero_config= missing, unreadable or not JSON: a ConfigError naming what to give."""
    from zero_core.errors import ConfigError
    with pytest.raises(ConfigError, match="zero_config="):
        _tiny_trainer(str(tmp_path), None)
    with pytest.raises(ConfigError, match="cannot read"):
        _tiny_trainer(str(tmp_path), str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        _tiny_trainer(str(tmp_path), str(bad))
