"""Shared pieces of the Lightning workers (tests/test_lightning.py): the data, the model,
the LightningModule, and a plain-torch single-process reference of the same training.

Sizes are chosen so that every rank count used (1, 2, 3) sees the same samples in each
optimizer step: a step covers samples [12k, 12k + 12) with a global micro-batch of 6 and
2 accumulation steps (2 ranks x 3, 3 ranks x 2, 1 rank x 6), and the DistributedSampler
Lightning injects does not shuffle.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

N_TRAIN, N_VAL, D_IN, D_OUT = 48, 16, 8, 4
GLOBAL_MICRO, ACCUMULATE, CLIP, LR = 6, 2, 0.5, 2e-2
STEPS_PER_EPOCH = N_TRAIN // (GLOBAL_MICRO * ACCUMULATE)


def data(seed: int):
    """Fresh random inputs for this launch (train x, y, val x, y)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TRAIN + N_VAL, D_IN, generator=g)
    w = torch.randn(D_IN, D_OUT, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(N_TRAIN + N_VAL, D_OUT, generator=g)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def make_net(seed: int) -> torch.nn.Module:
    """244 parameters: two linears, a LayerNorm."""
    torch.manual_seed(seed + 1)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, 16), torch.nn.LayerNorm(16),
                               torch.nn.Tanh(), torch.nn.Linear(16, D_OUT))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def make_scheduler(opt):
    # halves the LR every 3 steps: a resume that lost the scheduler state diverges
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def reference(seed: int, epochs: int):
    """Single-process plain-torch training of the same steps; returns (net, val loss,
    gradient norms before clipping)."""
    x, y, vx, vy = data(seed)
    net = make_net(seed)
    opt = make_optimizer(net.parameters())
    sched = make_scheduler(opt)
    norms = []
    for _ in range(epochs):
        for k in range(STEPS_PER_EPOCH):
            opt.zero_grad()
            lo = k * GLOBAL_MICRO * ACCUMULATE
            for m in range(ACCUMULATE):
                s = slice(lo + m * GLOBAL_MICRO, lo + (m + 1) * GLOBAL_MICRO)
                (F.mse_loss(net(x[s]), y[s]) / ACCUMULATE).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
            opt.step()
            sched.step()
    with torch.no_grad():
        val = float(F.mse_loss(net(vx), vy))
    return net, val, norms


def rel_diff(state: dict, ref: torch.nn.Module) -> float:
    """max |p - p_ref| / max |p_ref| over the reference's parameters (state: name -> tensor)."""
    ref_state = dict(ref.named_parameters())
    num = max(float((state[n].detach().double().cpu() - p.detach().double()).abs().max())
              for n, p in ref_state.items())
    return num / max(float(p.detach().abs().max()) for p in ref_state.values())


def lightning_module_class():
    """The LightningModule (built lazily: importing lightning costs seconds)."""
    import lightning.pytorch as pl

    class Regressor(pl.LightningModule):
        def __init__(self, seed: int, sched: bool = True, init_seed: int | None = None):
            super().__init__()
            self.save_hyperparameters()
            self.net = make_net(seed if init_seed is None else init_seed)
            self.started_at = None

        def forward(self, x):
            return self.net(x)

        def on_train_start(self):
            self.started_at = (self.trainer.current_epoch, self.trainer.global_step)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

        # the loaders shard by the Trainer's ranks with a non-shuffling DistributedSampler
        # (the one Lightning would inject shuffles)
        def train_dataloader(self):
            return sharded(self.trainer, *data(self.hparams.seed)[:2],
                           GLOBAL_MICRO // self.trainer.world_size)

        def val_dataloader(self):
            return sharded(self.trainer, *data(self.hparams.seed)[2:], 4)

        def test_dataloader(self):
            return self.val_dataloader()

        def predict_dataloader(self):
            return self.val_dataloader()

        def configure_optimizers(self):
            opt = make_optimizer(self.parameters())
            if not self.hparams.sched:
                return opt
            return {"optimizer": opt,
                    "lr_scheduler": {"scheduler": make_scheduler(opt), "interval": "step"}}

    return Regressor


def sharded(trainer, x, y, batch: int):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=trainer.world_size, rank=trainer.global_rank,
                                 shuffle=False)
    return DataLoader(ds, batch_size=batch, sampler=sampler)


def trainer_kwargs(**extra) -> dict:
    kw = dict(accelerator="cpu", accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP,
              logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, num_sanity_val_steps=0, deterministic=False)
    kw.update(extra)
    return kw


def finite(x) -> bool:
    return x is not None and math.isfinite(float(x))


def keep_env():
    """A snapshot of os.environ that restore_env puts back (Lightning's teardown of the
    DDP reference deletes WORLD_SIZE, which zero-core's launcher discovery reads)."""
    return dict(os.environ)


def restore_env(snapshot: dict) -> None:
    for key in set(os.environ) - set(snapshot):
        del os.environ[key]
    os.environ.update(snapshot)
