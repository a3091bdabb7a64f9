"""Multi-rank worker for tests/test_torch_autocast.py: ``torch_autocast`` (alone and with
``bf16``) and ``lower_precision_safe_modules`` on 2 real ranks (gloo), ZeRO stages 0-3.

Usage: ``python torch_autocast.py FIXTURE`` on every rank. Scenarios:

- ``grads/s{stage}/gas{n}``: fp32 parameters, ``torch_autocast`` bf16 with
  ``lower_precision_safe_modules: ["__main__.SafeLeaf"]``, reduce buckets and fetch units
  small enough to mix safe and other parameters, 1 or 2 micro-steps. Each parameter enters
  the loss as ``sum(w * x)`` (no autocast op), so its gradient is x / (world · n) exactly;
  the reduced gradient each rank owns before the step is compared with float64 references
  computed here (``rules``): reduced in fp32, and reduced in bf16 (each rank's gradient
  rounded to bf16, the sum rounded to bf16 once, landing in the fp32 accumulator). It
  reports, per parameter kind (SafeLeaf, Leaf, SubSafeLeaf — a subclass, which DeepSpeed does
  not count as safe), the difference to each reference, and the dtypes and element counts
  the gradient collectives carried (a spy on the communicator), with the ledger's bytes.
- ``gather/p{threshold}``: stage 3, one fetch unit per leaf (threshold 50: the 41-element
  SafeLeaf persistent): the ledger's all-gather bytes against 2 per SafeLeaf element and 4
  per other, the weight each leaf computes with (bf16-rounded or exact), and whether a
  state dict is exact (scenario_gather).
- ``train/{case}``: every case of DeepSpeed's fixture (ci/tools/make_autocast_fixture.py):
  the same model, initialization, data and config, 4 steps; it reports the mean loss per
  step and the final parameters, and a plain-torch reference of the same steps (same
  autocast, the two ranks' gradients reduced per parameter in the dtype DeepSpeed uses,
  clipping, torch.optim.Adam on an fp32 — or bf16 — master copy; at stage 3 the safe
  parameters rounded to the autocast dtype before each step's forward — persistent ones
  only before the first — as DeepSpeed's gather rounds them; fp16 autocast: the loss
  scaled and the gradients unscaled by a GradScaler-rule scale, overflowing steps skipped).
  It also reports the final loss scale and ``skipped_steps``. ``noscaler/{case}``: the
  cases of ``NO_SCALER`` trained with the engine's scaler removed (the test's mutation).
"""
from __future__ import annotations

import copy
import json
import sys

import torch

import zero_core
from zero_core.testing.ranks import report

SHAPES = ((30, 10), (77,), (19, 27), (64,), (129,), (41,))
KINDS = ("safe", "plain", "sub", "safe", "plain", "safe")


class Leaf(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(shape))

    def forward(self, x):
        return (self.w * x).sum()


class SafeLeaf(Leaf):
    """Listed in lower_precision_safe_modules."""


class SubSafeLeaf(SafeLeaf):
    """A subclass of a listed class: not lower-precision safe (DeepSpeed matches exactly)."""


class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        cls = {"safe": SafeLeaf, "plain": Leaf, "sub": SubSafeLeaf}
        self.leaves = torch.nn.ModuleList(cls[k](s) for k, s in zip(KINDS, SHAPES))

    def forward(self, xs):
        return sum(leaf(x) for leaf, x in zip(self.leaves, xs))


def probe_inputs(rank: int, micro: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(77 + 10 * rank + micro)
    return [torch.randn(s, generator=g) for s in SHAPES]


def f32(t: torch.Tensor) -> torch.Tensor:
    """float64 *t* rounded to fp32 once."""
    return t.float().double()


def b16(t: torch.Tensor) -> torch.Tensor:
    """float64 *t* rounded to bf16 once (via fp32, exact for the values rounded here)."""
    f = t.float()
    assert torch.equal(f.double(), t), "the fp32 step would round: not a single rounding"
    return f.to(torch.bfloat16).double()


def rules(stage: int, grads: list[list[torch.Tensor]]) -> dict:
    """The reduced gradient (float64) if reduced in fp32 and if reduced in bf16, from
    *grads[r][m]* (rank r, micro-step m; exact): stages 0/1 add the micro-steps locally in
    the fp32 gradient buffer and reduce once; stages 2/3 reduce every micro-step and add the
    results in the fp32 accumulator."""
    world, gas = len(grads), len(grads[0])
    if stage < 2:
        local = [grads[r][0] for r in range(world)]
        for m in range(1, gas):
            local = [f32(local[r] + grads[r][m]) for r in range(world)]
        fp32 = f32(sum(local))
        bf16 = b16(sum(b16(t) for t in local))
        return {"fp32": fp32, "bf16": bf16}
    out = {}
    for name, one in (("fp32", lambda ts: f32(sum(ts))),
                      ("bf16", lambda ts: b16(sum(b16(t) for t in ts)))):
        acc = one([grads[r][0] for r in range(world)])
        for m in range(1, gas):
            acc = f32(acc + one([grads[r][m] for r in range(world)]))
        out[name] = acc
    return out


class Spy:
    """Counts (dtype, elements) of every reduce_scatter / all_reduce input."""

    def __init__(self, comm):
        self.seen: dict[str, int] = {}
        self.comm = comm
        for op in ("reduce_scatter", "all_reduce"):
            real = getattr(comm, op)

            def spy(*args, _real=real, _op=op, **kwargs):
                t = args[1] if _op == "reduce_scatter" else args[0]
                key = f"{_op}/{str(t.dtype).replace('torch.', '')}"
                self.seen[key] = self.seen.get(key, 0) + t.numel()
                return _real(*args, **kwargs)
            setattr(comm, op, spy)

    def remove(self) -> dict:
        for op in ("reduce_scatter", "all_reduce"):
            delattr(self.comm, op)  # the class's methods again
        return dict(self.seen)


def scenario_grads(stage: int, gas: int, rank: int, world: int, **extra) -> dict:
    torch.manual_seed(0)
    model = Probe()
    zc = {"stage": stage, "reduce_bucket_size": 200}
    if stage == 3:
        zc.update(stage3_prefetch_bucket_size=200, stage3_param_persistence_threshold=0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": zc,
           "torch_autocast": {"enabled": True, "dtype": "bf16",
                              "lower_precision_safe_modules": ["__main__.SafeLeaf"]}, **extra}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    ledger = engine.sharding.comm.ledger
    before = ledger.snapshot()
    spy = Spy(engine.sharding.comm)
    for m in range(gas):
        engine.backward(engine(probe_inputs(rank, m)))
        if m < gas - 1:
            engine.step()  # not a boundary: no update
    engine.reducer.wait_all()
    seen = spy.remove()
    ops = ledger.difference(ledger.snapshot(), before)["ops"]
    owned = owned_by_param(engine, rank, world)
    out = {kind: {"vs_fp32_rule": 0.0, "vs_bf16_rule": 0.0, "n": 0} for kind in set(KINDS)}
    for i, leaf in enumerate(model.leaves):
        grads = [[probe_inputs(r, m)[i].double().reshape(-1) / (world * gas)
                  for m in range(gas)] for r in range(world)]
        ref = rules(stage, grads)
        o = out[KINDS[i]]
        for lo, vals in owned.get(id(leaf.w), []):
            for name in ("fp32", "bf16"):
                d = float((vals - ref[name][lo:lo + vals.numel()]).abs().max())
                o[f"vs_{name}_rule"] = max(o[f"vs_{name}_rule"], d)
            o["n"] += vals.numel()
    wire = sum(ops.get(op, {}).get("payload_bytes", 0)
               for op in ("all_reduce", "reduce_scatter", "all_to_all_single"))
    engine.step()
    engine.destroy()
    numel = {k: sum(torch.Size(s).numel() for s, kk in zip(SHAPES, KINDS) if kk == k)
             for k in set(KINDS)}
    return {"params": out, "collectives": seen, "wire_bytes": wire, "numel": numel}


def scenario_gather(rank: int, world: int, threshold: int) -> dict:
    """Stage 3, every leaf its own fetch unit (prefetch bucket 1): one forward and backward.
    Reports the all-gather payload bytes in the ledger and what they should be — per unit
    gather, its slice of padded_numel / world elements at 2 bytes (a SafeLeaf's) or 4 —
    and would be with every gather in fp32,
    whether each leaf computed with its bf16-rounded or its exact fp32 weight (a forward
    hook), and whether a state dict taken after the backward (persistent units still
    gathered, rounded) holds the exact weights."""
    torch.manual_seed(0)
    model = Probe()
    exact = [leaf.w.detach().clone() for leaf in model.leaves]
    seen: dict[int, str] = {}

    def hook(i):
        def check(mod, _inp):
            w = mod.w.detach()
            rounded = exact[i].to(torch.bfloat16).float()
            kind = ("fp32-exact" if torch.equal(w, exact[i]) else
                    "bf16-rounded" if torch.equal(w, rounded) else "other")
            seen[i] = f"{w.dtype}/{kind}"
        return check
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1,
                                 "stage3_param_persistence_threshold": threshold},
           "torch_autocast": {"enabled": True, "dtype": "bf16",
                              "lower_precision_safe_modules": ["__main__.SafeLeaf"]}}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    for i, leaf in enumerate(model.leaves):  # after the engine's: runs on the gathered w
        leaf.register_forward_pre_hook(hook(i))
    gatherer = engine.parts.gatherer
    expected = {"n": 0, "fp32": 0}
    real_start = gatherer.start

    def start(u):
        if u.released:
            safe = all(type(m) is SafeLeaf for m in model.leaves for p in u.params if p is m.w)
            size = 2 if (safe and gatherer.for_compute) else 4
            expected["n"] += size * u.padded_numel // world
            expected["fp32"] += 4 * u.padded_numel // world
        real_start(u)
    gatherer.start = start
    ledger = engine.sharding.comm.ledger
    before = ledger.snapshot()
    engine.backward(engine(probe_inputs(rank)))
    engine.reducer.wait_all()
    ops = ledger.difference(ledger.snapshot(), before)["ops"]
    del gatherer.start
    state = engine.module_state_dict()
    names = [f"leaves.{i}.w" for i in range(len(SHAPES))]
    state_exact = all(torch.equal(state[n], exact[i]) for i, n in enumerate(names))
    engine.destroy()
    gathered = sum(d.get("payload_bytes", 0) for op, d in ops.items()
                   if op.startswith("all_gather"))
    return {"bytes": gathered, "expected": expected["n"], "seen": [seen[i] for i in
                                                                  range(len(SHAPES))],
            "state_exact": state_exact, "all_fp32_bytes": expected["fp32"]}


def owned_by_param(engine, rank: int, world: int) -> dict:
    """{id(param): [(offset in the flattened param, float64 values)]} of the reduced gradient
    this rank owns (before the step)."""
    out: dict[int, list] = {}
    for gb in engine.parts.buffers:
        if gb is None:
            continue
        if hasattr(gb, "units"):
            for k, u in enumerate(gb.units):
                shard = u.padded_numel // world
                lo_r = rank * shard
                vals = gb.reduced_grad_bucket(k).detach().double()
                for p, off in zip(u.params, u.offsets):
                    n = _numel(p)
                    a, b = max(off, lo_r), min(off + n, lo_r + shard)
                    if a < b:
                        out.setdefault(id(p), []).append((a - off, vals[a - lo_r:b - lo_r]))
            continue
        lay = gb.layout
        for k in range(gb.num_buckets):
            if gb.state_kind == "full":
                lo_r, n_r = lay.bucket_starts[k], lay.bucket_sizes[k]
            else:
                lo_r, n_r = lay.shard_start(k, rank), lay.shard_size(k)
            vals = gb.reduced_grad_bucket(k).detach().double()
            for i, p in enumerate(gb.params):
                off, n = lay.offsets[i], lay.numels[i]
                a, b = max(off, lo_r), min(off + n, lo_r + n_r)
                if a < b:
                    out.setdefault(id(p), []).append((a - off, vals[a - lo_r:b - lo_r]))
    return out


def _numel(p) -> int:
    from zero_core.stage3 import partitioned_params as pp
    return pp.meta_of(p).numel


# ---- training against DeepSpeed's fixture and a plain-torch reference ---------------------------
def _fixture_maker():
    """ci/tools/make_autocast_fixture.py (imports only torch at the top): its model and
    batches are the ones DeepSpeed trained for the fixture."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "ci/tools/make_autocast_fixture.py"
    spec = importlib.util.spec_from_file_location("make_autocast_fixture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_MAKER = _fixture_maker()
Net, batch = _MAKER.Net, _MAKER.batch


def safe_names(model, paths) -> set[str]:
    import importlib
    classes = tuple(getattr(importlib.import_module(p.rpartition(".")[0]), p.rpartition(".")[2])
                    for p in (paths if paths is not None else
                              ["torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d",
                               "torch.nn.Conv3d"]))
    return {f"{mn}.{pn}" if mn else pn for mn, m in model.named_modules() if type(m) in classes
            for pn, _ in m.named_parameters(recurse=False)}


def reference_run(cfg: dict, steps: int, world: int, perturb_ln: bool = False,
                  mult=None, scaler: bool = True) -> dict:
    """Plain torch: the same autocast forward per rank; per parameter the ranks' gradients
    rounded to its reduction dtype and summed with one rounding (what a 2-rank sum in that
    dtype gives); clipping; torch.optim.Adam on the master copy; parameters = master in the
    parameter dtype. fp16 autocast (with *scaler*): the loss times a GradScaler-rule scale
    (2**16 halved at each step whose gradients are not finite, which is skipped; no growth
    within a fixture's few steps), the gradients divided by it before clipping. *mult*:
    the fixture's ``loss_mult``."""
    model = _MAKER.make_model(perturb_ln)
    bf16 = cfg.get("bf16", {})
    pdt = torch.bfloat16 if bf16.get("enabled") else torch.float32
    mdt = torch.bfloat16 if bf16.get("bf16_master_weights_and_grads") else torch.float32
    stage = cfg["zero_optimization"]["stage"]
    names = [n for n, _ in model.named_parameters()]
    master = [p.detach().clone().to(mdt) for p in model.parameters()]
    model.to(pdt)
    opt_params = [torch.nn.Parameter(m) for m in master]
    o = cfg["optimizer"]["params"]
    opt = torch.optim.Adam(opt_params, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"])
    ac = cfg["torch_autocast"]
    adt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[ac.get("dtype", "bfloat16")]
    safe = safe_names(model, ac.get("lower_precision_safe_modules"))
    comm = {n: (adt if (n in safe and stage > 0) else pdt) for n in names}
    # stage 3 gathers the safe parameters for compute in the autocast dtype: persistent
    # ones (fewer elements than the threshold) only before the first step
    threshold = cfg["zero_optimization"].get("stage3_param_persistence_threshold", 1e5)
    # fp16 autocast: torch.amp.GradScaler's rule (scale 2**16, x0.5 and skip on inf/NaN)
    scale = 2.0 ** 16 if (adt == torch.float16 and scaler) else 1.0
    losses, skipped = [], 0
    for s in range(steps):
        if stage == 3:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in safe and (s == 0 or p.numel() >= threshold):
                        p.copy_(p.to(adt).to(p.dtype))
        grads, total = [], 0.0
        for r in range(world):
            model.zero_grad(set_to_none=True)
            x, y = batch(s, r, world)
            with torch.autocast("cpu", dtype=adt):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y) * _MAKER.loss_mult(mult or {}, s)
            total += float(loss) / world
            (loss / world * scale).backward()
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        losses.append(total)
        reduced = [sum(g[n].to(comm[n]).double() for g in grads).to(comm[n]).to(mdt)
                   .to(torch.float32) / scale for n in names]
        if not all(bool(torch.isfinite(g).all()) for g in reduced):
            scale, skipped = scale / 2, skipped + 1
            continue
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in reduced)))
        clip = cfg["gradient_clipping"]
        coef = clip / (norm + 1e-6) if 0 < clip < norm else 1.0
        for p, g in zip(opt_params, reduced):
            p.grad = (g * coef).to(mdt)
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), opt_params):
                p.copy_(m.to(pdt))
    return {"losses": losses, "final": {n: m.detach().float().reshape(-1).tolist()
                                        for n, m in zip(names, opt_params)},
            "scale": scale, "skipped_steps": skipped}


def scenario_train(cfg: dict, steps: int, rank: int, world: int,
                   perturb_ln: bool = False, mult=None, no_scaler: bool = False) -> dict:
    model = _MAKER.make_model(perturb_ln)
    engine, _, _, _ = zero_core.initialize(model=model, config=copy.deepcopy(cfg))
    if no_scaler:   # the test's mutation check: fp16 autocast without the GradScaler
        engine.loss_scaler = None
    losses = []
    for s in range(steps):
        x, y = batch(s, rank, world)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y) * _MAKER.loss_mult(mult or {}, s)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / world)
    state = engine.module_state_dict()
    dtypes = {n: str(v.dtype) for n, v in state.items()}
    final = {n: v.float().reshape(-1).tolist() for n, v in state.items()}
    scale = engine.loss_scale if engine.loss_scaler is not None else None
    skipped = engine.skipped_steps
    engine.destroy()
    return {"losses": losses, "final": final, "param_dtypes": dtypes, "scale": scale,
            "skipped_steps": skipped}


#: fixture cases also trained with the engine's GradScaler removed (the mutation check)
NO_SCALER = ("stage0_fp32_fp16ac_overflow", "stage2_fp32_fp16ac_underflow")


def main():
    fixture = json.load(open(sys.argv[1]))
    rt = zero_core.get_runtime()
    rank, world = rt.rank, rt.world_size
    out = {"world": world}
    for stage in (0, 1, 2, 3):
        for gas in (1, 2):
            out[f"grads/s{stage}/gas{gas}"] = scenario_grads(stage, gas, rank, world)
    # DeepSpeed ignores communication_data_type under torch_autocast at stages 1-3
    for stage in (2, 3):
        out[f"grads/s{stage}/comm_bf16"] = scenario_grads(stage, 1, rank, world,
                                                          communication_data_type="bf16")
    for threshold in (0, 50):   # 50: the Probe's 41-element SafeLeaf is persistent
        out[f"gather/p{threshold}"] = scenario_gather(rank, world, threshold)
    for name, case in fixture["cases"].items():
        if "refused" in case:
            continue
        perturb, mult = case.get("perturb_ln", False), {"loss_mult": case.get("loss_mult")}
        out[f"train/{name}"] = scenario_train(case["config"], fixture["steps"], rank, world,
                                              perturb, mult)
        if name in NO_SCALER:
            out[f"noscaler/{name}"] = scenario_train(case["config"], fixture["steps"], rank,
                                                     world, perturb, mult, no_scaler=True)
        if rank == 0:
            out[f"reference/{name}"] = reference_run(case["config"], fixture["steps"], world,
                                                     perturb, mult)
    report(out)


if __name__ == "__main__":
    main()
