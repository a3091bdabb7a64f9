"""Optimizer-path helpers for tests/test_lamb.py and tests/test_bf16_master.py, and their
multi-rank worker.

Importable (``from workers.optim_train import ...``):

* independent references: :func:`ref_lamb_step` (DeepSpeed's FusedLamb on whole
  parameters, float64) and :func:`ref_adamw_bf16_step` (AdamW with bf16 storage of
  master weights and, optionally, states; fp32 arithmetic);
* a world of N simulated ranks in one process (:class:`ThreadComm`, one thread per rank,
  exchanging real data), with :func:`build_group` / :func:`run_world`, so that
  :class:`~zero_core.optim.partitioned.PartitionedOptimizer` can be stepped at every stage
  on exactly known gradients, with parameters straddling buckets and rank slices.

As a script (``python optim_train.py <scenario>[,...]`` on every rank): trains a small
model with the real engine and a float64 reference on the same global batches and reports
the differences (see :data:`SCENARIOS`).
"""
from __future__ import annotations

import math
import os
import sys
import threading

import torch

from zero_core.interfaces.communicator import Communicator, Group, Handle
from zero_core.runtime.launch import LaunchInfo
from zero_core.runtime.topology import Topology


# ---- references -------------------------------------------------------------------------------
def ref_lamb_step(params: list, grads: list, state: dict, *, lr, betas, eps, weight_decay,
                  bias_correction, max_coeff, min_coeff, step, state_dtype=None) -> list[float]:
    """One FusedLamb step on whole parameters (DeepSpeed's csrc/lamb/fused_lamb_cuda_kernel.cu):
    moments from the raw gradient, update u = m / (sqrt(v) + eps) + wd * w from the raw
    (not bias-corrected) moments, trust ratio ||w|| / ||u|| clamped to [min_coeff,
    max_coeff] (1 when either norm is 0), w -= step_size * ratio * u with the bias
    correction folded into step_size. *params* are updated in place: float64 tensors are
    stepped in float64; bf16 ones are read into fp32, stepped in fp32 and stored back
    rounded, and so are the moments when *state_dtype* is bf16 (u is then computed from the
    moments as stored). Returns the ratios."""
    b1, b2 = betas
    step_size = lr * math.sqrt(1 - b2 ** step) / (1 - b1 ** step) if bias_correction else lr
    ratios = []
    for i, (p, g) in enumerate(zip(params, grads)):
        calc = torch.float64 if p.dtype == torch.float64 else torch.float32
        kept = state_dtype or (calc if p.dtype != torch.bfloat16 else torch.float32)
        m_st = state.setdefault(("m", i), torch.zeros(p.shape, dtype=kept))
        v_st = state.setdefault(("v", i), torch.zeros(p.shape, dtype=kept))
        w, g = p.to(calc), g.to(calc)
        m = m_st.to(calc).mul_(b1).add_((1 - b1) * g)
        v = v_st.to(calc).mul_(b2).add_((1 - b2) * g * g)
        m_st.copy_(m)
        v_st.copy_(v)
        m, v = m_st.to(calc), v_st.to(calc)
        u = m / (v.sqrt() + eps)
        u.add_(w, alpha=weight_decay)
        wn, un = float(w.double().norm()), float(u.double().norm())
        ratio = 1.0 if wn == 0 or un == 0 else max(min(wn / un, max_coeff), min_coeff)
        p.copy_(w.add(u * ratio, alpha=-step_size))
        ratios.append(ratio)
    return ratios


def ref_adamw_bf16_step(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                        lr, betas, eps, weight_decay, step) -> None:
    """AdamW on bf16-stored master *w* (and states *m*, *v*, bf16 or fp32): each value is
    read into fp32, the step is computed in fp32 (torch.optim.AdamW's formula), and the
    results are stored back rounded to nearest even. *g*: the fp32 gradient."""
    b1, b2 = betas
    w32, m32, v32 = w.float(), m.float(), v.float()
    w32.mul_(1 - lr * weight_decay)
    m32.lerp_(g, 1 - b1)
    v32.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v32.sqrt() / math.sqrt(1 - b2 ** step)).add_(eps)
    w32.addcdiv_(m32, denom, value=-lr / (1 - b1 ** step))
    w.copy_(w32)
    m.copy_(m32)
    v.copy_(v32)


# ---- N ranks in one process ---------------------------------------------------------------------
class _Rendezvous:
    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list = [None] * n


class ThreadComm(Communicator):
    """Rank *rank* of an in-process world whose ranks are threads sharing *rdv*. Collectives
    move real data (sums in rank order, so every rank gets the same bits) and complete
    before returning; the base class checks arguments and keeps the ledger."""

    name = "threads"

    @classmethod
    def availability(cls):
        return True, ""

    def __init__(self, rdv: _Rendezvous, rank: int):
        self.rdv = rdv
        super().__init__(LaunchInfo(rank, rdv.n, rank, rdv.n, "torchrun"), Topology(rdv.n, rdv.n))

    def _init_world(self):
        return Group("world", tuple(range(self.world_size)), self.rank, False)

    def _new_group(self, ranks, name):
        raise NotImplementedError("the thread world has only the world group")

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.rdv.slots[self.rank] = t.detach().clone()
        self.rdv.barrier.wait()
        got = list(self.rdv.slots)
        self.rdv.barrier.wait()
        return got

    def _done(self, op, group):
        return Handle(op, group, self.timeout, wait_fn=lambda t: True)

    def _all_reduce(self, tensor, op, group):
        parts = self._exchange(tensor)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        tensor.copy_(total)
        return self._done("all_reduce", group)

    def _all_gather_into(self, output, input, group):
        output.copy_(torch.cat(self._exchange(input)))
        return self._done("all_gather_into", group)

    def _reduce_scatter(self, output, input, op, group):
        raise NotImplementedError

    def _all_to_all_single(self, output, input, group):
        raise NotImplementedError

    def _broadcast(self, tensor, src, group):
        raise NotImplementedError

    def _barrier(self, group):
        self.rdv.barrier.wait()
        return self._done("barrier", group)


def run_world(n: int, fn) -> list:
    """``fn(comm)`` on *n* thread-ranks; returns their results in rank order (re-raises the
    first failure)."""
    rdv = _Rendezvous(n)
    results, errors = [None] * n, []

    def body(r):
        try:
            results[r] = fn(ThreadComm(rdv, r))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            rdv.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def build_group(stage: int, rank: int, n: int, values: list[torch.Tensor], dtype: torch.dtype,
                bucket: int, ledger, master_dtype=torch.float32, units_of=None):
    """The flat buffers one rank of *n* holds for parameters of initial *values* (fp32):
    ``GroupBuffers`` at stages 0-2 (buckets of *bucket* elements), ``Stage3GroupBuffers``
    at stage 3 (one fetch unit per list of indices in *units_of*)."""
    from zero_core.stage0to2.buffers import GroupBuffers
    from zero_core.stage3.buffers import Stage3GroupBuffers
    from zero_core.stage3.units import FetchUnit

    params = [torch.nn.Parameter(v.clone().to(dtype)) for v in values]
    if stage < 3:
        return GroupBuffers(params, stage, dtype, torch.device("cpu"), rank, n, bucket, ledger,
                            [v.clone() for v in values], master_dtype=master_dtype)
    units = []
    for k, idx in enumerate(units_of):
        u = FetchUnit(index=k, group=0, persistent=False)
        for i in idx:
            u.add(params[i], f"p{i}")
        units.append(u)

    def full_values(u):
        flat = torch.zeros(u.padded_numel)
        for p, off in zip(u.params, u.offsets):
            i = next(j for j, q in enumerate(params) if q is p)
            flat.narrow(0, off, p.numel()).copy_(values[i].reshape(-1))
        return flat

    return Stage3GroupBuffers(units, True, dtype, torch.device("cpu"), rank, n, ledger,
                              full_values, master_dtype=master_dtype)


def set_reduced_grads(gb, grads: list[torch.Tensor]) -> None:
    """Write the reduced gradient *grads* (fp32, one per parameter in layout order) into the
    buckets this rank's optimizer reads, as the reducer would have left them."""
    lay = gb.layout
    full = torch.zeros(lay.padded_numel)
    for i, g in enumerate(grads):
        full.narrow(0, lay.offsets[i], lay.numels[i]).copy_(g.reshape(-1))
    for k in range(lay.num_buckets):
        if gb.state_kind == "full":
            src = full.narrow(0, lay.bucket_starts[k], lay.bucket_sizes[k])
        else:
            src = full.narrow(0, lay.shard_start(k, gb.rank), lay.shard_size(k))
        gb.reduced_grad_bucket(k).copy_(src)


def assemble(gb_of_ranks: list, which: str) -> list[torch.Tensor]:
    """Every parameter's full values (flattened, fp32) from the ranks' buffers: *which* is
    "param" (``param_buf``) or "master"; partition buffers are put together from every
    rank's slices."""
    gb0 = gb_of_ranks[0]
    lay = gb0.layout
    bufs = [getattr(gb, "param_buf" if which == "param" else "master") for gb in gb_of_ranks]
    if bufs[0].kind == "full":
        full = bufs[0].data.float()
    else:
        full = torch.cat([torch.cat([b.bucket(k).float() for b in bufs])
                          for k in range(lay.num_buckets)])
    return [full.narrow(0, lay.offsets[i], lay.numels[i]).clone() for i in range(len(lay.numels))]


# ---- the multi-rank worker (engine on real ranks) --------------------------------------------------
VOCAB, DIM, SEQ, MICRO = 32, 16, 6, 2
LAMB = {"lr": 2e-2, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.01,
        "bias_correction": True, "max_coeff": 10.0, "min_coeff": 0.01}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.l1 = torch.nn.Linear(DIM, 24)
        self.ln = torch.nn.LayerNorm(24)
        self.l2 = torch.nn.Linear(24, VOCAB)

    def forward(self, ids):
        return self.l2(torch.tanh(self.ln(self.l1(self.emb(ids)))))


def make_net(seed: int, dtype=torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def batch(seed: int, step: int, n: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def loss_of(logits, tgt):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                             tgt.to(logits.device).reshape(-1))


def train_lamb(stage: int, steps: int = 4, seed: int = 11, bucket: int = 100, **cfg_extra) -> dict:
    """The engine with the config's Lamb against :func:`ref_lamb_step` on a float64 copy
    of the model (same global batches; fp32 training)."""
    import zero_core
    rt = zero_core.get_runtime()
    model, ref = make_net(seed), make_net(seed, torch.float64)
    params = {k: v for k, v in LAMB.items()}
    cfg = {"train_micro_batch_size_per_gpu": MICRO,
           "gradient_clipping": 0.0,   # the reference steps unclipped
           "optimizer": {"type": "Lamb", "params": {**params, "betas": list(params["betas"])}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                 "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": bucket}, **cfg_extra}
    engine, opt, _, _ = zero_core.initialize(model=model, config=cfg)
    state, n = {}, MICRO * rt.world_size
    names = [n_ for n_, _ in ref.named_parameters()]
    worst, ratio_diff = 0.0, 0.0
    for step in range(steps):
        ids, tgt = batch(seed, step, n)
        rows = slice(rt.rank * MICRO, (rt.rank + 1) * MICRO)
        engine.backward(loss_of(engine(ids[rows]), tgt[rows]))
        engine.step()
        ref.zero_grad()
        loss_of(ref(ids), tgt).backward()
        with torch.no_grad():
            ratios = ref_lamb_step([p for p in ref.parameters()],
                                   [p.grad for p in ref.parameters()], state, step=step + 1,
                                   **LAMB)
        mine = opt.get_lamb_coeffs()   # param_groups order: here the module's
        assert len(mine) == len(ratios)
        ratio_diff = max([ratio_diff] + [abs(a - r) / r for a, r in zip(mine, ratios)])
    with _gathered(engine):
        for (nm, p), q in zip(model.named_parameters(), ref.parameters()):
            err = float((p.detach().double().cpu() - q.detach()).abs().max() / q.detach().abs().max())
            worst = max(worst, err)
    comm = engine.comm_report()
    engine.destroy()
    return {"rel_diff": worst, "ratio_rel_diff": ratio_diff,
            "all_reduce_calls": comm["ops"].get("all_reduce", {}).get("calls", 0),
            "all_reduce_bytes": comm["ops"].get("all_reduce", {}).get("payload_bytes", 0),
            "num_params": len(names)}


def _gathered(engine):
    import contextlib
    import zero_core
    if engine.stage == 3:
        return zero_core.GatheredParameters(list(engine.module.parameters()))
    return contextlib.nullcontext()


def bf16_config(stage: int, states: bool = True, opt: str = "AdamW", bucket: int = 100) -> dict:
    """bf16 training with bf16 master weights (and, with *states*, bf16 optimizer states)."""
    return {"train_micro_batch_size_per_gpu": MICRO,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                     "bf16_optimizer_states": states},
            "optimizer": {"type": opt, "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                  "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": bucket}}


def fragments_report(engine) -> list:
    """What this rank saves: [name, start, end, {key: [dtype, values]}] per fragment."""
    return [[f.name, f.start, f.end,
             {k: [str(t.dtype), t.float().tolist()] for k, t in f.tensors.items()}]
            for f in engine.checkpoint_subject().fragments("save")]


def bf16_checkpoint(stage: int = 2, steps: int = 3, seed: int = 5) -> dict:
    """Train with bf16 master weights and states, save a checkpoint into
    $ZERO_CORE_TEST_CKPT_DIR; report the saved fragments and the memory report."""
    import zero_core
    rt = zero_core.get_runtime()
    model = make_net(seed)
    engine, _, _, _ = zero_core.initialize(model=model, config=bf16_config(stage))
    for step in range(steps):
        ids, tgt = batch(seed, step, MICRO * rt.world_size)
        rows = slice(rt.rank * MICRO, (rt.rank + 1) * MICRO)
        engine.backward(loss_of(engine(ids[rows]), tgt[rows]))
        engine.step()
    engine.save_checkpoint(os.environ["ZERO_CORE_TEST_CKPT_DIR"], tag="bf16")
    out = {"fragments": fragments_report(engine), "memory": engine.memory_report()}
    engine.destroy()
    return out


SCENARIOS = {
    "lamb1": lambda: train_lamb(1),
    "lamb2": lambda: train_lamb(2),
    "lamb3": lambda: train_lamb(3),
    "bf16ckpt": bf16_checkpoint,
}

def main():
    from zero_core.testing.ranks import leave_rank, report
    report({name: SCENARIOS[name]() for name in sys.argv[1].split(",")})
    leave_rank()


if __name__ == "__main__":
    main()
