"""DeepSpeed's 1-bit Adam (config ``optimizer.type: "OneBitAdam"``): Adam whose gradient
all-reduce is replaced, after a warm-up, by an error-compensated 1-bit all-reduce of the
momentum (optim/compressed_allreduce.py); and its successor 0/1 Adam (``"ZeroOneAdam"``,
:class:`ZeroOneAdam`: 1-bit gradients between exponentially rarer variance updates, then
local steps synchronized by the 1-bit all-reduce). For data parallelism on slow links.

DeepSpeed runs them without ZeRO partitioning (its engine asserts "1bit-Adam is not
compatible with ZeRO", "0/1 Adam is not compatible with ZeRO"), in fp32 or fp16; here they are
stage 0 (fp32, fp16 or bf16 compute, fp32 master and states), and stages 1-3 are refused by
name at ``initialize``. 1-bit LAMB (``"OneBitLamb"``, :class:`OneBitLamb`): Lamb's warm-up,
then the momentum through the 1-bit all-reduce with the Lamb coefficients frozen and rescaled.

The update (DeepSpeed's ``OnebitAdam.step``: raw moments, no bias correction, decay
added to the update):

    warm-up, steps 1..freeze_step: the engine all-reduces (averages) gradients as for Adam;
        m <- b1 m + (1 - b1) g,  v <- b2 v + (1 - b2) g^2
    compressed, later steps: no gradient all-reduce; with this rank's own gradient g_r,
        m <- b1 m + (1 - b1) g_r,  m <- compressed_average(m)   (v is frozen)
    both: w <- w - lr (m / (sqrt(v) + eps) + weight_decay w)

The switch needs two hooks in the engine, both here: :func:`gate_reduction` wraps the
stage-0 reducer's "reduce at this backward?" so that the backward of a compressed step keeps
its gradients local, and :attr:`_OneBitBase.local_gradients` tells the step's one
all-reduce (engine/update.py) to sum the squared norms of the ranks' different gradients, so
that overflow, skipping and clipping agree across ranks. The norm reported
(``get_global_grad_norm``) in the compressed phase is therefore sqrt(Σ_r ||g_r||^2) / N, not
the norm of an average that is never formed.

Differences from DeepSpeed, on purpose: DeepSpeed's first ``step()`` call only sets up its
buffers and discards that step's gradient; here the first step is a real step (the phase
boundaries are at the same step numbers, counting DeepSpeed's set-up call as step 1; so 1-bit
LAMB's frozen coefficient averages freeze_step coefficients, not freeze_step - 1). On a
single rank, 0/1 Adam's 1-bit gradient steps leave the momentum as it is, as DeepSpeed's do
(its ``if self.size > 1`` holds the compression and the momentum update; the weights still
move with the old momentum). ``exp_avg_mask`` (a parameter-group key DeepSpeed's optimizers
read) is not supported.

Checkpoints (DeepSpeed's ``load_state_dict`` drops the errors and 0/1 Adam's lrs; here they
resume): ``common.pt``'s ``optimizer.extra["onebit"]`` holds the rank-identical counters (0/1
Adam's lrs, 1-bit LAMB's coefficients and scaling); every rank's own state — its worker
and server errors, and in 0/1 Adam's local-step phase its own weights, momentum and
accumulator (the shards hold a mixture of the ranks' chunks there) — goes into that rank's
own shard (:meth:`_OneBitBase.rank_checkpoint_tensors`; about 1.3x the model's fp32 size
per rank, 4x in the local phase), so no file grows with the world size. Same world size:
restored, train N, save, train M equals load, train M bit for bit (tests/test_onebit.py);
another: the chunks no longer map, the errors restart from zero with a warning.
"""
from __future__ import annotations

import logging
import math

import torch

from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.optim.compressed_allreduce import CompressedAllReduce
from zero_core.optim.partitioned import PartitionedOptimizer

log = logging.getLogger("zero_core.optim")

#: update-rule kinds (optim/rules.py) this module runs
ONEBIT_KINDS = ("onebit_adam", "zero_one_adam", "onebit_lamb")


def optimizer_class(rule) -> type:
    """The optimizer class the engine builds for *rule*."""
    return {"onebit_adam": OneBitAdam, "zero_one_adam": ZeroOneAdam,
            "onebit_lamb": OneBitLamb}.get(rule.kind, PartitionedOptimizer)


def gate_reduction(optimizer, is_boundary):
    """What the stage reducer asks before a backward ("reduce at this one?"): a 1-bit
    optimizer in its compressed phase keeps the gradients local."""
    if not isinstance(optimizer, _OneBitBase):
        return is_boundary
    return lambda: is_boundary() and not optimizer.local_gradients


class _OneBitBase(PartitionedOptimizer):
    """What the 1-bit optimizers share: stage 0's whole buffers in fp32, one
    :class:`CompressedAllReduce` per group (its errors), the host deciding each step, and
    the engine's two questions (:attr:`local_gradients`)."""

    NAME = ""
    #: one compressor per group, per parameter scales (1-bit LAMB compresses all at once)
    PER_GROUP_COMPRESSION = True

    def __init__(self, hyper_groups, rule, buffers, kernels, comm, ledger, zero_grad_fn,
                 max_inflight: int = 4, state_dtype: torch.dtype = torch.float32):
        present = [gb for gb in buffers if gb is not None]
        if any(gb.state_kind != "full" for gb in present):
            raise ConfigError(
                f"optimizer.type '{self.NAME}' runs without ZeRO partitioning, as in DeepSpeed "
                f"(\"{self.DS_NAME} is not compatible with ZeRO\"): set zero_optimization.stage "
                f"to 0, or use Adam/AdamW at stages 1-3")
        narrow = state_dtype != torch.float32 or any(
            gb.master is not None and gb.master.dtype != torch.float32 for gb in present)
        if narrow:
            raise ConfigError(
                f"optimizer.type '{self.NAME}' keeps fp32 master weights and states: turn "
                f"bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states off")
        super().__init__(hyper_groups, rule, buffers, kernels, comm, ledger, zero_grad_fn,
                         max_inflight, state_dtype)
        self.world_size = comm.world_size
        self._compressors: list[CompressedAllReduce | None] = []
        for gb in buffers:
            if gb is None or self.world_size == 1 or not self.PER_GROUP_COMPRESSION:
                self._compressors.append(None)
                continue
            self._compressors.append(CompressedAllReduce(
                comm, list(gb.layout.numels), gb.param_buf.data.device,
                on_allocate=lambda t: ledger.track("optimizer_states", t)))
        wanted, actual = self.param_groups[0]["comm_backend_name"], getattr(comm, "name", "")
        if wanted not in (None, "compressed", actual) and comm.rank == 0:
            # DeepSpeed's key picks the transport of its 1-bit all-reduce; here it runs over
            # the engine's communicator (config "comm_backend", ZERO_CORE_COMM)
            log.warning("optimizer.params.comm_backend_name=%r: the 1-bit all-reduce runs over "
                        "the engine's communicator, %r; select the transport with the "
                        "config's \"comm_backend\" (or ZERO_CORE_COMM)", wanted, actual)

    @property
    def skips_on_device(self) -> bool:
        return False   # the host decides whether to step (one read of the verdict)

    @property
    def steps_done(self) -> int:
        return max(self.step_counts, default=0)

    @property
    def local_gradients(self) -> bool:
        """The next step's gradients stay local (not all-reduced); several ranks only."""
        return self.world_size > 1 and not self._next_step_reduces()

    def _next_step_reduces(self) -> bool:
        raise NotImplementedError

    def reset_errors(self) -> None:
        """Zero the worker and server errors."""
        for c in self._error_compressors():
            c.reset_errors()

    def _error_compressors(self) -> list[CompressedAllReduce]:
        return [c for c in self._compressors if c is not None]

    # ---- checkpoint (module docstring) -----------------------------------------------------
    def _counters(self) -> dict:   # rank-identical counters for common.pt
        return {}

    def _restore_counters(self, saved: dict) -> None:
        """From :meth:`_counters`' dict (empty: an older checkpoint)."""

    def _rank_state(self) -> list[torch.Tensor]:
        """What differs between the ranks: the worker and server errors."""
        return [t for c in self._error_compressors() for t in (c.worker_error, c.server_error)]

    def rank_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's :meth:`_rank_state`, for its own shard of a checkpoint."""
        return {f"onebit.{i}": t for i, t in enumerate(self._rank_state())}

    def checkpoint_extra(self) -> dict:
        """Rank 0, into ``common.pt``: the rank-identical counters."""
        return {"onebit": {"kind": self.NAME, "world_size": self.world_size,
                           **self._counters()}}

    def load_checkpoint_extra(self, extra) -> None:
        """Every rank, after a load with optimizer states: the counters."""
        saved = (extra or {}).get("onebit") or {}
        self._saved = (saved.get("kind"), saved.get("world_size"))
        self._restore_counters(saved)

    def load_rank_checkpoint_tensors(self, tensors) -> None:
        """This rank's state when saved on this world size (else zero errors, a warning)."""
        bufs = self._rank_state()
        if not bufs or self.world_size == 1:
            return
        mine = [(tensors or {}).get(f"onebit.{i}") for i in range(len(bufs))]
        kind, saved_on = self._saved
        why = ("the checkpoint holds no 1-bit error feedback (saved by another optimizer)"
               if kind is None else
               f"it was saved on {saved_on} ranks and is loaded on {self.world_size}: each "
               f"rank's worker and server errors belong to its chunks of the 1-bit "
               f"all-reduce, which no longer map" if tensors is None else
               "its per-rank state has another size"
               if any(t is None or t.numel() != b.numel() for t, b in zip(mine, bufs))
               else None)
        if why is not None:
            self.reset_errors()
            if self.comm.rank == 0:
                log.warning("%s: %s; the worker and server errors restart from zero (as "
                            "DeepSpeed's load does), so the next steps differ from an "
                            "uninterrupted run", self.NAME, why)
            return
        torch._foreach_copy_(bufs, [t.view_as(b) for t, b in zip(mine, bufs)])
        for gb in filter(None, self.buffers):
            self._publish(gb)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ZeroCoreError(f"{self.NAME}.step() takes no closure: the engine computes "
                                f"gradients with engine.backward(loss)")
        local = self.local_gradients
        t = self.steps_done + 1
        for j, gb in enumerate(self.buffers):
            if gb is None:
                continue
            self.step_counts[j] += 1
            self._step_group(j, gb, t, self._gradient(gb, local))
        self._after_step(t)

    def _after_step(self, t: int) -> None:
        pass

    def _gradient(self, gb, local: bool) -> torch.Tensor:
        """The group's gradient in fp32 (the whole buffer, padding included), unscaled and
        clipped; with *local*, this rank's own gradient (the buffers hold it pre-divided for
        an averaging sum, engine/core.py: the compressed all-reduce averages itself)."""
        g = gb.grad_buf.data
        f = float(self.grad_factor) * (self.world_size if local else 1)
        g = g.float() if g.dtype != torch.float32 else g   # fp32: the buffer, zeroed after
        if f != 1.0:
            g.mul_(f)
        return g

    def _compress(self, j: int, gb, flat: torch.Tensor) -> None:
        """Replace *flat* (a whole-buffer fp32 tensor) by its compressed average over the
        ranks, parameter by parameter (padding untouched)."""
        lay = gb.layout
        self._compressors[j]([flat.narrow(0, off, k) for off, k in zip(lay.offsets,
                                                                         lay.numels)])

    @staticmethod
    def _adam_update(w, m, v, eps: float, wd: float) -> torch.Tensor:
        """DeepSpeed's 1-bit update ``m / (sqrt(v) + eps) + wd w`` (a new tensor)."""
        update = v.sqrt().add_(eps)
        torch.div(m, update, out=update)
        if wd != 0.0:
            update.add_(w, alpha=wd)
        return update

    @staticmethod
    def _master(gb) -> torch.Tensor:
        return gb.master.data if gb.master is not None else gb.param_buf.data

    @staticmethod
    def _publish(gb) -> None:
        """The new master values into the low-precision parameters (mixed precision)."""
        if gb.master is not None:
            gb.param_buf.data.copy_(gb.master.data)


class OneBitAdam(_OneBitBase):
    """1-bit Adam over stage 0's flat buffers (module docstring)."""

    NAME, DS_NAME = "OneBitAdam", "1bit-Adam"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.freeze_step = int(self.param_groups[0]["freeze_step"])

    @property
    def compressing(self) -> bool:
        """The next step is a compressed one (the warm-up's freeze_step steps are done)."""
        return self.steps_done >= self.freeze_step

    def _next_step_reduces(self) -> bool:
        return not self.compressing

    def _step_group(self, j: int, gb, t: int, g: torch.Tensor) -> None:
        hp = self.param_groups[j]
        beta1, beta2 = (float(b) for b in hp["betas"])
        frozen = t > self.freeze_step      # the variance stays; one rank has nothing to send
        if frozen and t == self.freeze_step + 1 and j == 0:
            log.info("OneBitAdam: step %d, frozen variance and compressed communication "
                     "from now on", t)
        st = self.flat_state[j]
        m, v = st["exp_avg"].data, st["exp_avg_sq"].data
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        if frozen and self._compressors[j] is not None:
            self._compress(j, gb, m)
        if not frozen:
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        w = self._master(gb)
        w.sub_(self._adam_update(w, m, v, float(hp["eps"]), float(hp["weight_decay"])),
               alpha=float(hp["lr"]))
        self._publish(gb)


class ZeroOneAdam(_OneBitBase):
    """0/1 Adam (DeepSpeed's ``ZeroOneAdam``, arXiv 2202.06009) over stage 0's flat buffers.

    Before ``var_freeze_step``: a step t with t % var_interval == 0 all-reduces the gradient
    and updates both moments; any other step sends the gradient through the 1-bit all-reduce
    and updates the momentum only. var_interval doubles each time ``var_update_scaler`` such
    full steps have passed. After it (variance frozen, errors reset once): no gradient
    communication at all; every step is a local Adam step with the rank's own gradient,
    whose updates are summed in the momentum accumulator u (with the learning rates, lrs);
    every ``local_step_interval``-th step undoes the local updates, averages
    u·(sqrt(v) + eps) with the 1-bit all-reduce, sets m = -u/lrs and applies u/(sqrt(v) +
    eps) instead. local_step_interval doubles every ``local_step_scaler`` frozen steps, up to
    ``local_step_clipper``.

    The counters are functions of the step count and recomputed from it after a checkpoint
    load; lrs, the learning rates summed since the last synchronization, is checkpointed
    (``common.pt``) beside the momentum accumulator, so a save mid-interval resumes exactly."""

    NAME, DS_NAME = "ZeroOneAdam", "0/1 Adam"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        hp = self.param_groups[0]
        self.var_freeze_step = int(hp["var_freeze_step"])
        self.var_update_scaler = int(hp["var_update_scaler"])
        self.local_step_scaler = int(hp["local_step_scaler"])
        self.local_step_clipper = int(hp["local_step_clipper"])
        self._lrs = [0.0] * len(self.buffers)
        self._replay(0)

    # ---- the schedule: which steps communicate how --------------------------------------
    def _replay(self, steps: int) -> None:
        """The counters after *steps* steps (from scratch: at start and after a load)."""
        self.var_interval, self.var_counter = 1, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        self.frozen = False
        self._counted = 0
        for t in range(1, steps + 1):
            self._advance(t)

    def _advance(self, t: int) -> None:
        """Move the counters past step *t* (DeepSpeed's order: after the update)."""
        if not self.frozen:
            # t > 1: DeepSpeed's step 1 is its set-up call, which counts no variance update
            if t % self.var_interval == 0 and t > 1:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
        else:
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper,
                                               self.local_step_interval * 2)
        if t > self.var_freeze_step and not self.frozen:
            self.frozen = True
            self.reset_errors()   # from now on they carry another quantity (u, not g)
        self._counted = t

    def _counters(self) -> dict:
        return {"lrs": [float(x) for x in self._lrs]}

    def _rank_state(self) -> list[torch.Tensor]:
        """Local steps (frozen phase): each rank's weights, momentum and accumulator too."""
        own = [t for j, gb in enumerate(self.buffers) if gb is not None and self.frozen
               for t in (self._master(gb), self.flat_state[j]["exp_avg"].data,
                         self.flat_state[j]["momentum_accumulator"].data)]
        return super()._rank_state() + own

    def _restore_counters(self, saved: dict) -> None:
        self._replay(self.steps_done)
        lrs = saved.get("lrs")
        ok = isinstance(lrs, list) and len(lrs) == len(self._lrs)
        self._lrs = [float(x) for x in lrs] if ok else [0.0] * len(self.buffers)

    def _in_step(self) -> None:
        if self._counted != self.steps_done:   # a checkpoint load moved the step count
            self._replay(self.steps_done)
            self._lrs = [0.0] * len(self.buffers)

    def _next_step_reduces(self) -> bool:
        self._in_step()
        return not self.frozen and (self.steps_done + 1) % self.var_interval == 0

    # ---- the update ---------------------------------------------------------------------
    def step(self, closure=None):
        self._in_step()
        super().step(closure)

    def _after_step(self, t: int) -> None:
        self._advance(t)

    def _step_group(self, j: int, gb, t: int, g: torch.Tensor) -> None:
        hp = self.param_groups[j]
        beta1, beta2 = (float(b) for b in hp["betas"])
        lr, eps, wd = float(hp["lr"]), float(hp["eps"]), float(hp["weight_decay"])
        st = self.flat_state[j]
        m, v = st["exp_avg"].data, st["exp_avg_sq"].data
        u = st["momentum_accumulator"].data
        w = self._master(gb)
        several = self._compressors[j] is not None
        if not self.frozen:
            if t % self.var_interval == 0:        # the engine all-reduced g
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                m.mul_(beta1).add_(g, alpha=1.0 - beta1)
            elif several:                         # g is this rank's: 1 bit per element
                self._compress(j, gb, g)
                m.mul_(beta1).add_(g, alpha=1.0 - beta1)
            # one rank, a 1-bit step: DeepSpeed leaves m as it is (nothing to compress)
            w.sub_(self._adam_update(w, m, v, eps, wd), alpha=lr)
            self._publish(gb)
            return
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)   # a local step, this rank's gradient
        self._lrs[j] += lr
        update = self._adam_update(w, m, v, eps, wd)
        w.sub_(update, alpha=lr)
        u.sub_(update, alpha=lr)
        if t % self.local_step_interval == 0:     # synchronize: average the local steps
            denom = v.sqrt().add_(eps)
            w.sub_(u)
            u.mul_(denom)
            if several:
                self._compress(j, gb, u)
            if self._lrs[j] != 0.0:
                torch.div(u, -self._lrs[j], out=m)
            w.add_(u / denom)
            u.zero_()
            self._lrs[j] = 0.0
        self._publish(gb)


class OneBitLamb(_OneBitBase):
    """1-bit LAMB (DeepSpeed's ``OnebitLamb``, arXiv 2104.06069) over stage 0's buffers.

    Warm-up (steps 1..freeze_step): the engine all-reduces gradients; Lamb with raw moments,
    u = m / (sqrt(v) + eps) + wd w, coefficient clamp(||w|| / ||u||, min_coeff, max_coeff) (1
    when a norm is 0), whose running average (``coeff_beta``) over the steps where it is not 1
    becomes the frozen coefficient; v is copied into a fresh variance at freeze_step.
    Compressed steps: with per-parameter scaling coefficients fixed at the first of them
    (the mean over parameters of ||m||/sqrt(numel), over this parameter's), every rank's
    scaled momentum b1 m + (1 - b1) g_r is averaged by ONE 1-bit all-reduce of all
    parameters together (a single scale, hence the scaling), unscaled; the gradient it
    implies, (m - b1 m_last) / (1 - b1), updates the fresh variance; v stays frozen; the
    coefficient is the frozen one times a factor max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))
    (mixed with 1 by ||m / (sqrt(v) + eps)|| / ||u|| under weight decay), clamped to
    [factor_min, factor_max] and to within factor_threshold of the last factor."""

    NAME, DS_NAME = "OneBitLamb", "1bit-Lamb"
    PER_GROUP_COMPRESSION = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        hp = self.param_groups[0]
        self.freeze_step = int(hp["freeze_step"])
        self.coeff_beta = float(hp["coeff_beta"])
        self.factor_max, self.factor_min = float(hp["factor_max"]), float(hp["factor_min"])
        self.factor_threshold = float(hp["factor_threshold"])
        present = [gb for gb in self.buffers if gb is not None]
        total = sum(gb.layout.numel for gb in present)
        # one compressed tensor: every parameter's momentum, back to back
        self._whole = (CompressedAllReduce(self.comm, [total], present[0].param_buf.data.device)
                       if self.world_size > 1 and present else None)
        count = sum(len(gb.params) for gb in present)
        self.coeff_freeze = [0.0] * count
        self.last_factor = [1.0] * count
        self.scaling: list[float] | None = None

    def _next_step_reduces(self) -> bool:
        return self.steps_done < self.freeze_step

    def _error_compressors(self) -> list[CompressedAllReduce]:
        return [self._whole] if self._whole is not None else []

    def _counters(self) -> dict:
        return {"coeff_freeze": list(self.coeff_freeze), "last_factor": list(self.last_factor),
                "scaling": list(self.scaling) if self.scaling is not None else None}

    def _restore_counters(self, saved: dict) -> None:
        for key in ("coeff_freeze", "last_factor"):
            if isinstance(saved.get(key), list) and len(saved[key]) == len(getattr(self, key)):
                setattr(self, key, [float(x) for x in saved[key]])
        scaling = saved.get("scaling")
        self.scaling = ([float(x) for x in scaling] if isinstance(scaling, list)
                        and len(scaling) == len(self.coeff_freeze) else None)

    @staticmethod
    def _views(gb, flat: torch.Tensor) -> list[torch.Tensor]:
        lay = gb.layout
        return [flat.narrow(0, off, k) for off, k in zip(lay.offsets, lay.numels)]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ZeroCoreError("OneBitLamb.step() takes no closure: the engine computes "
                                "gradients with engine.backward(loss)")
        local = self.local_gradients
        t = self.steps_done + 1
        present = [(j, gb) for j, gb in enumerate(self.buffers) if gb is not None]
        for j, _ in present:
            self.step_counts[j] += 1
        grads = {j: self._gradient(gb, local) for j, gb in present}
        self.lamb_coeffs = []
        if t <= self.freeze_step:
            index = 0
            for j, gb in present:
                index = self._warmup_group(j, gb, t, grads[j], index)
            return
        self._compressed_step(present, grads)

    def _lamb_coeff(self, w_norm: float, u_norm: float, hp) -> float:
        if w_norm == 0 or u_norm == 0:
            return 1.0
        return max(min(w_norm / u_norm, float(hp["max_coeff"])), float(hp["min_coeff"]))

    def _warmup_group(self, j, gb, t, g, index) -> int:
        hp = self.param_groups[j]
        beta1, beta2 = (float(b) for b in hp["betas"])
        st = self.flat_state[j]
        m, v = st["exp_avg"].data, st["exp_avg_sq"].data
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        if t == self.freeze_step:
            st["exp_avg_sq_fresh"].data.copy_(v)
        w = self._master(gb)
        update = self._adam_update(w, m, v, float(hp["eps"]), float(hp["weight_decay"]))
        ws, us = self._views(gb, w), self._views(gb, update)
        norms = torch.stack(torch._foreach_norm(ws + us)).tolist()   # one read for all
        half = len(ws)
        for i in range(half):
            coeff = self._lamb_coeff(norms[i], norms[half + i], hp)
            if coeff != 1.0:
                k = index + i
                self.coeff_freeze[k] = (self.coeff_beta * self.coeff_freeze[k]
                                        + (1 - self.coeff_beta) * coeff)
            self.lamb_coeffs.append(coeff)
            us[i].mul_(coeff)
        w.sub_(update, alpha=float(hp["lr"]))   # padding: update is 0 there
        self._publish(gb)
        return index + half

    def _compressed_step(self, present, grads) -> None:
        moms = [(j, gb, self._views(gb, self.flat_state[j]["exp_avg"].data))
                for j, gb in present]
        if self.scaling is None:   # fixed at the first compressed step (DeepSpeed's rule)
            flat = [x for _, _, views in moms for x in views]
            scales = [n / math.sqrt(x.numel()) for n, x in
                      zip(torch.stack(torch._foreach_norm(flat)).tolist(), flat)]
            united = sum(scales) / len(scales)
            self.scaling = [united / s if s != 0 else 1.0 for s in scales]
        last = {j: self.flat_state[j]["exp_avg"].data.clone() for j, _ in present}
        index = 0
        for j, gb, views in moms:
            beta1 = float(self.param_groups[j]["betas"][0])
            m = self.flat_state[j]["exp_avg"].data
            m.mul_(beta1).add_(grads[j], alpha=1.0 - beta1)
            torch._foreach_mul_(views, self.scaling[index:index + len(views)])
            index += len(views)
        if self._whole is not None:
            joined = torch.cat([x for _, _, views in moms for x in views])
            self._whole([joined])
            torch._foreach_copy_([x for _, _, views in moms for x in views],
                                 list(joined.split([x.numel() for _, _, vs in moms
                                                    for x in vs])))
        index = 0
        for j, gb, views in moms:
            index = self._compressed_group(j, gb, views, last[j], index)

    def _compressed_group(self, j, gb, views, m_last, index) -> int:
        hp = self.param_groups[j]
        beta1, beta2 = (float(b) for b in hp["betas"])
        eps, wd, lr = float(hp["eps"]), float(hp["weight_decay"]), float(hp["lr"])
        st = self.flat_state[j]
        m, v, fresh = st["exp_avg"].data, st["exp_avg_sq"].data, st["exp_avg_sq_fresh"].data
        n = len(views)
        torch._foreach_div_(views, self.scaling[index:index + n])
        implied = (m - m_last * beta1).div_(1.0 - beta1)
        fresh.mul_(beta2).addcmul_(implied, implied, value=1.0 - beta2)
        w = self._master(gb)
        denom = v.sqrt().add_(eps)
        prelim = m / denom
        update = prelim + w * wd if wd > 0.0 else prelim.clone()
        ratio_of = (denom / fresh.sqrt().add_(eps))
        us, ps, rs = (self._views(gb, update), self._views(gb, prelim),
                      self._views(gb, ratio_of))
        stats = torch.stack([*torch._foreach_norm(us), *torch._foreach_norm(ps),
                             *(r.max() for r in rs)]).tolist()
        for i in range(n):
            k = index + i
            u_norm, p_norm, factor = stats[i], stats[n + i], stats[2 * n + i]
            if wd > 0.0:
                share = min(1.0, p_norm / u_norm)
                factor = factor * share + (1.0 - share)
            factor = max(min(factor, self.factor_max), self.factor_min)
            factor = max(min(factor, self.last_factor[k] * (1.0 + self.factor_threshold)),
                         self.last_factor[k] * (1.0 - self.factor_threshold))
            self.last_factor[k] = factor
            coeff = self.coeff_freeze[k] * factor
            self.lamb_coeffs.append(coeff)
            us[i].mul_(coeff)
        w.sub_(update, alpha=lr)
        self._publish(gb)
        return index + n
