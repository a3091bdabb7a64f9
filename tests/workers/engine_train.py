"""Multi-rank worker for tests/test_engine_multirank.py.

Usage: ``python engine_train.py <scenario>[,<scenario>...] [seed]`` on every rank. Each
scenario trains a tiny model with the engine and, in the same process, a single-process
plain-torch reference on the same global batches, and reports numbers (differences,
norms, flags) that the test compares with its bounds. Several scenarios run in one launch
because a launch costs seconds and engines are cheap.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import zero_core
from zero_core.testing.ranks import leave_rank, report

VOCAB, DIM, SEQ, MICRO = 32, 16, 6, 2


class Tiny(torch.nn.Module):
    """~1.9k parameters: an embedding tied to the output head, a frozen layer, a
    LayerNorm, biases (a no-decay group) and a buffer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.l1 = torch.nn.Linear(DIM, 24)
        self.ln = torch.nn.LayerNorm(24)
        self.l2 = torch.nn.Linear(24, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("gain", torch.ones(DIM))

    def forward(self, ids):
        h = self.emb(ids) * self.gain
        h = h + 0.5 * self.frozen(h)
        h = h + self.l2(torch.tanh(self.ln(self.l1(h))))
        return self.head(h)


def make_model(seed: int) -> Tiny:
    torch.manual_seed(seed)
    m = Tiny()
    with torch.no_grad():
        m.gain.uniform_(0.5, 1.5)
    return m


def groups_of(m: Tiny, lr=1e-2, wd=0.1):
    decay = [m.emb.weight, m.l1.weight, m.l2.weight]
    no_decay = [m.l1.bias, m.l2.bias, m.ln.weight, m.ln.bias, m.frozen.weight, m.frozen.bias]
    return [{"params": decay, "lr": lr, "weight_decay": wd},
            {"params": no_decay, "lr": lr / 2, "weight_decay": 0.0}]


def global_batch(seed: int, step: int, n: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def loss_fn(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), target.to(logits.device).reshape(-1))


def rel_diff(model, ref) -> float:
    """max |p - p_ref| / max |p_ref| over all parameters."""
    num = max(float((a.detach().cpu().double() - b.detach().double()).abs().max())
              for a, b in zip(model.parameters(), ref.parameters()))
    den = max(float(b.detach().abs().max()) for b in ref.parameters())
    return num / den


def checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def train_and_compare(stage, precision="fp32", gas=2, steps=10, clip=0.5, seed=1,
                      opt="AdamW", bucket=200, user_optimizer=None, micro=MICRO, **extra):
    """Train engine and reference for *steps* optimizer steps; return the comparison."""
    rank, world = zero_core.get_runtime().rank, zero_core.get_runtime().world_size
    model, ref = make_model(seed), make_model(seed)
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "gradient_clipping": clip,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket},
           "bf16": {"enabled": precision == "bf16"},
           # a start scale low enough not to overflow: the comparison must not skip steps
           "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8}, **extra}
    kwargs = {}
    ref_groups = groups_of(ref)
    if user_optimizer is None:
        cfg["optimizer"] = {"type": opt, "params": {"lr": 1e-2, "weight_decay": 0.0}}
        if opt == "SGD":
            cfg["optimizer"]["params"]["momentum"] = 0.9
            ref_opt = torch.optim.SGD(ref_groups, lr=1e-2, momentum=0.9)
        else:
            ref_opt = torch.optim.AdamW(ref_groups, lr=1e-2)
        kwargs["model_parameters"] = groups_of(model)
    else:
        kwargs["optimizer"] = user_optimizer(groups_of(model))
        ref_opt = user_optimizer(ref_groups)
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg, **kwargs)
    n = micro * gas * world
    ref_norm = None
    for step in range(steps):
        ids, tgt = global_batch(seed, step, n)
        for m in range(gas):
            rows = slice((m * world + rank) * micro, (m * world + rank + 1) * micro)
            loss = loss_fn(engine(ids[rows]), tgt[rows])
            engine.backward(loss)
            engine.step()
        ref_opt.zero_grad()
        loss_fn(ref(ids), tgt).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(
            ref.parameters(), clip if clip > 0 else float("inf")))
        ref_opt.step()
    out = {"rel_diff": rel_diff(model, ref), "norm": engine.get_global_grad_norm(),
           "ref_norm": ref_norm, "global_steps": engine.global_steps,
           "micro_steps": engine.micro_steps, "checksum": checksum(model),
           "memory": engine.memory_report(), "comm": engine.comm_report(),
           "tied": model.head.weight is model.emb.weight,
           "skipped": engine.skipped_steps, "lr": engine.get_lr(),
           # frozen parameters are only cast to the compute dtype, never trained
           "frozen_unchanged": bool(torch.equal(
               model.frozen.weight.cpu(),
               make_model(seed).frozen.weight.to(model.frozen.weight.dtype)))}
    engine.destroy()
    return out


def fp16_overflow(stage: int, seed=3):
    """Inject an inf into one rank's gradient at step 2: every rank must skip that step."""
    rt = zero_core.get_runtime()
    model = make_model(seed)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 8},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    poison = {"on": False}

    def hook(grad):
        if poison["on"] and rt.rank == rt.world_size - 1:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    model.l1.weight.register_hook(hook)
    scales, skipped, sums = [], [], []
    for step in range(4):
        ids, tgt = global_batch(seed, step, MICRO * rt.world_size)
        rows = slice(rt.rank * MICRO, (rt.rank + 1) * MICRO)
        poison["on"] = step == 2
        before = checksum(model)
        scale_before = engine.loss_scale
        engine.backward(loss_fn(engine(ids[rows]), tgt[rows]))
        engine.step()
        scales.append((scale_before, engine.loss_scale))
        skipped.append(engine.skipped_steps)
        sums.append((before, checksum(model)))
    engine.destroy()
    return {"scales": scales, "skipped": skipped, "sums": sums,
            "norm_after": engine.get_global_grad_norm()}


def bad_inputs():
    """Errors that must be raised, with their messages."""
    rt = zero_core.get_runtime()
    out = {}
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}
    try:
        model = make_model(5)
        zero_core.initialize(model=model, config=cfg,
                             optimizer=torch.optim.LBFGS(model.parameters()))
        out["lbfgs"] = None
    except zero_core.errors.ConfigError as e:
        out["lbfgs"] = str(e)
    # stage 0 takes any optimizer (here LBFGS's class is accepted; not stepped)
    model = make_model(5)
    cfg0 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}
    e0, _, _, _ = zero_core.initialize(model=model, config=cfg0,
                                       optimizer=torch.optim.LBFGS(model.parameters()))
    e0.destroy()
    out["lbfgs_stage0_ok"] = True
    try:
        model = make_model(5 + rt.rank)  # rank-dependent init: a script bug
        cfg2 = dict(cfg, optimizer={"type": "Adam", "params": {"lr": 1e-3}})
        zero_core.initialize(model=model, config=cfg2)
        out["differs"] = None
    except zero_core.errors.ZeroCoreError as e:
        out["differs"] = str(e)
    # no optimizer: an inference engine, whose step names what is missing
    model = make_model(5)
    engine, optimizer, _, _ = zero_core.initialize(model=model, config=cfg)
    out["no_optimizer_is_none"] = optimizer is None
    try:
        engine.step()
        out["no_optimizer"] = None
    except zero_core.errors.ZeroCoreError as e:
        out["no_optimizer"] = str(e)
    return out


def buffers_broadcast():
    """Rank-dependent buffer values are replaced by rank 0's."""
    rt = zero_core.get_runtime()
    model = make_model(7)
    with torch.no_grad():
        model.gain.fill_(1.0 + rt.rank)
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    engine.destroy()
    return {"gain": float(model.gain.mean())}


def memory_reports():
    """memory_report() of fresh engines: every stage, fp32/bf16, Adam and SGD+momentum."""
    out = {}
    for stage in (0, 1, 2):
        for precision in ("fp32", "bf16"):
            for opt in ("Adam", "SGD"):
                params = {"lr": 1e-3, "momentum": 0.9} if opt == "SGD" else {"lr": 1e-3}
                cfg = {"train_micro_batch_size_per_gpu": 1,
                       "optimizer": {"type": opt, "params": params},
                       "bf16": {"enabled": precision == "bf16"},
                       "zero_optimization": {"stage": stage, "reduce_bucket_size": 300}}
                engine, _, _, _ = zero_core.initialize(model=make_model(9), config=cfg)
                out[f"stage{stage}_{precision}_{opt}"] = engine.memory_report()
                engine.destroy()
    return out


SCENARIOS = {
    "memory": memory_reports,
    "fp32": lambda: {f"stage{s}": train_and_compare(s) for s in (0, 1, 2)},
    "gas": lambda: {f"stage{s}_gas{g}": train_and_compare(s, gas=g, steps=4, micro=6 // g)
                    for s in (1, 2) for g in (1, 3)},
    "sgd": lambda: {f"stage{s}": train_and_compare(s, opt="SGD", steps=6) for s in (0, 2)},
    "bf16": lambda: {f"stage{s}": train_and_compare(s, "bf16", steps=6) for s in (0, 1, 2)},
    "fp16": lambda: {f"stage{s}": train_and_compare(s, "fp16", steps=6) for s in (0, 1, 2)},
    "overflow": lambda: {f"stage{s}": fp16_overflow(s) for s in (0, 1, 2)},
    "user_opt": lambda: {
        "adamw": train_and_compare(2, user_optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2),
                                   steps=5),
        "adagrad": train_and_compare(1, user_optimizer=lambda g: torch.optim.Adagrad(g, lr=1e-2),
                                     steps=5),
        "rmsprop_stage0": train_and_compare(
            0, user_optimizer=lambda g: torch.optim.RMSprop(g, lr=1e-3), steps=4),
        "adagrad_bf16": train_and_compare(
            2, "bf16", user_optimizer=lambda g: torch.optim.Adagrad(g, lr=1e-2), steps=4)},
    "errors": bad_inputs,
    "buffers": buffers_broadcast,
}


def main():
    names = sys.argv[1].split(",")
    out = {name: SCENARIOS[name]() for name in names}
    report(out)
    leave_rank()


if __name__ == "__main__":
    main()
