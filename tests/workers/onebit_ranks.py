"""Multi-rank worker for tests/test_onebit.py: the 1-bit all-reduce on its own, and the
engine training with ``optimizer.type`` "OneBitAdam", "ZeroOneAdam" and "OneBitLamb" (stage
0, fp32).

Importable: :func:`rank_input` (every rank's seeded random input, so that the test rebuilds
all of them), :data:`SIZES`, :data:`ONEBIT` / :data:`ZERO_ONE` / :data:`ONEBIT_LAMB` (the
optimizers' parameters).

As a script, on every rank: ``python onebit_ranks.py <seed>`` (below);
``... <seed> resume <dir>``: for each optimizer, train N steps, save, train M against a fresh
engine that loads and trains M (:func:`resume`); ``... <seed> load <dir> <type>``: load a
checkpoint saved on another world size and train two steps. The first reports

* ``allreduce``: this rank's output of :data:`CALLS` successive compressed all-reduces of
  :data:`SIZES`-shaped random tensors (the errors carry over between calls);
* ``train`` (per optimizer type): the engine's flat parameters before training and after
  each step, the gradient buffer the optimizer read at each step (all-reduced, or this
  rank's own), the layout, the bytes sent per step, and (OneBitAdam) the largest difference
  from an independent float64 reference of data-parallel training in the warm-up (every
  rank's batch, averaged gradients, DeepSpeed's OnebitAdam update); (OneBitLamb) its
  coefficients and the engine's plain "Lamb" without bias correction on the same batches.
"""
from __future__ import annotations

import math
import os
import sys

import torch

from zero_core.checkpoint import store

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_train import MICRO, batch, loss_of, make_net  # noqa: E402

#: tensor sizes: a single element, sizes below, at and above the padding unit
SIZES = (1, 7, 48, 100, 1000, 4099)
CALLS = 3
ONEBIT = {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.01,
          "freeze_step": 3}
#: 0/1 Adam with short intervals: full and 1-bit gradient steps, then frozen local steps
ZERO_ONE = {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.01,
            "var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2,
            "local_step_clipper": 4}
#: 1-bit LAMB: Lamb's warm-up, then frozen coefficients (DeepSpeed's other defaults)
ONEBIT_LAMB = {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.01,
               "freeze_step": 3, "max_coeff": 10.0, "min_coeff": 0.01, "coeff_beta": 0.9,
               "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}
STEPS = {"OneBitAdam": 7, "ZeroOneAdam": 16, "OneBitLamb": 7}
PARAMS = {"OneBitAdam": ONEBIT, "ZeroOneAdam": ZERO_ONE, "OneBitLamb": ONEBIT_LAMB}


def rank_input(seed: int, call: int, rank: int) -> list[torch.Tensor]:
    """Rank *rank*'s tensors for call *call*: mixed magnitudes, some exact zeros."""
    g = torch.Generator().manual_seed(seed * 7919 + call * 131 + rank)
    out = []
    for k in SIZES:
        x = torch.randn(k, generator=g, dtype=torch.float64) * math.exp(float(
            torch.randn(1, generator=g)))
        x[::5] = 0.0 if k > 5 else x[::5]
        out.append(x.float())
    return out


def check_allreduce(comm, seed: int) -> list:
    from zero_core.optim.compressed_allreduce import CompressedAllReduce
    car = CompressedAllReduce(comm, list(SIZES), torch.device("cpu"))
    outs = []
    for call in range(CALLS):
        ts = [t.clone() for t in rank_input(seed, call, comm.rank)]
        before = comm.ledger.snapshot()
        car(ts)
        sent = comm.ledger.difference(comm.ledger.snapshot(), before)
        outs.append({"values": [t.tolist() for t in ts], "sent_bytes": sent["sent_bytes"]})
    return outs


def ref_onebit_warmup(ref, grads, state, step):
    """DeepSpeed's OnebitAdam update on whole float64 parameters (warm-up phase)."""
    b1, b2 = ONEBIT["betas"]
    for i, (p, g) in enumerate(zip(ref.parameters(), grads)):
        m = state.setdefault(("m", i), torch.zeros_like(p))
        v = state.setdefault(("v", i), torch.zeros_like(p))
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        upd = m / (v.sqrt() + ONEBIT["eps"]) + ONEBIT["weight_decay"] * p
        p.sub_(ONEBIT["lr"] * upd)


def train(seed: int, kind: str) -> dict:
    import zero_core
    rt = zero_core.get_runtime()
    model, ref = make_net(seed), make_net(seed, torch.float64)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 0},
           "optimizer": {"type": kind, "params": {**PARAMS[kind], "comm_backend_name":
                                                  "compressed"}}}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    gb = engine.parts.buffers[0]
    order = {id(p): i for i, p in enumerate(model.parameters())}
    ref_params = list(ref.parameters())
    idx = [order[id(p)] for p in gb.params]          # layout order -> module order
    flat = lambda: gb.param_buf.data.double().tolist()  # noqa: E731
    out = {"offsets": list(gb.layout.offsets), "numels": list(gb.layout.numels),
           "padded": gb.layout.padded_numel, "initial": flat(), "grads": [], "weights": [],
           "warmup_rel_diff": 0.0, "sent": [],
           # for each parameter in module order, its index in the layout
           "module_order": [idx.index(q) for q in range(len(idx))]}
    state, n = {}, MICRO * rt.world_size
    for step in range(STEPS[kind]):
        ids, tgt = batch(seed, step, n)
        rows = slice(rt.rank * MICRO, (rt.rank + 1) * MICRO)
        engine.backward(loss_of(engine(ids[rows]), tgt[rows]))
        engine.reducer.wait_all()   # the warm-up's all-reduce may still be in flight
        out["grads"].append(gb.grad_buf.data.double().tolist())
        engine.step()
        out["weights"].append(flat())
        out["sent"].append(engine.comm_report()["sent_bytes"])
        if kind == "OneBitAdam" and step < ONEBIT["freeze_step"]:
            ref.zero_grad()
            loss_of(ref(ids), tgt).backward()
            with torch.no_grad():
                ref_onebit_warmup(ref, [p.grad for p in ref.parameters()], state, step + 1)
            worst = 0.0
            for i, p in enumerate(gb.params):
                q = ref_params[idx[i]].detach()
                err = (p.detach().double() - q).abs().max() / q.abs().max()
                worst = max(worst, float(err))
            out["warmup_rel_diff"] = max(out["warmup_rel_diff"], worst)
    out["norm"] = engine.get_global_grad_norm()
    out["lamb_coeffs"] = engine.optimizer.get_lamb_coeffs() if kind == "OneBitLamb" else None
    engine.destroy()
    if kind == "OneBitLamb":
        out["plain_lamb"] = plain_lamb(seed)
    return out


def plain_lamb(seed: int) -> list:
    """The engine's own "Lamb" (DeepSpeed's FusedLamb) without bias correction, i.e. 1-bit
    LAMB's warm-up update, for its freeze_step steps on the same batches: flat weights."""
    import zero_core
    rt = zero_core.get_runtime()
    model = make_net(seed)
    params = {k: ONEBIT_LAMB[k] for k in ("lr", "betas", "eps", "weight_decay", "max_coeff",
                                          "min_coeff")}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 0},
           "optimizer": {"type": "Lamb", "params": {**params, "bias_correction": False}}}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    gb, out = engine.parts.buffers[0], []
    for step in range(ONEBIT_LAMB["freeze_step"]):
        ids, tgt = batch(seed, step, MICRO * rt.world_size)
        rows = slice(rt.rank * MICRO, (rt.rank + 1) * MICRO)
        engine.backward(loss_of(engine(ids[rows]), tgt[rows]))
        engine.step()
        out.append(gb.param_buf.data.double().tolist())
    engine.destroy()
    return out


#: resume checks: (save after this many steps, train up to this many steps); 0/1 Adam's
#: save is in its frozen phase between two synchronizations (lrs and u not zero)
RESUME = {"OneBitAdam": (5, 8), "ZeroOneAdam": (14, 17), "OneBitLamb": (5, 8)}


def _engine(seed: int, kind: str):
    import zero_core
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 0},
           "optimizer": {"type": kind, "params": dict(PARAMS[kind])}}
    return zero_core.initialize(model=make_net(seed), config=cfg)[0]


def _run(engine, seed: int, lo: int, hi: int) -> list:
    """Steps lo..hi-1 on this rank's rows of the seeded batches; flat weights after each."""
    import zero_core
    rt, out = zero_core.get_runtime(), []
    for step in range(lo, hi):
        ids, tgt = batch(seed, step, MICRO * rt.world_size)
        rows = slice(rt.rank * MICRO, (rt.rank + 1) * MICRO)
        engine.backward(loss_of(engine(ids[rows]), tgt[rows]))
        engine.step()
        out.append(engine.parts.buffers[0].param_buf.data.double().tolist())
    return out


def _errors(engine) -> float:
    return sum(float(t.abs().sum()) for c in engine.optimizer._error_compressors()
               for t in (c.worker_error, c.server_error))


def resume(seed: int, kind: str, directory: str) -> dict:
    """Train to RESUME[kind][1] steps saving at [0]; a fresh engine loads and trains the
    rest; controls: the same load with the errors zeroed (DeepSpeed's load) and, for 0/1
    Adam, with lrs zeroed (the old behaviour)."""
    save_at, total = RESUME[kind]
    a = _engine(seed, kind)
    _run(a, seed, 0, save_at)
    at_save = {"errors": _errors(a), "lrs": list(getattr(a.optimizer, "_lrs", []))}
    a.save_checkpoint(directory, tag=kind)
    # each rank's errors are in its own shard; common.pt (rank 0's) holds none of them
    tag_dir = os.path.join(directory, kind)
    with store.SafetensorsReader(os.path.join(tag_dir, store.shard_name(a.global_rank))) as r:
        at_save["rank_tensors"] = sorted(n for n in r.tensors if n.startswith("optim."))
    at_save["common_bytes"] = os.path.getsize(os.path.join(tag_dir, store.COMMON))
    at_save["error_bytes"] = sum(4 * t.numel() for c in a.optimizer._error_compressors()
                                 for t in (c.worker_error, c.server_error))
    out = {"at_save": at_save, "uninterrupted": _run(a, seed, save_at, total)}
    a.destroy()
    for name in ("resumed", "errors_zeroed", "lrs_zeroed"):
        if name == "lrs_zeroed" and kind != "ZeroOneAdam":
            continue
        b = _engine(seed, kind)
        b.load_checkpoint(directory, tag=kind)
        out.setdefault("loaded_errors", _errors(b))
        if name == "errors_zeroed":
            b.optimizer.reset_errors()
        if name == "lrs_zeroed":
            b.optimizer._lrs = [0.0] * len(b.optimizer._lrs)
        out[name] = _run(b, seed, save_at, total)
        b.destroy()
    return out


def load_elsewhere(seed: int, kind: str, directory: str) -> dict:
    """Load a checkpoint saved on another world size: errors zero, training goes on."""
    b = _engine(seed, kind)
    b.load_checkpoint(directory, tag=kind)
    out = {"loaded_errors": _errors(b), "steps": b.optimizer.steps_done}
    out["weights"] = _run(b, seed, RESUME[kind][0], RESUME[kind][0] + 2)
    b.destroy()
    return out


def main():
    from zero_core.runtime.context import get_runtime, init_distributed
    from zero_core.testing.ranks import leave_rank, report
    seed = int(sys.argv[1])
    init_distributed(accelerator="cpu")
    comm = get_runtime().comm
    head = {"rank": comm.rank, "world_size": comm.world_size, "comm": comm.name}
    if len(sys.argv) > 2 and sys.argv[2] == "resume":        # resume <dir>
        report({**head, "resume": {k: resume(seed, k, sys.argv[3]) for k in RESUME}})
    elif len(sys.argv) > 2 and sys.argv[2] == "load":        # load <dir> <kind>
        report({**head, "load": load_elsewhere(seed, sys.argv[4], sys.argv[3])})
    else:
        report({**head, "allreduce": check_allreduce(comm, seed),
                "train": {kind: train(seed, kind) for kind in STEPS}})
    leave_rank()


if __name__ == "__main__":
    main()
