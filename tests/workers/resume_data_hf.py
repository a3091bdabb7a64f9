"""Rank program for tests/test_resume_data_integrations.py: which samples ZeroCoreTrainer
trains on, uninterrupted and resumed mid-epoch.

Usage: ``python resume_data_hf.py <seed> <out_dir>`` on 2 ranks (gloo, torchrun-style).

``full``: 2 epochs of 24 samples, shuffled (HF's default random sampling, seeded), global
batch 8 (2 ranks x micro 2 x accumulation 2): 3 steps per epoch, a checkpoint every 2 steps
(checkpoint-2 in epoch 0, checkpoint-4 in epoch 1). ``same``: checkpoint-4 resumed on the
same 2 ranks by a model initialised differently. Every micro-batch's sample ids are
recorded with the optimizer step they belong to (:class:`Recording`); the in-process test
resumes checkpoint-2 on 1 rank and compares with these.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer_common import full_params, make_model, max_rel_diff  # noqa: E402

from zero_core.testing.ranks import leave_rank, report  # noqa: E402

N_TRAIN, SEQ, VOCAB = 24, 8, 64
CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto",
          "zero_optimization": {"stage": 2}}


class IndexedTokens(torch.utils.data.Dataset):
    """Random token sequences whose first token is the sample's index (its id in the logs)."""

    def __init__(self, seed: int, n: int = N_TRAIN):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.ids[:, 0] = torch.arange(n)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_args(output_dir: str, seed: int, micro: int = 2, accumulation: int = 2):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=output_dir, use_cpu=True, report_to=[], disable_tqdm=True,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        num_train_epochs=2, learning_rate=3e-3, warmup_steps=1, adam_epsilon=1e-5,
        max_grad_norm=0.5, logging_steps=1, save_strategy="steps", save_steps=2,
        seed=seed, data_seed=seed, dataloader_num_workers=0)


def recording_trainer(config=None, **kwargs):
    """A ZeroCoreTrainer (zero_config *config*, default :data:`CONFIG`) that records
    ``(optimizer step, sample ids)`` per micro-batch."""
    from zero_core.integrations.transformers import ZeroCoreTrainer

    class Recording(ZeroCoreTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.seen.append([self.state.global_step + 1, inputs["input_ids"][:, 0].tolist()])
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = Recording(zero_config=CONFIG if config is None else config, **kwargs)
    trainer.seen = []
    return trainer


def main():
    seed, out = int(sys.argv[1]), sys.argv[2]
    data = IndexedTokens(seed)
    full = recording_trainer(model=make_model(seed), args=make_args(os.path.join(out, "full"), seed),
                             train_dataset=data)
    full.train()
    final = full_params(full.model)
    if torch.distributed.get_rank() == 0:
        torch.save(final, os.path.join(out, "full_final.pt"))
    same = recording_trainer(model=make_model(seed + 99),
                             args=make_args(os.path.join(out, "same"), seed), train_dataset=data)
    same.train(resume_from_checkpoint=os.path.join(out, "full", "checkpoint-4"))
    report({"full": full.seen, "same": same.seen, "same_step": same.state.global_step,
            "same_rel": max_rel_diff(full_params(same.model), final)})
    leave_rank()


if __name__ == "__main__":
    main()
