"""Shared pieces of the HF Trainer rank programs (hf_trainer_train.py, hf_trainer_resume.py):
the tiny GPT-2, the random token data, the TrainingArguments and the comparisons.

Every run uses the same seeded model and data, sequential sampling (so that a run on a
different number of ranks sees the same global batches: accelerate gives rank r the
micro-batches r, r+W, ... of the sequence), no dropout and fp32.
"""
from __future__ import annotations

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import zero_core

VOCAB, SEQ, N_TRAIN, N_EVAL = 64, 8, 16, 8
GLOBAL_BATCH = 8          # samples per optimizer step: 2 ranks x 2 micro x 2 accumulation
ACCUMULATION = 2
EPOCHS = 2                # 16 samples / 8 per step = 2 steps per epoch: 4 steps in all
SAVE_STEPS = 2


class TokenData(torch.utils.data.Dataset):
    """Random token sequences; labels are the inputs (causal LM)."""

    def __init__(self, seed: int, n: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def make_args(output_dir: str, world_size: int, seed: int, weight_decay: float) -> TrainingArguments:
    micro = GLOBAL_BATCH // (world_size * ACCUMULATION)
    return TrainingArguments(
        output_dir=output_dir, use_cpu=True, report_to=[], disable_tqdm=True,
        per_device_train_batch_size=micro, per_device_eval_batch_size=2,
        gradient_accumulation_steps=ACCUMULATION, num_train_epochs=EPOCHS,
        learning_rate=3e-3, weight_decay=weight_decay, warmup_steps=1,
        # GPT-2's attention key bias has an exactly zero gradient (softmax ignores a
        # constant per query), so its computed gradient is rounding noise (~1e-11) that
        # differs between any two summation orders (DDP's, the engine's); Adam with eps
        # 1e-8 would turn that noise into lr-sized steps, 1e-5 keeps them below 1e-8
        adam_epsilon=1e-5,
        # small enough that the gradients are clipped at every step (checked)
        max_grad_norm=0.5, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="steps", save_steps=SAVE_STEPS,
        train_sampling_strategy="sequential", seed=seed, data_seed=seed,
        dataloader_num_workers=0)


def deepspeed_warmup_decay(total: int, warmup: int):
    """DeepSpeed's WarmupDecayLR (warmup_type linear, warmup_min_lr 0) as a LambdaLR
    factor of the update index k, written from DeepSpeed's documented behaviour: the
    scheduler starts at iteration -1 (min lr) and is stepped after each update; warmup
    lasts max(2, warmup) iterations; then the rate decays linearly to 0 at *total*."""
    warm = max(2, warmup)

    def factor(k: int) -> float:
        it = k - 1
        if it < 0:
            return 0.0
        if it < warm:
            return it / warm
        return max(0.0, (total - it) / max(1.0, total - warm))
    return factor


def full_params(model) -> dict[str, torch.Tensor]:
    """fp32 copies of every parameter (gathered where stage 3 partitioned them)."""
    params = list(model.parameters())
    with zero_core.GatheredParameters(params):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def max_rel_diff(a: dict, b: dict) -> float:
    """max over tensors of max|a - b| / max|b| (relative to each tensor's scale)."""
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12))
               for n in b)


def step_logs(trainer) -> list[dict]:
    """The per-step training logs (loss, grad_norm, learning_rate, epoch, step)."""
    return [{k: e[k] for k in ("loss", "grad_norm", "learning_rate", "epoch", "step")}
            for e in trainer.state.log_history if "loss" in e]


def listing(path: str) -> list[str]:
    """Relative paths of the files under *path*."""
    out = []
    for root, _, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, f), path) for f in files]
    return sorted(out)
