"""Multi-rank worker for tests/test_stage3_multirank.py.

Usage: ``python stage3_train.py <scenario>[,<scenario>...]`` on every rank. Each scenario
trains a small model with the stage-3 engine and, in the same process, a single-process
plain-torch reference on the same global batches, and reports numbers that the test
compares with its bounds. Several scenarios share one launch (a launch costs seconds).

The model (``Net``) has everything stage 3 must handle: an embedding tied to the output
head, a frozen layer, nested modules (blocks holding a Sequential), a module called twice,
a parameter read directly by the parent's forward (registered with
register_external_parameter), a parameter used outside forward (a weight penalty computed
under GatheredParameters), a forward whose block order changes half-way through training,
a buffer, and two parameter groups.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import zero_core
from zero_core import checkpointing
from zero_core.testing.ranks import report

VOCAB, DIM, SEQ, MICRO = 32, 16, 6, 2
PENALTY = 1e-2


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.ff = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.Tanh(),
                                      torch.nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.ff(self.ln(x))


class Net(torch.nn.Module):
    def __init__(self, ckpt: bool = False):
        super().__init__()
        self.ckpt = ckpt
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.a = Block(DIM)
        self.b = Block(DIM)
        self.shared = torch.nn.Linear(DIM, DIM)           # called twice per forward
        self.mix = torch.nn.Linear(DIM, DIM, bias=False)  # never called: read by Net.forward
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight                # tied
        self.register_buffer("gain", torch.ones(DIM))

    def run(self, block, h):
        return checkpointing.checkpoint(block, h) if self.ckpt else block(h)

    def forward(self, ids, swap: bool = False):
        h = self.emb(ids) * self.gain
        h = h + 0.5 * self.frozen(h)
        first, second = (self.b, self.a) if swap else (self.a, self.b)
        h = self.run(first, h)
        h = torch.tanh(self.shared(h))
        h = self.run(second, h)
        h = self.shared(h)
        h = h + 0.3 * F.linear(h, self.mix.weight)
        return self.head(h)


def make_model(seed: int, ckpt=False) -> Net:
    torch.manual_seed(seed)
    m = Net(ckpt)
    with torch.no_grad():
        m.gain.uniform_(0.5, 1.5)
    return m


def groups_of(m: Net, lr=1e-2):
    no_decay = [p for n, p in m.named_parameters() if n.endswith("bias") or ".ln." in n]
    decay = [p for p in m.parameters() if all(p is not q for q in no_decay)]
    return [{"params": decay, "lr": lr, "weight_decay": 0.1},
            {"params": no_decay, "lr": lr / 2, "weight_decay": 0.0}]


def global_batch(seed: int, step: int, n: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def ce(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))


def penalty_param(m: Net):
    return m.b.ff[0].weight


def full_params(model) -> list[torch.Tensor]:
    """Every parameter's full values (gathered if partitioned), in float64."""
    params = list(model.parameters())
    with zero_core.GatheredParameters(params):
        return [p.detach().cpu().double() for p in params]


def rel_diff(a_list, b_list) -> float:
    num = max(float((a - b).abs().max()) for a, b in zip(a_list, b_list))
    den = max(float(b.abs().max()) for b in b_list)
    return num / den


def stage3_config(precision="fp32", gas=2, clip=0.5, **zero):
    z = {"stage": 3, "reduce_bucket_size": 400, "stage3_prefetch_bucket_size": 300,
         "stage3_param_persistence_threshold": 20, "stage3_max_live_parameters": 1500,
         "stage3_max_reuse_distance": 0}
    z.update(zero)
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "gradient_clipping": clip, "zero_optimization": z,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "bf16": {"enabled": precision == "bf16"},
            # a start scale low enough not to overflow: the comparison must not skip steps
            "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8}}


def train_and_compare(precision="fp32", gas=2, steps=10, seed=1, ckpt=False, init=False,
                      swap_from=5, **zero):
    """Train the stage-3 engine and the reference for *steps* optimizer steps."""
    rt = zero_core.get_runtime()
    rank, world = rt.rank, rt.world_size
    cfg = stage3_config(precision, gas, **zero)
    if init:
        torch.manual_seed(seed)
        with zero_core.Init(config=cfg):
            model = Net(ckpt)
        with torch.no_grad():  # gain is a buffer (not partitioned): make_model's values
            model.gain.copy_(make_model(seed).gain)
    else:
        model = make_model(seed, ckpt)
    ref = make_model(seed)
    zero_core.register_external_parameter(model, model.mix.weight)
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg,
                                           model_parameters=groups_of(model))
    ref_opt = torch.optim.AdamW(groups_of(ref), lr=1e-2)
    n = MICRO * gas * world
    norms, ref_norms = [], []
    for step in range(steps):
        swap = swap_from is not None and step >= swap_from
        ids, tgt = global_batch(seed, step, n)
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            loss = ce(engine(ids[rows], swap), tgt[rows])
            # a parameter used outside any module's forward
            with zero_core.GatheredParameters([penalty_param(model)]):
                loss = loss + PENALTY * penalty_param(model).float().pow(2).sum()
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
        ref_opt.zero_grad()
        loss = ce(ref(ids, swap), tgt) + PENALTY * penalty_param(ref).pow(2).sum()
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        ref_opt.step()
    mem = engine.memory_report()   # before full_params below gathers the whole model
    got = full_params(model)
    want = [p.detach().double() for p in ref.parameters()]
    frozen_ok = True
    with zero_core.GatheredParameters(list(model.frozen.parameters())):
        fresh = make_model(seed)
        frozen_ok = all(torch.equal(p.detach(), q.detach().to(p.dtype))
                        for p, q in zip(model.frozen.parameters(), fresh.frozen.parameters()))
    out = {"rel_diff": rel_diff(got, want), "norms": norms, "ref_norms": ref_norms,
           "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
           "skipped": engine.skipped_steps, "frozen_unchanged": frozen_ok,
           "tied": model.head.weight is model.emb.weight,
           "stage3": mem["stage3"], "memory": mem, "comm": engine.comm_report(),
           "ranks_agree": checksum_everywhere(got)}
    engine.destroy()
    return out


def checksum_everywhere(tensors) -> bool:
    """The gathered parameters are identical on every rank."""
    comm = zero_core.get_runtime().comm
    s = torch.stack([t.sum() for t in tensors]).reshape(-1)
    both = torch.cat([s, -s])
    comm.all_reduce(both, "max")
    return bool(torch.equal(both[:len(s)], -both[len(s):]))


def checkpoint_equivalence(seed=2, steps=3):
    """Stage 3 with and without activation checkpointing: same norms, same parameters."""
    checkpointing.reset()
    runs = {}
    for ckpt in (False, True):
        rt = zero_core.get_runtime()
        cfg = stage3_config(gas=1)
        model = make_model(seed, ckpt)
        zero_core.register_external_parameter(model, model.mix.weight)
        engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
        norms = []
        for step in range(steps):
            ids, tgt = global_batch(seed, step, MICRO * rt.world_size)
            rows = slice(rt.rank * MICRO, (rt.rank + 1) * MICRO)
            engine.backward(ce(engine(ids[rows], step % 2 == 1), tgt[rows]))
            engine.step()
            norms.append(engine.get_global_grad_norm())
        runs[ckpt] = (norms, full_params(model))
        engine.destroy()
    (n0, p0), (n1, p1) = runs[False], runs[True]
    return {"norms": n0, "norms_ckpt": n1, "rel_diff": rel_diff(p1, p0)}


def init_roundtrip(seed=4):
    """Init builds the same model as plain construction (gathered values are equal);
    GatheredParameters with modifier_rank broadcasts the modifier's values."""
    rt = zero_core.get_runtime()
    cfg = stage3_config()
    torch.manual_seed(seed)
    with zero_core.Init(config=cfg):
        model = Net()
    torch.manual_seed(seed)
    plain = Net()
    parts = {n: tuple(p.data.shape) for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    same_as_plain = all(torch.equal(a.float(), b.detach().double().float())
                        for a, b in zip(full_params(model), plain.parameters()))
    target = model.a.ff[2].weight
    with zero_core.GatheredParameters([target], modifier_rank=rt.world_size - 1):
        with torch.no_grad():
            target.fill_(float(rt.rank) + 0.25)   # every rank writes; only the modifier's wins
    with zero_core.GatheredParameters([target]):
        seen = float(target.detach().double().mean())
        seen_min = float(target.detach().min())
    # an engine built on the Init model trains; GatheredParameters after init modifies
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    bias = model.shared.bias
    with zero_core.GatheredParameters([bias], modifier_rank=0):
        with torch.no_grad():
            bias.copy_(torch.arange(DIM, dtype=bias.dtype) * (1 + rt.rank))
    with zero_core.GatheredParameters([bias]):
        bias_seen = bias.detach().tolist()
    stage2_noop = True
    engine.destroy()
    return {"partition_shapes": parts, "shapes": shapes, "same_as_plain": same_as_plain,
            "seen": seen, "seen_min": seen_min, "expected": float(rt.world_size - 1) + 0.25,
            "bias_seen": bias_seen, "stage2_noop": stage2_noop}


def errors():
    """Reading a partitioned parameter without gathering it is an error naming it."""
    rt = zero_core.get_runtime()
    out = {}
    model = make_model(5)   # mix.weight is read by Net.forward but not registered
    engine, _, _, _ = zero_core.initialize(model=model, config=stage3_config(gas=1))
    ids, _ = global_batch(5, 0, MICRO * rt.world_size)
    try:
        engine(ids[:MICRO])
        out["unregistered"] = None
    except zero_core.ParameterNotGatheredError as e:
        out["unregistered"] = str(e)
    try:
        float(model.a.ff[0].weight.sum())
        out["outside"] = None
    except zero_core.ParameterNotGatheredError as e:
        out["outside"] = str(e)
    out["shape_of_released"] = list(model.a.ff[0].weight.shape)
    engine.destroy()
    return out


def saving(tmpdir, seed=6):
    """save_16bit_model and module_state_dict: full values, torch's keys, one unit at a time."""
    rt = zero_core.get_runtime()
    out = {}
    for precision in ("fp32", "bf16"):
        cfg = stage3_config(precision, gas=1,
                            stage3_gather_16bit_weights_on_model_save=True)
        model = make_model(seed)
        zero_core.register_external_parameter(model, model.mix.weight)
        keys = list(make_model(seed).state_dict().keys())
        engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
        ids, tgt = global_batch(seed, 0, MICRO * rt.world_size)
        engine.backward(ce(engine(ids[rt.rank * MICRO:(rt.rank + 1) * MICRO]),
                           tgt[rt.rank * MICRO:(rt.rank + 1) * MICRO]))
        engine.step()
        live_before = engine.memory_report()["stage3"]["live_window_now"]
        sd = engine.module_state_dict()
        sd0 = engine.module_state_dict(rank0_only=True)
        saved = engine.save_16bit_model(tmpdir, f"model_{precision}.bin")
        gathered = dict(zip([n for n, _ in model.named_parameters()], full_params(model)))
        match = all(torch.equal(sd[n].double(), v) for n, v in gathered.items())
        loaded_match = None
        if rt.rank == 0:
            loaded = torch.load(os.path.join(tmpdir, f"model_{precision}.bin"), weights_only=True)
            loaded_match = (list(loaded.keys()) == keys and all(
                torch.equal(loaded[k], sd[k]) for k in keys))
            fresh = make_model(seed)
            fresh.load_state_dict({k: v.float() for k, v in loaded.items()})
        out[precision] = {
            "keys_match": list(sd.keys()) == keys, "values_match": match,
            "rank0_only_empty": (len(sd0) == 0) != (rt.rank == 0), "saved": saved,
            "loaded_match": loaded_match, "dtype": str(sd["a.ff.0.weight"].dtype),
            "tied_shared": sd["head.weight"] is sd["emb.weight"],
            "live_before": live_before,
            "live_after": engine.memory_report()["stage3"]["live_window_now"]}
        engine.destroy()
    cfg = stage3_config(gas=1)
    model = make_model(seed)
    zero_core.register_external_parameter(model, model.mix.weight)
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    out["not_enabled_returns"] = engine.save_16bit_model(tmpdir, "never.bin")
    out["not_enabled_file"] = os.path.exists(os.path.join(tmpdir, "never.bin"))
    engine.destroy()
    return out


def memory_reports():
    """memory_report() of fresh engines after one step, fp32/bf16, Adam and SGD."""
    rt = zero_core.get_runtime()
    out = {}
    for precision in ("fp32", "bf16"):
        for opt in ("Adam", "SGD"):
            cfg = stage3_config(precision, gas=1)
            cfg["optimizer"] = {"type": opt, "params": (
                {"lr": 1e-3, "momentum": 0.9} if opt == "SGD" else {"lr": 1e-3})}
            model = make_model(9)
            zero_core.register_external_parameter(model, model.mix.weight)
            engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
            ids, tgt = global_batch(9, 0, MICRO * rt.world_size)
            rows = slice(rt.rank * MICRO, (rt.rank + 1) * MICRO)
            engine.backward(ce(engine(ids[rows]), tgt[rows]))
            engine.step()
            rep = engine.memory_report()
            rep["persistent_numels"] = sum(p.numel() for p in model.parameters()
                                           if p.requires_grad and p.numel() < 20)
            out[f"{precision}_{opt}"] = rep
            engine.destroy()
    return out


class Stack(torch.nn.Module):
    """Linear layers in a row: one fetch unit per weight, used once in forward and once
    in backward, so the live window is set by the config alone."""

    def __init__(self, n=8, d=16):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def watch_gathered_buffers(gatherer) -> list:
    """Record (unit, bytes, weak reference to the storage of its gathered buffer) for every
    unit *gatherer* makes available from now on (the storage, not the tensor: a saved
    view keeps the storage alive without the tensor object)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    seen = []
    wait = gatherer.wait

    def recording_wait(u):
        wait(u)
        seen.append((u, u.full.numel() * u.full.element_size(),
                     StorageWeakRef(u.full.untyped_storage())))
    gatherer.wait = recording_wait
    return seen


def live_window():
    """Peak of the gathered window under three max_live/reuse settings."""
    rt = zero_core.get_runtime()
    out = {}
    for name, live, reuse in (("tight", 1, 0), ("window", 600, 0), ("keep_all", 10**9, 10**9)):
        cfg = stage3_config(gas=1, reduce_bucket_size=200, stage3_prefetch_bucket_size=10**6,
                            stage3_max_live_parameters=live, stage3_max_reuse_distance=reuse)
        torch.manual_seed(11)
        model = Stack()
        engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
        buffers = watch_gathered_buffers(engine.parts.gatherer)
        held = []
        for step in range(3):
            x = torch.randn(MICRO, 16, generator=torch.Generator().manual_seed(step * 10 + rt.rank))
            buffers.clear()
            loss = engine(x).pow(2).mean()
            # gathered buffers of released units that something (autograd) still holds
            held.append(sum(nbytes for u, nbytes, ref in buffers
                            if u.released and not ref.expired()))
            engine.backward(loss)
            engine.step()
        rep = engine.memory_report()["stage3"]
        rep["held_after_forward"] = held
        rep["unit_bytes"] = sorted(u.padded_numel * 4 for u in engine.parts.units if not u.persistent)
        out[name] = rep
        engine.destroy()
    return out


def init_memory(layers=12, width=1024):
    """Peak memory (process RSS above the start) while building a model of *layers*
    width×width Linear layers, with and without Init; the model re-initializes its
    children with apply(), which under Init gathers each weight once."""
    import gc

    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False)
                                              for _ in range(layers))
            self.apply(self._init)

        @staticmethod
        def _init(m):
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight, std=0.02)

    acc = zero_core.get_runtime().accelerator
    cfg = stage3_config()
    out = {"model_bytes": layers * width * width * 4, "module_bytes": width * width * 4}
    torch.manual_seed(0)
    with zero_core.Init(config=cfg):  # warm-up: first-use allocations of torch and the comm
        warm = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        warm.apply(Big._init)
    del warm
    for name in ("init", "plain"):
        gc.collect()
        acc.reset_peak_memory_stats()
        base = acc.memory_allocated()
        torch.manual_seed(0)
        if name == "init":
            with zero_core.Init(config=cfg):
                model = Big()
        else:
            model = Big()
        out[name] = {"peak": acc.max_memory_allocated() - base,
                     "after": acc.memory_allocated() - base}
        if name == "init":
            w = model.layers[3].weight
            with zero_core.GatheredParameters([w]):
                out["init_std"] = float(w.detach().std())
        del model
    return out


SCENARIOS = {
    "window": live_window,
    "init_memory": init_memory,
    "fp32": lambda: {"small_window": train_and_compare(),
                     "defaults": train_and_compare(steps=6, seed=3, reduce_bucket_size=10**6,
                                                   stage3_prefetch_bucket_size=5 * 10**7,
                                                   stage3_param_persistence_threshold=10**5,
                                                   stage3_max_live_parameters=10**9,
                                                   stage3_max_reuse_distance=10**9)},
    "init_train": lambda: {"init": train_and_compare(steps=6, seed=7, init=True)},
    "bf16": lambda: {"bf16": train_and_compare("bf16", steps=6)},
    "fp16": lambda: {"fp16": train_and_compare("fp16", steps=6)},
    "checkpointing": checkpoint_equivalence,
    "init": init_roundtrip,
    "errors": errors,
    "memory": memory_reports,
}


def main():
    names = sys.argv[1].split(",")
    out = {}
    for name in names:
        if name == "saving":
            out[name] = saving(sys.argv[2])
        else:
            out[name] = SCENARIOS[name]()
    report(out)
    zero_core.runtime.context.shutdown()


if __name__ == "__main__":
    main()
