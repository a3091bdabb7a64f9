"""The engine configurations the GPU kit trains, and how it trains them: the cases
(stage, precision, offload, ZeRO++ flags) at world size 1, the sizes, the zero-core config,
the engine's and plain torch's training loops on the same batches, and the comparisons of
loss curves and weights.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass

from check_support import Ctx, gpt_module, import_torch


@dataclass(frozen=True)
class EngineCase:
    """One engine configuration at world size 1."""

    stage: int
    precision: str = "bf16"             # "fp32" | "bf16"
    offload_optimizer: str = "none"     # "none" | "cpu" | "nvme"
    offload_param: str = "none"
    qwz: bool = False
    qgz: bool = False
    hpz: int = 1

    @property
    def name(self) -> str:
        parts = [f"stage{self.stage}", self.precision]
        if self.offload_optimizer != "none":
            parts.append(f"offopt-{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"offparam-{self.offload_param}")
        parts += [p for p, on in (("qwz", self.qwz), ("qgz", self.qgz)) if on]
        if self.hpz > 1:
            parts.append(f"hpz{self.hpz}")
        return "-".join(parts)


def engine_cases(ctx: Ctx) -> list[EngineCase]:
    cases = [EngineCase(s, p) for p in ("fp32", "bf16") for s in (0, 1, 2, 3)]
    cases += [EngineCase(s, "bf16", offload_optimizer=d) for d in ("cpu", "nvme")
              for s in (1, 2, 3)]
    cases += [EngineCase(3, "bf16", offload_optimizer=d, offload_param=d)
              for d in ("cpu", "nvme")]
    cases += [EngineCase(3, "bf16", qwz=True), EngineCase(3, "bf16", qgz=True),
              EngineCase(3, "bf16", qwz=True, qgz=True), EngineCase(3, "bf16", hpz=2),
              EngineCase(3, "bf16", qwz=True, qgz=True, hpz=2)]
    if ctx.quick:
        keep = {"stage0-fp32", "stage3-fp32", "stage2-bf16", "stage3-bf16",
                "stage2-bf16-offopt-cpu", "stage3-bf16-offopt-nvme-offparam-nvme",
                "stage3-bf16-qwz", "stage3-bf16-hpz2"}
        cases = [c for c in cases if c.name in keep]
    return cases


def checkpoint_cases(ctx: Ctx) -> list[EngineCase]:
    cases = [EngineCase(1, "bf16"), EngineCase(2, "bf16"), EngineCase(3, "bf16"),
             EngineCase(2, "bf16", offload_optimizer="cpu"),
             EngineCase(3, "bf16", offload_optimizer="nvme", offload_param="cpu")]
    return [cases[2]] if ctx.quick else cases


@dataclass(frozen=True)
class Sizes:
    preset: str
    micro: int
    seq: int
    gas: int
    steps: int
    lr: float = 5e-3


def sizes(ctx: Ctx) -> Sizes:
    if ctx.quick:
        return Sizes("tiny", micro=4, seq=32, gas=2, steps=4)
    if ctx.cuda:
        return Sizes("small", micro=8, seq=128, gas=2, steps=12)
    return Sizes("small", micro=4, seq=64, gas=2, steps=6)


def engine_config(ctx: Ctx, case: EngineCase, sz: Sizes, nvme_dir: str,
                  accelerator: str | None = None, comm: str | None = None) -> dict:
    """A config that cuts the model into several buckets, fetch units and sub-groups, so
    that the multi-piece paths run even on the small model."""
    zo = {"stage": case.stage, "reduce_bucket_size": 60_000, "allgather_bucket_size": 60_000}
    if case.stage == 3:
        zo.update(stage3_param_persistence_threshold=2_000, stage3_prefetch_bucket_size=100_000,
                  stage3_max_live_parameters=400_000, stage3_max_reuse_distance=50_000)
    if case.offload_optimizer != "none":
        zo["offload_optimizer"] = {"device": case.offload_optimizer, "nvme_path": nvme_dir,
                                   "pin_memory": True, "buffer_count": 4}
        zo["sub_group_size"] = 150_000
    if case.offload_param != "none":
        zo["offload_param"] = {"device": case.offload_param, "nvme_path": nvme_dir,
                               "pin_memory": True, "buffer_count": 4, "buffer_size": 2_000_000,
                               "max_in_cpu": 100_000}
    if case.qwz:
        zo["zero_quantized_weights"] = True
    if case.qgz:
        zo["zero_quantized_gradients"] = True
    if case.hpz > 1:
        zo["zero_hpz_partition_size"] = case.hpz
    cfg = {"train_micro_batch_size_per_gpu": sz.micro, "gradient_accumulation_steps": sz.gas,
           "gradient_clipping": 1.0, "zero_optimization": zo,
           "optimizer": {"type": "AdamW", "params": {"lr": sz.lr, "betas": [0.9, 0.95],
                                                     "eps": 1e-8, "weight_decay": 0.1}},
           "accelerator": accelerator or ctx.device, "comm_backend": comm or ctx.comm}
    if case.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_engine(engine, batches, device) -> tuple[list, list]:
    """Losses of every micro-batch and the gradient norm of every optimizer step."""
    from_gpt = gpt_module()
    losses, norms = [], []
    for x, y in batches:
        loss = from_gpt.lm_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(float(loss.detach()))
        if boundary:
            norms.append(engine.get_global_grad_norm())
    return losses, norms


def train_reference(model, batches, sz: Sizes, precision: str, device):
    """Plain torch on the same device: torch.optim.AdamW, clip_grad_norm_(1.0), gradient
    accumulation by dividing the loss. bf16: the model computes in bf16, AdamW steps fp32
    master copies (what mixed precision training does by hand). Returns (losses, last
    gradient norm, final fp32 weights by name)."""
    torch = import_torch()
    lm_loss = gpt_module().lm_loss
    model = model.to(device)
    params = [p for p in model.parameters()]
    if precision == "bf16":
        master = [p.detach().float().clone().requires_grad_(True) for p in params]
        model.to(torch.bfloat16)
    else:
        master = params
    opt = torch.optim.AdamW(master, lr=sz.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses, norms = [], []
    for i, (x, y) in enumerate(batches):
        loss = lm_loss(model(x.to(device)), y.to(device))
        (loss / sz.gas).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % sz.gas == 0:
            if master is not params:
                for m, p in zip(master, params):
                    m.grad = p.grad.float()
                    p.grad = None
            norms.append(float(torch.nn.utils.clip_grad_norm_(master, 1.0)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if master is not params:
                with torch.no_grad():
                    for m, p in zip(master, params):
                        p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return losses, norms, {n: m.detach().float() for n, m in zip(names, master)}


def engine_weights(engine) -> dict:
    """name -> the model's weights as the engine holds them (compute dtype; gathered at
    stage 3), as fp32 CPU tensors."""
    if engine.stage == 3:
        sd = engine.module_state_dict()
        return {n: sd[n].detach().float().cpu() for n, _ in engine.module.named_parameters()}
    return {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}


def rel_curve_diff(a: list, b: list) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) / max(max(abs(y) for y in b), 1e-12)


def rel_weight_diff(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all weights together (L2)."""
    num = den = 0.0
    for n, w in b.items():
        w = w.cpu().double()
        num += float((a[n].double() - w).square().sum())
        den += float(w.square().sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def build_engine(ctx: Ctx, case: EngineCase, sz: Sizes, nvme_dir: str, seed: int, **cfg_kw):
    import zero_core
    gpt = gpt_module()
    os.makedirs(nvme_dir, exist_ok=True)   # zero-core does not create swap directories
    model = gpt.build_model(sz.preset, seed=seed)
    initial = copy.deepcopy(model)
    cfg = engine_config(ctx, case, sz, nvme_dir, **cfg_kw)
    engine, *_ = zero_core.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    return engine, initial, cfg
