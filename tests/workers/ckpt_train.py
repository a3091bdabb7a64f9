"""Multi-rank worker for tests/test_checkpoint_*.py.

Usage: ``python ckpt_train.py '<json list of tasks>'`` on every rank; each task is a list
``[action, *args]`` and the rank reports the list of their results. Several tasks run in
one launch because a launch costs seconds and the model is tiny.

Actions:

* ``["resume_first", dir, name]`` — config *name* (CONFIGS): train 20 steps straight and
  report; then from scratch train 10 steps and save into *dir*.
* ``["resume_second", dir, name]`` — load *dir* (saved by resume_first) into a fresh engine
  in this new job, train 10 more steps, report. Data come from the per-rank global torch,
  Python and numpy RNGs and a generator kept in client_state; the model uses dropout.
* ``["reshard_save", dir, stage]`` — train 10 steps on step-indexed global batches (no
  dropout), save, report the saved fragments' values.
* ``["reshard_load", dir, stage]`` — load into an engine of this world size at *stage*,
  report the loaded fragments' values, train 10 more steps, and train an uninterrupted
  20-step run at this world size and stage for comparison.
* ``["kill_save", dir, timeout, mode]`` — save tag 'good'; then save tag 'bad' during which
  rank 1 SIGKILLs (mode "kill") or SIGSTOPs ("stop") itself halfway through writing its
  shard; report what the others saw.
* ``["load_latest", dir]`` / ``["save_tag", dir, tag]`` — load what ``latest`` names / save.
* ``["load_error", dir, variant]`` — try to load a damaged/mismatched checkpoint; report
  the error.
* ``["save_big", dir, n_layers, width]`` — save a wider model without training (convert
  memory test).
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import zero_core
from zero_core.checkpoint import store as checkpoint_store
from zero_core.checkpoint.store import CheckpointError
from zero_core.testing.ranks import report

VOCAB, DIM, SEQ, MICRO, GAS = 32, 16, 6, 2, 2
GLOBAL_BATCH = 16  # rows per optimizer step in the resharding runs, split over the ranks


class Net(torch.nn.Module):
    """~1.9k parameters: an embedding tied to the output head, a frozen layer, dropout,
    a LayerNorm, biases and a buffer."""

    def __init__(self, dropout=0.0, dim=DIM, extra=False):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, dim)
        self.frozen = torch.nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.l1 = torch.nn.Linear(dim, 24)
        self.drop = torch.nn.Dropout(dropout)
        self.ln = torch.nn.LayerNorm(24)
        self.l2 = torch.nn.Linear(24, dim)
        if extra:
            self.l3 = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("gain", torch.ones(dim))

    def forward(self, ids):
        h = self.emb(ids) * self.gain
        h = h + 0.5 * self.frozen(h)
        h = h + self.l2(torch.tanh(self.ln(self.drop(self.l1(h)))))
        return self.head(h)


def make_model(seed=1, **kw) -> Net:
    torch.manual_seed(seed)
    m = Net(**kw)
    with torch.no_grad():
        m.gain.uniform_(0.5, 1.5)
    return m


def groups_of(m):
    decay = [m.emb.weight, m.l1.weight, m.l2.weight]
    no_decay = [m.l1.bias, m.l2.bias, m.ln.weight, m.ln.bias]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


#: name -> (stage, precision, optimizer)
CONFIGS = {"s0_sgd": (0, "fp32", "SGD"), "s1": (1, "fp32", "AdamW"), "s2": (2, "fp32", "AdamW"),
           "s2_bf16": (2, "bf16", "AdamW"), "s1_fp16": (1, "fp16", "Adam"),
           "s3": (3, "fp32", "AdamW"), "s3_bf16": (3, "bf16", "AdamW")}


def config(stage, precision="fp32", opt="AdamW", micro=MICRO):
    params = {"lr": 1e-2}
    if opt == "SGD":
        params["momentum"] = 0.9
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": GAS,
           "gradient_clipping": 0.5, "optimizer": {"type": opt, "params": params},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                        "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 6}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
           "bf16": {"enabled": precision == "bf16"},
           # a start scale that overflows: the first steps are skipped, the scaler moves
           "fp16": {"enabled": precision == "fp16", "initial_scale_power": 20}}
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=20,
                                        stage3_prefetch_bucket_size=200)
    return cfg


def build(stage, precision="fp32", opt="AdamW", dropout=0.0, micro=MICRO, **model_kw):
    model = make_model(dropout=dropout, **model_kw)
    engine, _, _, _ = zero_core.initialize(model=model, config=config(stage, precision, opt, micro),
                                           model_parameters=groups_of(model))
    return model, engine


def rt():
    return zero_core.get_runtime()


def seed_rank():
    """Per-rank RNG streams, and the data generator that lives in client_state."""
    r = rt().rank
    torch.manual_seed(1000 + r)
    random.seed(2000 + r)
    np.random.seed(3000 + r)
    # a sampler-like generator shared by all ranks (client_state is rank 0's, as in DeepSpeed)
    return torch.Generator().manual_seed(4000)


def rng_batch(gen):
    """A micro-batch drawn from every RNG a data pipeline may use: this rank's torch,
    Python and numpy streams, and the shared generator *gen* (this rank's rows)."""
    ids = torch.randint(0, VOCAB, (MICRO, SEQ))
    shift = random.randrange(VOCAB)
    if np.random.randint(2):
        ids = ids.flip(1)
    r, world = rt().rank, rt().world_size
    noise = torch.randint(0, 2, (world, MICRO, SEQ), generator=gen)[r]
    return (ids + shift) % VOCAB, (torch.roll(ids, -1, 1) + noise) % VOCAB


def global_micro() -> int:
    """Per-rank micro-batch that keeps the global batch at GLOBAL_BATCH rows."""
    return GLOBAL_BATCH // (GAS * rt().world_size)


def global_batch(step):
    """Step-indexed global batch of GLOBAL_BATCH rows (the same at any world size)."""
    g = torch.Generator().manual_seed(7000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def loss_fn(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))


def train_rng(engine, gen, steps):
    losses = []
    for _ in range(steps):
        for _ in range(GAS):
            ids, tgt = rng_batch(gen)
            loss = loss_fn(engine(ids), tgt)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def train_global(engine, steps):
    rank, world, micro = rt().rank, rt().world_size, global_micro()
    for _ in range(steps):
        ids, tgt = global_batch(engine.global_steps)
        for m in range(GAS):
            rows = slice((m * world + rank) * micro, (m * world + rank + 1) * micro)
            engine.backward(loss_fn(engine(ids[rows]), tgt[rows]))
            engine.step()


def params_of(engine) -> dict:
    """Every parameter's values (fp32 lists); collective at stage 3 (gathers)."""
    if engine.stage == 3:
        sd = engine.module_state_dict()
        return {n: sd[n].float().reshape(-1).tolist() for n, _ in engine.module.named_parameters()}
    return {n: p.detach().float().reshape(-1).tolist() for n, p in engine.module.named_parameters()}


def counters(engine) -> dict:
    return {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps, "lr": engine.get_lr(),
            "loss_scale": engine.loss_scale}


def fragments_of(engine, purpose) -> list:
    return [[f.name, f.start, f.end, {k: v.float().tolist() for k, v in f.tensors.items()}]
            for f in engine.checkpoint_subject().fragments(purpose)]


def rel_diff(a: dict, b: dict) -> float:
    num = max(max(abs(x - y) for x, y in zip(a[n], b[n])) for n in a)
    den = max(max(abs(y) for y in b[n]) for n in b)
    return num / den


# ---- actions ------------------------------------------------------------------------------------
def resume_first(directory, name):
    stage, precision, opt = CONFIGS[name]
    model, engine = build(stage, precision, opt, dropout=0.2)
    gen = seed_rank()
    losses = train_rng(engine, gen, 20)
    straight = {"params": params_of(engine), "losses": losses[10 * GAS:],
                **counters(engine)}
    engine.destroy()
    model, engine = build(stage, precision, opt, dropout=0.2)
    gen = seed_rank()
    first = train_rng(engine, gen, 10)
    engine.save_checkpoint(directory, client_state={"data_gen": gen.get_state(), "epoch": 3,
                                                    "note": "resume"})
    saved = {"params": params_of(engine), **counters(engine)}
    engine.destroy()
    return {"straight": straight, "saved": saved, "first_losses": first}


def resume_second(directory, name, module_only=False):
    stage, precision, opt = CONFIGS[name]
    seed_rank()  # deliberately not the saved state: the load must restore it
    torch.manual_seed(99)
    model, engine = build(stage, precision, opt, dropout=0.2)
    path, client = engine.load_checkpoint(directory, load_module_only=module_only)
    loaded = {"params": params_of(engine), **counters(engine)}
    gen = torch.Generator()
    gen.set_state(client["data_gen"])
    losses = train_rng(engine, gen, 10)
    out = {"path": path, "client_keys": sorted(client), "epoch": client["epoch"],
           "loaded": loaded, "params": params_of(engine), "losses": losses, **counters(engine)}
    engine.destroy()
    return out


def reshard_save(directory, stage, precision="fp32"):
    model, engine = build(stage, precision, micro=global_micro())
    train_global(engine, 10)
    engine.save_checkpoint(directory, tag="step10")
    out = {"fragments": fragments_of(engine, "save"), "params": params_of(engine),
           **counters(engine)}
    engine.destroy()
    return out


def reshard_load(directory, stage, precision="fp32"):
    model, engine = build(stage, precision, micro=global_micro())
    engine.load_checkpoint(directory)
    out = {"loaded_fragments": fragments_of(engine, "load"), "loaded": counters(engine),
           "loaded_params": params_of(engine)}
    train_global(engine, 10)
    out.update(params=params_of(engine), **counters(engine))
    engine.destroy()
    ref_model, ref = build(stage, precision, micro=global_micro())
    train_global(ref, 20)
    out["uninterrupted"] = {"params": params_of(ref), **counters(ref)}
    out["rel_diff"] = rel_diff(out["params"], out["uninterrupted"]["params"])
    ref.destroy()
    return out


def kill_save(directory, timeout, mode="kill"):
    model, engine = build(2, micro=global_micro())
    if rt().rank == 1:
        with open(os.path.join(directory + ".rank1.pid"), "w") as fh:
            fh.write(str(os.getpid()))
    train_global(engine, 3)
    engine.save_checkpoint(directory, tag="good")
    good = params_of(engine)
    if rt().rank == 0:  # known before the crash, whatever the launcher does afterwards
        with open(os.path.join(directory, "good_params.json"), "w") as fh:
            json.dump(good, fh)
    train_global(engine, 2)
    if rt().rank == 1:
        original = checkpoint_store.write_safetensors

        def dying_writer(path, entries, metadata=None, on_tensor=None):
            # write the first half of the shard's tensors for real, then die: a crash
            # in the middle of writing
            def hook(entry, seen=[0]):
                seen[0] += 1
                if seen[0] * 2 >= len(entries):
                    # SIGKILL: a crash; SIGSTOP: a hang (the others must time out)
                    os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
            return original(path, entries, metadata, on_tensor=hook)
        checkpoint_store.write_safetensors = dying_writer
    t0 = time.monotonic()
    try:
        engine.save_checkpoint(directory, tag="bad")
        outcome = {"error": None}
    except CheckpointError as exc:
        outcome = {"error": str(exc), "type": type(exc).__name__}
    outcome.update(seconds=time.monotonic() - t0, timeout=timeout, good=good)
    report([outcome])
    if mode == "stop" and rt().rank == 0:  # end the stopped peer: nothing else would
        with open(directory + ".rank1.pid") as fh:
            os.kill(int(fh.read()), signal.SIGKILL)
    sys.stdout.flush()
    # the peer is gone: leave without the collective shutdown
    os._exit(3 if outcome["error"] else 0)


def load_latest(directory, stage=1):
    """Load the checkpoint ``latest`` names; report it and the parameters."""
    model, engine = build(stage)
    path, client = engine.load_checkpoint(directory)
    out = {"path": path, "params": params_of(engine), **counters(engine)}
    engine.destroy()
    return out


def save_tag(directory, tag, stage=1):
    model, engine = build(stage)
    out = {"path": engine.save_checkpoint(directory, tag=tag)}
    engine.destroy()
    return out


def load_error(directory, variant):
    kw = {"wrong_shape": {"dim": 20}, "extra_layer": {"extra": True}}.get(variant, {})
    model, engine = build(1, **kw)
    try:
        engine.load_checkpoint(directory)
        out = {"error": None}
    except CheckpointError as exc:
        out = {"error": str(exc)}
    engine.destroy()
    return out


def save_big(directory, n_layers, width):
    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n_layers))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x
    torch.manual_seed(0)
    model = Big()
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 10 ** 9}}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    engine.save_checkpoint(directory, tag="big")
    out = {"numel": sum(p.numel() for p in model.parameters()),
           "checksums": {n: float(p.double().sum()) for n, p in model.named_parameters()}}
    engine.destroy()
    return out


ACTIONS = {"resume_first": resume_first, "resume_second": resume_second,
           "reshard_save": reshard_save, "reshard_load": reshard_load, "kill_save": kill_save,
           "load_error": load_error, "save_big": save_big, "load_latest": load_latest,
           "save_tag": save_tag}


def main():
    tasks = json.loads(sys.argv[1])
    results = []
    for action, *args in tasks:
        results.append(ACTIONS[action](*args))
    report(results)
    zero_core.runtime.context.shutdown()


if __name__ == "__main__":
    main()
