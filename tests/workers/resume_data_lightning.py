"""Rank program for tests/test_resume_data_integrations.py: which samples ZeroCoreStrategy
trains on, uninterrupted and resumed mid-epoch.

Usage: ``python resume_data_lightning.py <seed> <out_dir> full`` on 2 ranks, then
``python resume_data_lightning.py <seed> <out_dir> other`` on 1 rank (torchrun-style
variables, gloo).

``full``: 2 epochs of 36 samples from a plain DataLoader (batch 3 per rank, Lightning's
injected shuffling DistributedSampler, seeded by ``seed_everything``), accumulation 2: global
batch 12, 3 optimizer steps per epoch; a ModelCheckpoint every 2 steps (``step=2`` in epoch
0, ``step=4`` in epoch 1); then ``same``: ``step=4`` resumed on the same 2 ranks by a model
initialised differently. ``other`` (1 rank): ``keep``: ``step=2`` resumed with
accumulate_grad_batches 4 (the global batch kept); ``keep_micro``: ``step=4`` resumed with
accumulation 2 and ``checkpoint.resume_batch: "keep_micro"`` (global batch 6); ``refused``:
``step=2`` with accumulation 2 and the default ``"keep_global"``, the error. Every
micro-batch's sample ids are recorded with the optimizer step they belong to; the final
parameters are reported.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from zero_core.errors import ConfigError
from zero_core.integrations.lightning import ZeroCoreStrategy
from zero_core.testing.ranks import leave_rank, report

N_TRAIN, D_IN, D_OUT, BATCH, EPOCHS = 36, 6, 3, 3, 2


def dataset(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TRAIN, D_IN, generator=g)
    y = torch.tanh(x @ torch.randn(D_IN, D_OUT, generator=g))
    return torch.utils.data.TensorDataset(torch.arange(N_TRAIN), x, y)


class Recorder(pl.LightningModule):
    def __init__(self, seed: int, init_seed: int):
        super().__init__()
        self.seed = seed
        torch.manual_seed(init_seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(D_IN, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, D_OUT))
        self.seen = []

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.seen.append([self.trainer.global_step + 1, ids.tolist()])
        return F.mse_loss(self.net(x), y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(dataset(self.seed), batch_size=BATCH, shuffle=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            "interval": "step"}}


def fit(seed: int, init_seed: int, accumulate: int, ckpt_path=None, save_dir=None,
        config=None) -> dict:
    pl.seed_everything(seed, verbose=False)
    model = Recorder(seed, init_seed)
    callbacks = [ModelCheckpoint(dirpath=save_dir, filename="{step}", save_top_k=-1,
                                 every_n_train_steps=2)] if save_dir else []
    trainer = pl.Trainer(strategy=ZeroCoreStrategy(config=config, stage=2), accelerator="cpu",
                         devices=int(os.environ.get("WORLD_SIZE", "1")), max_epochs=EPOCHS,
                         accumulate_grad_batches=accumulate, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=save_dir is not None, callbacks=callbacks,
                         num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=ckpt_path)
    engine = trainer.strategy.engine
    return {"seen": model.seen, "global_step": trainer.global_step,
            "accumulation": engine.gradient_accumulation_steps,
            "params": {n: p.detach().flatten().tolist() for n, p in model.net.named_parameters()}}


def main():
    seed, out, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    ckpt = os.path.join(out, "ckpt")
    if mode == "full":
        result = {"full": fit(seed, seed, 2, save_dir=ckpt),
                  "same": fit(seed, seed + 1, 2, ckpt_path=os.path.join(ckpt, "step=4.ckpt"))}
    else:
        result = {"keep": fit(seed, seed + 1, 4, ckpt_path=os.path.join(ckpt, "step=2.ckpt")),
                  "keep_micro": fit(seed, seed + 1, 2, ckpt_path=os.path.join(ckpt, "step=4.ckpt"),
                                    config={"checkpoint": {"resume_batch": "keep_micro"}})}
        try:
            fit(seed, seed + 1, 2, ckpt_path=os.path.join(ckpt, "step=2.ckpt"))
        except ConfigError as exc:
            result["refused"] = str(exc)
    report(result)
    leave_rank()


if __name__ == "__main__":
    main()
