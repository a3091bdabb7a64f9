"""Rank program for tests/test_hf_trainer.py: HF's Trainer (DDP) and ZeroCoreTrainer at
stages 2 and 3 on the same tiny GPT-2 and data, in one launch.

Usage: ``python hf_trainer_train.py <comm: gloo|mpi> <seed> <out_dir> [sections]`` on 2
ranks (``sections`` adds the config-sections pair ``hf_ds``/``zc3cfg`` below).

Runs, all 4 optimizer steps with accumulation 2 and clipping, a checkpoint every 2 steps:

- ``hf``: ``transformers.Trainer`` — its DDP over accelerate's process group (the reference);
- ``zc2``: ZeroCoreTrainer stage 2, the Trainer's own optimizer (AdamW with HF's weight-decay
  groups) and linear schedule;
- ``zc3``: ZeroCoreTrainer stage 3, the same;
- ``zc3cfg``: stage 3 with the config's AdamW and WarmupDecayLR sections (all "auto"),
  against ``hf_ds``: HF's Trainer given a torch AdamW over all parameters without weight
  decay (DeepSpeed's optimizer section has one group) and DeepSpeed's WarmupDecayLR
  written as a LambdaLR (hf_trainer_common.deepspeed_warmup_decay).

Each ZeroCoreTrainer run reports its parameters' max relative difference to its reference,
its step logs, evaluate() and predict() against the reference's, and rank 0 checks that
``save_model()`` reloads with ``GPT2LMHeadModel.from_pretrained`` equal to the trained
parameters. The final parameters of ``zc2``/``zc3`` are saved (``zc<stage>_final.pt``)
for the resume test, which continues their ``checkpoint-2`` on 1 rank. Under mpirun
zero-core is started first (before the TrainingArguments); under the torchrun launcher
accelerate starts torch.distributed and the engine joins it.
"""
from __future__ import annotations

import os
import sys

import torch
from transformers import GPT2LMHeadModel, Trainer

from zero_core.integrations.transformers import ZeroCoreTrainer
from zero_core.testing.ranks import leave_rank, report

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer_common import (N_EVAL, N_TRAIN, TokenData, deepspeed_warmup_decay,  # noqa: E402
                               full_params, listing, make_args, make_model, max_rel_diff,
                               step_logs)

COMM, SEED, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3]
SECTIONS = sys.argv[4:] == ["sections"]
WORLD = 2

AUTO_SIZES = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto"}


def zero_config(stage: int, with_sections: bool = False) -> dict:
    cfg = {**AUTO_SIZES, "comm_backend": COMM,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"}}
    if stage == 3:
        cfg["zero_optimization"].update(stage3_prefetch_bucket_size="auto",
                                        stage3_param_persistence_threshold="auto")
    if with_sections:
        cfg["optimizer"] = {"type": "AdamW", "params": {
            "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto", "warmup_type": "linear"}}
    return cfg


def run(name: str, trainer_cls, weight_decay: float, model=None, **extra) -> dict:
    args = make_args(os.path.join(OUT, name), WORLD, SEED, weight_decay)
    trainer = trainer_cls(model=model if model is not None else make_model(SEED), args=args,
                          train_dataset=TokenData(SEED, N_TRAIN),
                          eval_dataset=TokenData(SEED + 1, N_EVAL), **extra)
    before = trainer.evaluate()["eval_loss"] if name == "zc3" else None
    trainer.train()
    out = {"trainer": trainer, "params": full_params(trainer.model), "logs": step_logs(trainer),
           "eval": trainer.evaluate()["eval_loss"], "eval_before": before,
           "pred": torch.as_tensor(trainer.predict(TokenData(SEED + 2, 4)).predictions)}
    if trainer_cls is ZeroCoreTrainer:
        saved = os.path.join(OUT, name, "final_model")
        trainer.save_model(saved)
        out["saved"] = saved
        out["engine"] = type(trainer.engine.parts).__name__
        out["comm"] = trainer.engine.comm.name
    return out


def compare(run_: dict, ref: dict) -> dict:
    logs, ref_logs = run_["logs"], ref["logs"]
    rel = {k: max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for a, b in zip(logs, ref_logs))
           for k in ("loss", "grad_norm", "learning_rate")}
    result = {
        "param_rel": max_rel_diff(run_["params"], ref["params"]),
        "moved_rel": max_rel_diff(full_params(make_model(SEED)), ref["params"]),
        "log_rel": rel, "steps": [e["step"] for e in logs], "ref_steps": [e["step"] for e in ref_logs],
        "epochs": [e["epoch"] for e in logs], "lrs": [e["learning_rate"] for e in logs],
        "grad_norms": [e["grad_norm"] for e in logs],
        "eval_rel": abs(run_["eval"] - ref["eval"]) / ref["eval"],
        "pred_diff": float((run_["pred"] - ref["pred"]).abs().max()),
        "pred_shape": list(run_["pred"].shape), "engine": run_.get("engine"),
        "comm": run_.get("comm"), "logs": logs,
        "eval_before": run_["eval_before"], "eval_after": run_["eval"],
    }
    if torch.distributed.get_rank() == 0 and "saved" in run_:
        loaded = GPT2LMHeadModel.from_pretrained(run_["saved"])
        result["reload_diff"] = max(float((p.detach() - run_["params"][n]).abs().max())
                                    for n, p in loaded.named_parameters())
        result["reload_names_match"] = (sorted(n for n, _ in loaded.named_parameters())
                                        == sorted(run_["params"]))
        result["saved_files"] = listing(run_["saved"])
        result["checkpoint_files"] = listing(os.path.join(run_["trainer"].args.output_dir,
                                                          "checkpoint-2"))
    return result


def main():
    if COMM == "mpi":
        # accelerate needs torch.distributed's rendezvous, which zero-core's MPI start-up gives
        ZeroCoreTrainer.init_distributed({"comm_backend": "mpi"})
    results = {}
    hf = run("hf", Trainer, weight_decay=0.01)
    results["hf_logs"] = hf["logs"]
    for name, stage in (("zc2", 2), ("zc3", 3)):
        zc = run(name, ZeroCoreTrainer, weight_decay=0.01, zero_config=zero_config(stage))
        results[name] = compare(zc, hf)
        torch.save(zc["params"], os.path.join(OUT, f"{name}_final.pt"))
    if SECTIONS:
        results["zc3cfg"] = run_sections()
    # HF's own DeepSpeed path imports deepspeed; it must never have run
    results["deepspeed_imported"] = "deepspeed" in sys.modules
    import accelerate
    results["accelerate"] = {"distributed_type": str(accelerate.PartialState().distributed_type),
                             "num_processes": accelerate.PartialState().num_processes}
    report(results)
    leave_rank()


def run_sections() -> dict:
    model = make_model(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-5, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, deepspeed_warmup_decay(4, 1))
    hf_ds = run("hf_ds", Trainer, weight_decay=0.0, model=model, optimizers=(opt, sched))
    zc = run("zc3cfg", ZeroCoreTrainer, weight_decay=0.0,
             zero_config=zero_config(3, with_sections=True))
    return compare(zc, hf_ds)


if __name__ == "__main__":
    main()
