"""Fine-tune a small Hugging Face causal LM with ZeroCoreTrainer on the Python standard
library's source (byte tokens, examples/text_data.py); nothing is downloaded.

Run on 2 local CPU ranks::

    mpirun -np 2 python examples/hf_trainer_finetune.py
    torchrun --nproc-per-node 2 examples/hf_trainer_finetune.py

The model is a GPT-2 built from a config (vocabulary 256: one token per byte); the
zero-core config is DeepSpeed's, with the "auto" values the HF Trainer fills from its
TrainingArguments. Rank 0 prints the evaluation loss before and after training and where
the model was saved (Hugging Face's layout: ``GPT2LMHeadModel.from_pretrained(dir)``).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from zero_core.integrations.transformers import ZeroCoreTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from text_data import VOCAB_SIZE, load_stdlib_text  # noqa: E402

SEQ_LEN = 64


def zero_config(stage: int) -> dict:
    """DeepSpeed-style config; every "auto" is filled from the TrainingArguments/model."""
    zero = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto", "warmup_type": "linear"}},
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
    }


class Chunks(torch.utils.data.Dataset):
    """Fixed-length windows of byte tokens; labels are the inputs (the model shifts them)."""

    def __init__(self, tokens: torch.Tensor, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(tokens) - SEQ_LEN, (n,), generator=g)
        self.ids = torch.stack([tokens[s:s + SEQ_LEN].long() for s in starts.tolist()])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def shared_output_dir(requested: str | None) -> str:
    """--output-dir, or one temporary directory made by rank 0 and used by every rank."""
    if requested:
        return requested
    made = [tempfile.mkdtemp(prefix="zero_core_hf_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    return made[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3, help="ZeRO stage")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--output-dir", default=None, help="default: a temporary directory")
    a = p.parse_args(argv)
    config = zero_config(a.stage)
    # zero-core first: under mpirun it provides the rendezvous accelerate then joins
    runtime = ZeroCoreTrainer.init_distributed(config)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // runtime.world_size))
    output_dir = shared_output_dir(a.output_dir)
    text = load_stdlib_text(max_bytes=2 << 20)
    micro = 8
    train = Chunks(text.train, a.steps * micro * runtime.world_size, seed=0)
    val = Chunks(text.val, 16 * runtime.world_size, seed=1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=SEQ_LEN, n_embd=128,
                                       n_layer=2, n_head=4))
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, report_to=[], disable_tqdm=True,
        per_device_train_batch_size=micro, per_device_eval_batch_size=micro,
        gradient_accumulation_steps=1, max_steps=a.steps, learning_rate=2e-3,
        weight_decay=0.01, warmup_steps=0.1, max_grad_norm=1.0, logging_steps=10,
        save_strategy="no", seed=0)
    trainer = ZeroCoreTrainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                              zero_config=config)
    before = trainer.evaluate()["eval_loss"]
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = trainer.evaluate()["eval_loss"]
    saved = os.path.join(output_dir, "model")
    trainer.save_model(saved)
    if trainer.is_world_process_zero():
        print(f"ZeRO stage {a.stage} on {runtime.world_size} ranks ({runtime.comm.name}): "
              f"{a.steps} steps in {seconds:.1f} s")
        print(f"eval loss before {before:.4f}, after {after:.4f}")
        print(f"model saved to {saved} (GPT2LMHeadModel.from_pretrained loads it)")


if __name__ == "__main__":
    main()
    from zero_core.runtime.context import shutdown
    shutdown()
