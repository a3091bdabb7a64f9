"""Train the small GPT of examples/gpt.py with PyTorch Lightning on zero-core.

The LightningModule is ordinary Lightning code; ``Trainer(strategy=ZeroCoreStrategy(...))``
puts the engine (ZeRO stage 0-3) under it. Runs as written on 2 local CPU ranks with any
of these launchers::

    mpirun -np 2 python examples/lightning_gpt.py             # Lightning's MPIEnvironment
    torchrun --nproc-per-node 2 examples/lightning_gpt.py     # torchrun's variables
    python examples/lightning_gpt.py --devices 2              # Lightning starts rank 1 itself

Rank 0 prints the validation loss before and after training, and a checkpoint directory is
written (and resumable with ``--resume``) under ``--checkpoint-dir``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import lightning.pytorch as pl
from torch.utils.data import Dataset

from zero_core.integrations.lightning import ZeroCoreStrategy
from zero_core.runtime.launch import discover

# the example modules sit next to this file
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import build_model, lm_loss  # noqa: E402
from text_data import GlobalBatchSampler, load_stdlib_text, validation_batches  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--devices", type=int, default=None,
                   help="processes on this machine (default: the launcher's count, else 1)")
    p.add_argument("--precision", default="32-true",
                   choices=("32-true", "bf16-mixed", "bf16-true", "16-mixed"))
    p.add_argument("--model", choices=("tiny", "small"), default="tiny")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="Trainer(accumulate_grad_batches)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "lightning_gpt"))
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    return p.parse_args(argv)


class Windows(Dataset):
    """Step s's global batch of GlobalBatchSampler as one dataset: Lightning's distributed
    sampler splits it over the ranks."""

    def __init__(self, tokens, seq_len: int, steps: int, global_batch: int, seed: int):
        self.sampler = GlobalBatchSampler(tokens, seq_len, global_batch, 1, seed=seed)
        self.global_batch, self.n = global_batch, steps * global_batch

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = self.sampler.global_step_batch(i // self.global_batch)
        return x[i % self.global_batch], y[i % self.global_batch]


class GPTModule(pl.LightningModule):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.args = args
        self.model = build_model(args.model, seed=args.seed)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", lm_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.args.lr, betas=(0.9, 0.95),
                                weight_decay=0.1)
        warm = max(1, self.args.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv=None):
    args = parse_args(argv)
    launch = discover()
    # under mpirun / torchrun the launcher made the processes: one device each
    devices = args.devices or (launch.local_world_size if launch.launcher != "single" else 1)
    world = devices if launch.launcher == "single" else launch.world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    text = load_stdlib_text(max_bytes=2 << 20)
    seq_len = build_model(args.model).cfg.block_size
    global_batch = args.micro_batch * world * args.grad_accum
    train = torch.utils.data.DataLoader(
        Windows(text.train, seq_len, args.steps, global_batch, args.seed),
        batch_size=args.micro_batch, shuffle=False)
    vx, vy = validation_batches(text.val, seq_len, 32)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(vx, vy), batch_size=8)

    strategy = ZeroCoreStrategy(stage=args.stage)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                         precision=args.precision, max_steps=args.steps,
                         accumulate_grad_batches=args.grad_accum, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         enable_progress_bar=False)
    module = GPTModule(args)
    # before training the model is still whole on every rank: score it directly (a
    # trainer.validate here would build an evaluation engine, which at stage 3 owns the
    # partitioned model and cannot hand it to fit's engine)
    with torch.no_grad():
        before = lm_loss(module(vx), vy).item()
    ckpt = os.path.join(args.checkpoint_dir, f"stage{args.stage}")
    trainer.fit(module, train, ckpt_path=ckpt if args.resume else None)
    after = trainer.validate(module, val, verbose=False)[0]["val_loss"]
    trainer.save_checkpoint(ckpt)
    if trainer.is_global_zero:
        print(f"zero-core + Lightning: GPT '{args.model}', ZeRO stage {args.stage}, "
              f"{args.precision}, {trainer.world_size} ranks, {trainer.global_step} steps")
        print(f"validation loss {before:.3f} -> {after:.3f}; checkpoint: {ckpt}", flush=True)
    return {"before": before, "after": after, "steps": trainer.global_step,
            "world_size": trainer.world_size}


if __name__ == "__main__":
    main()
