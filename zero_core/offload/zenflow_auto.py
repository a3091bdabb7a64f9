"""ZenFlow's ``update_interval: "auto"``: when the host update is due, from the gradients'
mass (DeepSpeed's rule and its ``auto_ratio``); offload/zenflow.py asks it once per step after
the warm-up.

The rule, per step t of a window (u = 1, 2, ... steps since the last host update, this one
included), for every 2-D weight i (the weights ZenFlow selects columns of), with k =
``topk_ratio``, T_i = Σ|g_t| over the weight and C_i = Σ|g_t| over its selected columns
(both of the step's reduced gradient, as the optimizer steps it; summed over all ranks)::

    avg_i = (avg_i × (u - 1) + C_i) / u / (10 k)        # the selected columns' mass per step
    non_i = non_i + (T_i - C_i) / (10 (1 - k))          # the others' mass, accumulated
    weight i needs an update:  non_i >= avg_i

and the host update is due at step t when at least int(``auto_ratio`` × N) of the N 2-D
weights need one (so with int(``auto_ratio`` × N) = 0, every step; with N = 0, never, as in
DeepSpeed: every element is then stepped on the device). Both sides are per tenth
of the columns: the unselected columns' accumulated gradient has caught up with what the
selected columns get each step. After every host update (the rule's, a reselection's, or
one of ``full_warm_up_rounds``) the window restarts: non_i = 0, u = 1 on the next step. This
is DeepSpeed 0.19.8's arithmetic (runtime/zenflow/zenflow_stage_1_and_2.py, per micro-step),
held to its own recorded values in tests/test_zenflow.py (fixture
tests/fixtures/deepspeed_zenflow_auto.json, made by ci/tools/make_zenflow_auto_fixture.py).
For k = 0.1 (DeepSpeed's default) avg_i is the window's mean of C_i; for other k, the
(u - 1)-weighted previous value is divided by 10 k again each step, as in DeepSpeed.

When it fires: at step t itself, the step whose gradients made it due (that step's gradient
is in the window the host update applies). DeepSpeed 0.19.8, run on this machine, does not
do this, and does nothing usable instead (config/zenflow_section.py's docstring says what
its run showed and why zero-core keeps the rule's intent). Differences that remain: the
sums here are fp32 and the comparison float64 (DeepSpeed holds T_i and non_i in bf16);
N counts the 2-D weights (DeepSpeed counts every parameter that is not 1-D, also those it
never tests, so a model with 3-D+ weights can miss the threshold there).

Checkpoints: non_i and avg_i (equal on every rank) go into ``common.pt`` with ZenFlow's
counters; u is ZenFlow's window count, already there. A resumed run decides as the
uninterrupted one, bit for bit (tests/test_zenflow.py).
"""
from __future__ import annotations

import torch

from zero_core.errors import ZeroCoreError


class AutoInterval:
    """The rule of the module docstring for one ZenFlow optimizer (*opt*, whose buffers,
    selection and communicator it reads). :meth:`observe` is collective (one all-reduce of
    2 × N fp32 values per step on 2+ ranks) and waits for the device (the decision is read
    on the host)."""

    def __init__(self, opt, topk_ratio: float, auto_ratio: float):
        self.opt, self.k, self.ratio = opt, float(topk_ratio), float(auto_ratio)
        # (j, param index) of every 2-D weight, in group order
        self.weights = [(j, i) for j, gb in enumerate(opt.buffers) if gb is not None
                        for i, p in enumerate(gb.params) if p.dim() == 2]
        self.threshold = int(self.ratio * len(self.weights))
        self.non = [0.0] * len(self.weights)
        self.avg = [0.0] * len(self.weights)
        self._pieces: dict = {}   # (j, k) -> [(local lo, numel, weight number or None)]
        self._owner: dict = {}    # (j, k) -> (the selection's index tensor, its weights)

    # ---- the rule ------------------------------------------------------------------------------
    def decide(self, u: int, totals, critics) -> bool:
        """One step of the rule on host floats (u: the step's place in its window, 1-based)."""
        k, need = self.k, 0
        for i, (t_i, c_i) in enumerate(zip(totals, critics)):
            self.avg[i] = (self.avg[i] * (u - 1) + c_i) / u / (k * 10)
            self.non[i] += (t_i - c_i) / ((1 - k) * 10)
            need += self.non[i] >= self.avg[i]
        return need >= self.threshold

    def restart(self) -> None:
        """A host update ran: the next step opens a window."""
        self.non = [0.0] * len(self.weights)

    def observe(self, u: int) -> bool:
        """This step's sums from the optimizer's reduced gradients and selection, then
        :meth:`decide`. Never due without a 2-D weight (every element is on the device)."""
        if not self.weights:
            return False
        totals, critics = self.sums()
        return self.decide(u, totals, critics)

    # ---- the sums ------------------------------------------------------------------------------
    def sums(self) -> tuple[list[float], list[float]]:
        """T_i and C_i of every 2-D weight over all ranks, × the step's ``grad_factor``."""
        opt, n = self.opt, len(self.weights)
        out = torch.zeros(2 * n + 1, dtype=torch.float32, device=opt.device)   # + a dump slot
        world = 1
        for j, gb in enumerate(opt.buffers):
            if gb is None:
                continue
            world = gb.world_size
            for kb in range(gb.num_buckets):
                key = (j, kb)
                grad = opt._shard_grad(j, kb)
                for lo, numel, w in self._bucket_pieces(key):
                    if w is not None:
                        out[w] += grad.narrow(0, lo, numel).to(torch.float32).abs().sum()
                if key in opt._idx:
                    idx, owner = self._selected_owner(key)
                    sel = grad.index_select(0, idx).to(torch.float32).abs()
                    out.index_add_(0, owner, sel)
        if world > 1:
            opt.comm.all_reduce(out, "sum")
        vals = (out[:2 * n] * opt.grad_factor).tolist()
        return vals[:n], vals[n:]

    def _bucket_pieces(self, key):
        if key not in self._pieces:
            j, kb = key
            gb, number = self.opt.buffers[j], {w: m for m, w in enumerate(self.weights)}
            lay = gb.layout
            lo = lay.shard_start(kb, self.opt.rank)
            hi = lo + lay.shard_size(kb)
            pieces = []
            for i, (start, numel) in enumerate(zip(lay.offsets, lay.numels)):
                a, b = max(lo, start), min(hi, start + numel)
                if a < b:
                    pieces.append((a - lo, b - a, number.get((j, i))))
            self._pieces[key] = pieces
        return self._pieces[key]

    def _selected_owner(self, key):
        """The selection's indices into shard *key* and, for each, the slot of ``sums``'
        vector its |g| goes to (N + weight number; 2N: not a 2-D weight)."""
        idx = self.opt._idx[key]
        cached = self._owner.get(key)
        if cached is None or cached[0] is not idx:
            n = len(self.weights)
            starts, slots = [], []
            for lo, _, w in self._bucket_pieces(key):
                starts.append(lo)
                slots.append(2 * n if w is None else n + w)
            starts_t = torch.tensor(starts, dtype=idx.dtype, device=idx.device)
            slots_t = torch.tensor(slots, dtype=torch.int64, device=idx.device)
            piece = torch.bucketize(idx, starts_t, right=True) - 1
            self._owner[key] = cached = (idx, slots_t[piece])
        return cached

    # ---- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict:
        return {"non": list(self.non), "avg": list(self.avg)}

    def load(self, state: dict | None) -> None:
        if state is None:   # saved by a fixed-interval ZenFlow run: open a fresh window
            self.restart()
            self.avg = [0.0] * len(self.weights)
            return
        if len(state["non"]) != len(self.weights):
            raise ZeroCoreError(f"the checkpoint's ZenFlow auto state has {len(state['non'])} "
                             f"2-D weights, the model {len(self.weights)}")
        self.non, self.avg = [float(v) for v in state["non"]], [float(v) for v in state["avg"]]
