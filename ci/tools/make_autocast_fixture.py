#!/usr/bin/env python
"""Write tests/fixtures/deepspeed_autocast.json, DeepSpeed's own runs of ``torch_autocast``
(alone and with ``bf16``) that tests/test_torch_autocast.py compares zero-core against.

Run where DeepSpeed is installed, on the CPU::

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python ci/tools/make_autocast_fixture.py

Per case (ZeRO stage x precision x ``lower_precision_safe_modules``), two ranks on this host
(gloo) build the small model below from ``torch.manual_seed(0)``, train it for STEPS steps on
fixed data (step ``s``: ``torch.Generator().manual_seed(500 + s)``, ``x = randn(12, 8)``,
``y = randn(12, 5)``, rank r of 2 taking rows ``[6r, 6r + 6)``) with the config's ``Adam``
and gradient clipping, and record: the mean loss per step, every parameter's fp32 value
after the last step (DeepSpeed's master weights), the dtype each parameter has in the model,
and the dtypes DeepSpeed's ZeRO optimizer keeps its gradient-reduction buckets in (the
``comm_dtype`` it gave each parameter, where it gave one). A case DeepSpeed refuses is
recorded with its message.

The ``*_ln_p0`` / ``*_ln_pdefault`` cases list ``torch.nn.LayerNorm`` (which autocast does not
cast) as lower-precision safe at stage 3, with ``stage3_param_persistence_threshold`` 0 and
its default, autocasting to bf16 and fp16, and start the LayerNorm from random weights
(``perturb_ln``: not representable in bf16/fp16): DeepSpeed all-gathers those weights in the
autocast dtype, so its LayerNorm computes with rounded weights — every step when they are
not persistent, only before the first optimizer step when they are.

The ``*_fp16ac`` / ``*_fp16ac_overflow`` cases autocast to fp16 with fp32 parameters, where
DeepSpeed scales the loss with a ``torch.amp.GradScaler`` (recorded: its final scale,
``grad_scale``, and ``skipped_steps``); the overflow cases multiply the loss by
``loss_mult`` at some steps so that the scaled fp16 gradients overflow there; the underflow
cases multiply it by 1e-6, so that unscaled fp16 gradients would underflow.
"""
from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(REPO, "tests", "fixtures", "deepspeed_autocast.json")
STEPS, GLOBAL_BATCH, RANKS = 4, 12, 2

#: name -> (stage, bf16 section or None, lower_precision_safe_modules or None[, extra]);
#: extra: "zero" (more zero_optimization keys), "dtype" (torch_autocast.dtype), "perturb_ln"
LN_SAFE = ["torch.nn.LayerNorm"]
CASES = {
    **{f"stage{s}_fp32": (s, None, None) for s in (0, 1, 2, 3)},
    **{f"stage{s}_bf16": (s, {"enabled": True}, None) for s in (0, 1, 2, 3)},
    **{f"stage{s}_bf16_master": (s, {"enabled": True, "bf16_master_weights_and_grads": True,
                                     "bf16_optimizer_states": True}, None) for s in (1, 2, 3)},
    "stage2_fp32_layernorm_safe": (2, None, ["torch.nn.LayerNorm"]),
    "stage3_fp32_layernorm_safe": (3, None, ["torch.nn.LayerNorm"]),
    **{f"stage3_{tag}_ln_p{name}": (3, None, LN_SAFE, {
        "zero": zero, "dtype": dtype, "perturb_ln": True})
       for tag, dtype in (("fp32", "bfloat16"), ("fp32_fp16ac", "float16"))
       for name, zero in (("0", {"stage3_param_persistence_threshold": 0}), ("default", {}))},
    # fp16 autocast, where DeepSpeed scales the loss with a torch GradScaler: no clipping
    # (DeepSpeed's stages 1-3 clip the still-scaled norm), and the loss multiplied by 1e4 at
    # steps 0 and 2 so that the scaled fp16 gradients overflow there ("loss_mult")
    **{f"stage{s}_fp32_fp16ac{tag}": (s, None, None, {"dtype": "float16", "clip": 0.0, **x})
       for s in (0, 1, 2, 3)
       for tag, x in (("", {}), ("_overflow", {"loss_mult": {0: 1e4, 2: 1e4}}))},
    # ... and by 1e-6 at every step: unscaled, its fp16 gradients would underflow
    **{f"stage{s}_fp32_fp16ac_underflow": (s, None, None, {
        "dtype": "float16", "clip": 0.0, "loss_mult": {i: 1e-6 for i in range(STEPS)}})
       for s in (0, 2)},
}


class Net(torch.nn.Module):
    """Linear layers (lower-precision safe by default) around a LayerNorm (not)."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.l2 = torch.nn.Linear(16, 9)
        self.head = torch.nn.Linear(9, 5)

    def forward(self, x):
        h = self.ln(torch.tanh(self.l1(x)))
        return self.head(torch.nn.functional.gelu(self.l2(h)))


def make_model(perturb_ln: bool = False) -> Net:
    torch.manual_seed(0)
    model = Net()
    if perturb_ln:
        with torch.no_grad():
            g = torch.Generator().manual_seed(9)
            model.ln.weight.copy_(1 + 0.3 * torch.randn(16, generator=g))
            model.ln.bias.copy_(0.3 * torch.randn(16, generator=g))
    return model


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.randn(GLOBAL_BATCH, 5, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def loss_mult(extra: dict, step: int) -> float:
    """The factor the loss of *step* is multiplied by (keys may be JSON strings)."""
    mult = extra.get("loss_mult") or {}
    return float(mult.get(step, mult.get(str(step), 1.0)))


def config(stage: int, bf16, safe, extra=None) -> dict:
    extra = extra or {}
    autocast = {"enabled": True, "dtype": extra.get("dtype", "bfloat16")}
    if safe is not None:
        autocast["lower_precision_safe_modules"] = safe
    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 1,
           "gradient_clipping": extra.get("clip", 1.0),
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99],
                                                    "eps": 1e-8}},
           "zero_optimization": {"stage": stage, **extra.get("zero", {})},
           "torch_autocast": autocast,
           "steps_per_print": 1000}
    if bf16 is not None:
        cfg["bf16"] = bf16
    return cfg


def rank_main(name: str, out: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.torch_autocast import get_comm_dtype, has_comm_dtype
    from deepspeed.utils import safe_get_full_fp32_param

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stage, bf16, safe, *extra = CASES[name]
    extra = extra[0] if extra else {}
    model = make_model(extra.get("perturb_ln", False))
    cfg = config(stage, bf16, safe, extra)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=cfg)
    except Exception as exc:
        if rank == 0:
            with open(out, "w") as fh:
                json.dump({"config": cfg, "refused": f"{type(exc).__name__}: {exc}"}, fh)
        return
    param_dtypes = {n: str(p.dtype) for n, p in engine.module.named_parameters()}
    comm = {n: str(get_comm_dtype(p)) for n, p in engine.module.named_parameters()
            if has_comm_dtype(p)}
    buckets = sorted(str(d) for d in getattr(engine.optimizer, "ipg_buckets", {}))
    losses = []
    for s in range(STEPS):
        x, y = batch(s, rank, world)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y) * loss_mult(extra, s)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    scaler = (getattr(engine, "torch_autocast_z0_gradscaler", None)
              or getattr(engine.optimizer, "torch_autocast_gradscaler", None))
    from ds_common import stage0_masters
    masters = stage0_masters(engine)
    final = {}
    for n, p in engine.module.named_parameters():
        v = masters.get(id(p))
        if v is None:
            v = safe_get_full_fp32_param(p)
        if v is None:
            v = p.detach()
        final[n] = v.detach().float().cpu().reshape(-1).tolist()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"config": cfg, "losses": losses, "final": final,
                       "perturb_ln": extra.get("perturb_ln", False),
                       "param_dtypes": param_dtypes, "comm_dtypes": comm,
                       "bucket_dtypes": buckets, "loss_mult": extra.get("loss_mult", {}),
                       "grad_scale": None if scaler is None else float(scaler.get_scale()),
                       "skipped_steps": engine.skipped_steps,
                       "wrapper": type(engine.optimizer).__name__}, fh)
    dist.barrier()


def run_case(name: str, work: str) -> dict:
    from ds_common import run_ranks
    out = os.path.join(work, f"{name}.json")
    run_ranks(__file__, ["--rank", name, out], RANKS, f"case {name}")
    with open(out) as fh:
        return json.load(fh)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank":
        rank_main(argv[1], argv[2])
        return 0
    import deepspeed
    work = os.path.join("/tmp", "zero_core_autocast_fixture")
    os.makedirs(work, exist_ok=True)
    only = set(argv[0].split(",")) if argv else None
    result = {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
              "steps": STEPS, "cases": {}}
    if os.path.exists(OUT) and only:
        with open(OUT) as fh:
            result["cases"] = json.load(fh)["cases"]
    for name in CASES:
        if only and name not in only:
            continue
        print(f"[autocast fixture] {name}", flush=True)
        result["cases"][name] = run_case(name, work)
    with open(OUT, "w") as fh:
        json.dump(result, fh, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
