#!/usr/bin/env python
"""Write the DeepSpeed checkpoint fixtures of tests/test_deepspeed_checkpoints.py with
DeepSpeed itself.

Run in an environment that has DeepSpeed (the benchmark venv, see ci/bench/engine.py
``--setup-bench-venv``), on the CPU::

    DS_ACCELERATOR=cpu .bench-venv/bin/python ci/tools/make_deepspeed_fixtures.py

For every ZeRO stage 0-3 x fp32 / bf16 / fp16, two ranks on this host (gloo) train the tiny
model below for 3 steps (DeepSpeed's config ``Adam``, two parameter groups — weight decay
and none —, ``WarmupLR``, gradient clipping), save a checkpoint with a ``client_state``,
then train 3 more steps on fixed data. Per case, ``<out>/<case>/`` holds:

* ``ckpt/`` — the checkpoint directory exactly as DeepSpeed wrote it (``latest``,
  ``global_step3/*.pt``) minus the recovery scripts it copies in (zero_to_fp32.py,
  zero_to_torch.py: DeepSpeed's code, not data);
* ``expected.safetensors`` — ``saved/<param>`` the fp32 master weights at the save
  (DeepSpeed's ``safe_get_full_fp32_param``; stage 0 bf16: its FP16_Optimizer's flat fp32
  groups; frozen parameters: their values), ``final/<param>`` the same after the 3
  continued steps, ``zero_to_fp32/<key>`` what DeepSpeed's
  ``get_fp32_state_dict_from_zero_checkpoint`` returns for the checkpoint; its header
  metadata ``"expected"`` (JSON): losses and learning rates per step, global steps, the
  client state, the config, versions, and zero_to_fp32's error where it refuses.

A case DeepSpeed refuses (e.g. fp16 where the CPU has no fp16 support) is recorded with
DeepSpeed's exact message in ``<out>/refused.json`` and skipped. The data of step ``s`` are
rows of one global batch of 12 (``torch.Generator().manual_seed(1000 + s)``: ``x =
randn(12, 8)``, ``y = randn(12, 5)``), rank r of W taking rows ``[12r/W, 12(r+1)/W)``, so
the continuation is the same at any world size.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))  # this file is ci/tools/make_deepspeed_fixtures.py
DEFAULT_OUT = os.path.join(REPO, "tests", "fixtures", "deepspeed_checkpoints")
STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
GLOBAL_BATCH, IN, OUT = 12, 8, 5
SAVE_AT, CONTINUE = 3, 3
RANKS = 2
CLIENT_STATE = {"epoch": 1, "sampler": {"position": 36, "seed": 1234}, "note": "fixture"}


class Tiny(torch.nn.Module):
    """429 parameters (odd sizes, so that partitions need padding), a LayerNorm, a
    persistent buffer, one frozen layer and one weight used by two layers (tied, as HF ties
    embeddings and output heads)."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(IN, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.l2 = torch.nn.Linear(16, 9)
        self.head = torch.nn.Linear(9, OUT)
        self.frozen = torch.nn.Linear(OUT, OUT, bias=False)
        self.frozen.requires_grad_(False)
        self.mix = torch.nn.Linear(OUT, OUT, bias=False)
        self.unmix = torch.nn.Linear(OUT, OUT, bias=False)
        self.unmix.weight = self.mix.weight
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 9))

    def forward(self, x):
        h = self.ln(torch.tanh(self.l1(x)))
        h = torch.nn.functional.gelu(self.l2(h)) * self.gain.to(h.dtype)
        out = self.head(h)
        out = out + 0.5 * self.frozen(out)
        return out + 0.25 * self.unmix(torch.tanh(self.mix(out)))


def make_model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def param_groups(m: Tiny) -> list:
    decay = [m.l1.weight, m.l2.weight, m.head.weight, m.mix.weight]
    no_decay = [m.l1.bias, m.ln.weight, m.ln.bias, m.l2.bias, m.head.bias]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def ds_config(stage: int, precision: str) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
        "steps_per_print": 1000,
    }
    return cfg


def case_name(stage: int, precision: str) -> str:
    return f"stage{stage}_{precision}"


# ---- one rank of one case ----------------------------------------------------------------------
def rank_main(stage: int, precision: str, out: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    cfg = ds_config(stage, precision)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                               config=cfg)
    except Exception as exc:  # the case DeepSpeed refuses: record why
        if rank == 0:
            with open(os.path.join(out, "refused.txt"), "w") as fh:
                fh.write(f"{type(exc).__name__}: {exc}")
        return
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]

    def step(s):
        x, y = batch(s, rank, world)
        pred = engine(x.to(dtype))
        loss = torch.nn.functional.mse_loss(pred.float(), y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total) / world

    def fp32_params():
        out_ = {}
        from ds_common import stage0_masters
        masters = stage0_masters(engine)
        for n, p in engine.module.named_parameters():
            v = masters.get(id(p))
            if v is None and p.requires_grad:
                v = safe_get_full_fp32_param(p)
            if v is None:  # stage 0 fp32 (no separate master) and frozen parameters
                if hasattr(p, "ds_id"):
                    with deepspeed.zero.GatheredParameters([p]):
                        v = p.detach().clone()
                else:
                    v = p.detach().clone()
            out_[n] = v.detach().float().cpu().clone()
        return out_

    losses, lrs = [], []
    for s in range(SAVE_AT):
        losses.append(step(s))
        lrs.append(engine.get_lr())
    ckpt = os.path.join(out, "ckpt")
    engine.save_checkpoint(ckpt, client_state=dict(CLIENT_STATE))
    saved = fp32_params()
    saved_steps = engine.global_steps
    for s in range(SAVE_AT, SAVE_AT + CONTINUE):
        losses.append(step(s))
        lrs.append(engine.get_lr())
    final = fp32_params()
    if rank == 0:
        tensors = {f"saved/{n}": v for n, v in saved.items()}
        tensors.update({f"final/{n}": v for n, v in final.items()})
        torch.save(tensors, os.path.join(out, "rank0_tensors.pt"))
        info = {"stage": stage, "precision": precision, "world_size": world,
                "losses": losses, "lrs": lrs, "saved_global_steps": saved_steps,
                "final_global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                "optimizer_class": type(engine.basic_optimizer).__name__
                if getattr(engine, "basic_optimizer", None) is not None else None,
                "wrapper_class": type(engine.optimizer).__name__,
                "config": cfg, "client_state": CLIENT_STATE}
        with open(os.path.join(out, "rank0_info.json"), "w") as fh:
            json.dump(info, fh)
    dist.barrier()


# ---- the driver ----------------------------------------------------------------------------------
def run_case(stage: int, precision: str, work: str) -> None:
    from ds_common import run_ranks
    run_ranks(__file__, ["--rank", str(stage), precision, work], RANKS,
              f"case {case_name(stage, precision)}")


def write_safetensors(path: str, tensors: dict, metadata: dict) -> None:
    """A plain safetensors file (this environment need not have the safetensors package)."""
    codes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.int64: "I64"}
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for b in blobs:
            fh.write(b)


def finish_case(stage: int, precision: str, work: str, dest: str) -> None:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with open(os.path.join(work, "rank0_info.json")) as fh:
        info = json.load(fh)
    tensors = torch.load(os.path.join(work, "rank0_tensors.pt"), weights_only=True)
    ckpt = os.path.join(work, "ckpt")
    try:
        sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        tensors.update({f"zero_to_fp32/{k}": v.detach().clone() for k, v in sd.items()})
        info["zero_to_fp32"] = sorted(sd)
    except Exception as exc:
        info["zero_to_fp32_error"] = f"{type(exc).__name__}: {exc}"
    info["deepspeed_version"] = deepspeed.__version__
    info["torch_version"] = torch.__version__
    for root, _, files in os.walk(ckpt):
        for f in files:
            if f in ("zero_to_fp32.py", "zero_to_torch.py"):
                os.remove(os.path.join(root, f))
    if os.path.exists(dest):
        shutil.rmtree(dest)
    os.makedirs(dest)
    shutil.copytree(ckpt, os.path.join(dest, "ckpt"))
    write_safetensors(os.path.join(dest, "expected.safetensors"), tensors,
                      {"expected": json.dumps(info, sort_keys=True)})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank":
        rank_main(int(argv[1]), argv[2], argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--only", default=None, help="comma-separated case names (stage2_bf16,...)")
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    refused_path = os.path.join(out, "refused.json")
    refused = {}
    if os.path.exists(refused_path):
        with open(refused_path) as fh:
            refused = json.load(fh)
    only = set(args.only.split(",")) if args.only else None
    scratch = os.path.join(out, ".work")
    for stage in STAGES:
        for precision in PRECISIONS:
            name = case_name(stage, precision)
            if only and name not in only:
                continue
            work = os.path.join(scratch, name)
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)
            print(f"[fixtures] {name}", flush=True)
            run_case(stage, precision, work)
            why = os.path.join(work, "refused.txt")
            if os.path.exists(why):
                with open(why) as fh:
                    refused[name] = fh.read()
                print(f"[fixtures] {name}: DeepSpeed refused: {refused[name]}", flush=True)
                shutil.rmtree(os.path.join(out, name), ignore_errors=True)
                continue
            refused.pop(name, None)
            finish_case(stage, precision, work, os.path.join(out, name))
    shutil.rmtree(scratch, ignore_errors=True)
    with open(refused_path, "w") as fh:
        json.dump(refused, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
