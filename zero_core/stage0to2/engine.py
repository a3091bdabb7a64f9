"""The ZeRO stage 0–2 training engine (built by ``zero_core.initialize``, factory.py).

One optimizer step, at a gradient-accumulation boundary:

1. backward hooks have reduced each bucket's gradient (see grad_reduce.py); wait for them;
2. one all_reduce of this rank's sum of squared gradients gives the global norm — and,
   since inf/NaN survive the sum, the overflow flag, identical on every rank; the same
   three numbers carry the micro-batch sizes, so ranks fed different sizes are caught;
3. on overflow the step is skipped (fp16: and the loss scale lowered; fp32/bf16: as
   ``safety.nonfinite_gradients`` says, optim/nonfinite.py); otherwise gradients are
   multiplied once by ``1/loss_scale × clip coefficient`` and the partitioned optimizer
   updates this rank's slice and all-gathers the new values (optim/partitioned.py).

The ``1/(world_size · gradient_accumulation_steps)`` of averaging is folded into the loss
before backward, so reductions are plain sums and no pass over the gradients is spent on it.
With DeepSpeed's ``gradient_predivide_factor`` f ≠ 1 the division is split as DeepSpeed splits
it: 1/f before the reduction (in the loss), f/world_size after it (in the step's one
multiplication, ``grad_factor``). DeepSpeed's default sums first and divides after; dividing
first gives the same mean up to one rounding and spares a pass (ARCHITECTURE §4).
"""
from __future__ import annotations

import contextlib
import math

import torch

from zero_core.config import Config
from zero_core.config.schema import torch_dtype
from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.stage0to2.grad_reduce import GradReducer
from zero_core.stage0to2.buffers import GroupBuffers
from zero_core.interfaces.ledger import CommLedger
from zero_core.optim.grad_norm import squared_norm
from zero_core.optim.loss_scaler import build_loss_scaler
from zero_core.optim.nonfinite import NonFiniteGradientError, NonFiniteGuard
from zero_core.memory import MemoryLedger, model_state_breakdown, optimizer_k
from zero_core.model_sync import broadcast_buffers, check_parameters_match
from zero_core.monitor.master import MonitorMaster, build_monitor
from zero_core.optim.rules import (collect_param_groups, require_offloadable, rule_from_config,
                                   rule_from_torch_optimizer)
from zero_core.optim.partitioned import PartitionedOptimizer
from zero_core.placement import move_module
from zero_core.runtime.context import Runtime


class ZeroEngine(torch.nn.Module):
    """Wraps *model* for data-parallel ZeRO training (stages 0, 1, 2; stage 3 is the
    subclass in stage3/engine.py). Build it with :func:`initialize`."""

    def __init__(self, model: torch.nn.Module, config: Config, runtime: Runtime,
                 optimizer=None, model_parameters=None, lr_scheduler=None):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self.config = config
        self.runtime = runtime
        self.comm = runtime.comm
        self.global_rank = runtime.rank
        # DeepSpeed's monitors (tensorboard, csv, wandb, comet); built first so that a missing
        # package fails before anything is allocated; never None, as in DeepSpeed
        self.monitor = build_monitor(config.monitor, self.global_rank) or MonitorMaster.off()
        self.local_rank = runtime.launch.local_rank
        self.world_size = runtime.world_size
        self.device = runtime.device
        self.stage = config.zero_optimization.stage
        self.compute_dtype = config.compute_dtype
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        # what gradients are divided by before the reduction; the rest after it (see top)
        predivide = config.gradient_predivide_factor
        self._prescale = (float(self.world_size) if config.prescale_gradients or predivide == 1.0
                          else predivide)
        self._postscale = self._prescale / self.world_size
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        # engine.backward() ran since the last update: an update without one is misuse
        # (step() alone, or loss.backward() bypassing the engine's scaling and reduction)
        self._backward_since_update = False
        # samples of this accumulation window seen by forward (leading dimension of the first
        # tensor input): compared across ranks at the step (safety.check_batch_sizes)
        self._window_samples = 0
        self._reduced_at = -1  # stages 0/1: micro-step whose backward reduced in place
        self._global_grad_norm: float | None = None
        self.memory_ledger = MemoryLedger()
        # bf16.bf16_master_weights_and_grads / bf16_optimizer_states (config/precision.py)
        self.master_dtype = (torch.bfloat16 if config.bf16.bf16_master_weights_and_grads
                             else torch.float32)
        self.state_dtype = torch.bfloat16 if config.bf16.bf16_optimizer_states else torch.float32

        optimizer = self._resolve_user_optimizer(optimizer, model_parameters, model)
        # no optimizer at all: an inference engine (DeepSpeed-Chat's frozen reference and
        # reward models): forward only, every parameter frozen, no optimizer state
        self.inference_only = optimizer is None and config.optimizer is None
        groups = ([] if self.inference_only
                  else collect_param_groups(model, model_parameters, optimizer))

        self._prepare_model(model)
        self._build_buffers(model, groups)
        self.optimizer = self.reducer = self.loss_scaler = self.lr_scheduler = None
        self._rule = None
        if not self.inference_only:
            self._build_training_parts(optimizer, groups, lr_scheduler)
        self._comm_mark = self.comm.ledger.snapshot()
        self._last_comm = CommLedger.difference(self._comm_mark, self._comm_mark)

    def _build_training_parts(self, optimizer, groups, lr_scheduler) -> None:
        """The optimizer over the partitions, the gradient reducer, loss scaler, non-finite
        guard and LR scheduler (an inference engine has none of them)."""
        config, runtime = self.config, self.runtime
        rule = (rule_from_torch_optimizer(optimizer, self.stage) if optimizer is not None
                else rule_from_config(config.optimizer))
        hyper_groups = optimizer.param_groups if optimizer is not None else groups
        if config.zero_optimization.offload_optimizer.enabled:
            # master weights and optimizer states in host memory or files (zero_core/offload)
            from zero_core.offload.optimizer import build_offloaded_optimizer
            require_offloadable(rule)
            self.optimizer = build_offloaded_optimizer(self, hyper_groups, rule)
        else:
            self.optimizer = PartitionedOptimizer(
                hyper_groups, rule, self._buffers, runtime.kernels, self.comm,
                self.memory_ledger, self.zero_grad, state_dtype=self.state_dtype)
        self._rule = rule
        self.reducer = self._build_reducer()
        self.reducer.register_hooks()
        self.loss_scaler = build_loss_scaler(config.fp16) if config.fp16.enabled else None
        self._nonfinite = NonFiniteGuard(config.safety.nonfinite_gradients,
                                         config.safety.max_consecutive_skips, config.precision)
        self.lr_scheduler = self._resolve_scheduler(lr_scheduler)

    # ---- construction ---------------------------------------------------------------------
    @staticmethod
    def _resolve_user_optimizer(optimizer, model_parameters, model):
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        if callable(optimizer):  # DeepSpeed also accepts a factory: params -> optimizer
            params = model_parameters if model_parameters is not None else model.parameters()
            made = optimizer(params)
            if isinstance(made, torch.optim.Optimizer):
                return made
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer (or a callable "
                          f"returning one), got {type(optimizer).__name__}")

    # Hook points: the stage-3 engine (stage3/engine.py) overrides these three.
    def _prepare_model(self, model):
        """Move *model* to the device and make every rank start from the same values."""
        move_module(model, self.device)
        broadcast_buffers(model, self.comm)
        check_parameters_match(model, self.comm)

    def _build_reducer(self):
        """The gradient reducer over ``self._buffers`` (hooks not registered yet)."""
        return GradReducer(
            [gb for gb in self._buffers if gb is not None], self.comm, self.stage,
            self.config.zero_optimization.overlap_comm, self._registration,
            self.is_gradient_accumulation_boundary,
            on_allocate=lambda t: self.memory_ledger.track("communication_buffers", t),
            comm_dtype=torch_dtype(self.config.comm_dtype_name))

    def _build_buffers(self, model, groups):
        self._registration = {}
        for p in model.parameters():
            self._registration.setdefault(id(p), len(self._registration))
        trainable_ids = set()
        per_group = []
        for g in groups:
            ps = [p for p in g["params"] if p.requires_grad]
            # reverse registration order: the order backward produces gradients
            ps.sort(key=lambda p: -self._registration[id(p)])
            per_group.append(ps)
            trainable_ids.update(id(p) for p in ps)
        if not trainable_ids and not self.inference_only:
            raise ConfigError("no trainable parameters: every parameter passed has "
                              "requires_grad=False (or model_parameters is empty)")
        values = [[p.detach().float() for p in ps] for ps in per_group]
        if self.compute_dtype != torch.float32:
            # frozen parameters and floating buffers compute in the low precision too
            model.to(self.compute_dtype)
        zc = self.config.zero_optimization
        self._buffers: list[GroupBuffers | None] = []
        for ps, vals in zip(per_group, values):
            self._buffers.append(None if not ps else GroupBuffers(
                ps, self.stage, self.compute_dtype, self.device, self.global_rank,
                self.world_size, zc.reduce_bucket_size, self.memory_ledger, vals,
                grad_dtype=torch_dtype(self.config.grad_accum_dtype_name),
                master_dtype=self.master_dtype))
        del values
        for p in model.parameters():
            if id(p) not in trainable_ids:
                self.memory_ledger.track("frozen_parameters", p.data)
        for b in model.buffers():
            self.memory_ledger.track("buffers", b)

    def _resolve_scheduler(self, lr_scheduler):
        if lr_scheduler is not None:
            if self.config.scheduler is not None:
                raise ConfigError("a 'scheduler' section in the config and lr_scheduler= were "
                                  "both given; keep one")
            if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
                return lr_scheduler(self.optimizer)
            return lr_scheduler
        if self.config.scheduler is not None:
            from zero_core.optim.lr_schedules import build_scheduler
            return build_scheduler(self.config.scheduler, self.optimizer)
        return None

    # ---- training API -----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the model. Tensor arguments (also inside tuples, lists and dicts) are moved to
        ``self.device``, so a data loader's host batches work on every accelerator. Inputs
        keep their dtype, as in DeepSpeed: with ``fp16.auto_cast: true`` floating-point ones
        are cast to fp16 (integer inputs such as token ids are left alone); in bf16 training
        the model (or the caller) casts them. With ``torch_autocast`` enabled the model runs
        under ``torch.autocast``. Targets given to the loss are the caller's to move
        (``y.to(engine.device)``)."""
        args = tuple(self._to_device(a) for a in args)
        kwargs = {k: self._to_device(v) for k, v in kwargs.items()}
        if self.training and torch.is_grad_enabled():
            self._window_samples += _leading_dim(args, kwargs)
        with self._autocast():
            return self.module(*args, **kwargs)

    def _autocast(self):
        ac = self.config.torch_autocast
        if not ac.enabled:
            return contextlib.nullcontext()
        dtype = torch_dtype(ac.dtype) or torch.get_autocast_dtype(self.device.type)
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _to_device(self, x):
        if isinstance(x, torch.Tensor):
            if x.device != self.device:
                x = x.to(self.device)
            if (self.config.fp16.auto_cast and x.is_floating_point()
                    and x.dtype != torch.float16):
                x = x.to(torch.float16)
            return x
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(self._to_device(v) for v in x)
        if isinstance(x, dict):
            return type(x)((k, self._to_device(v)) for k, v in x.items())
        return x

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backpropagate *loss* (this rank's mean over its micro-batch). Gradients are
        scaled by the fp16 loss scale and by 1/gradient_accumulation_steps.

        Twice on one graph behaves as ``loss.backward()`` does: without
        ``retain_graph=True`` on the first call the second raises torch's "backward through
        the graph a second time" error (the gradients of the first stay); with it the
        gradients add up, so the update equals one backward of the summed losses."""
        self._require_training("engine.backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ZeroCoreError("engine.backward(loss) needs a scalar loss tensor; reduce it "
                                "first (e.g. loss.mean())")
        factor = self.loss_scale / (self.gradient_accumulation_steps * self._prescale)
        # stages 0/1 reduce the full gradient buffer in place at the boundary's backward; a
        # second backward there (retain_graph) would reduce the already-reduced sum again
        again = (self.stage in (0, 1) and self.is_gradient_accumulation_boundary()
                 and self._reduced_at == self.micro_steps)
        stash = self._set_aside_reduced() if again else None
        done = False
        try:
            (loss.float() * factor).backward(retain_graph=retain_graph)
            self.reducer.flush()
            done = True
        finally:
            if stash is not None:
                self._merge_reduced(stash, add=done)
        if self.stage in (0, 1) and self.is_gradient_accumulation_boundary():
            self._reduced_at = self.micro_steps
        self._backward_since_update = True
        return loss

    def _set_aside_reduced(self) -> list:
        """Move the reduced gradients out of the buffers (which are zeroed), so that the
        next backward reduces only its own gradients."""
        self.reducer.wait_all()
        stash = [None if gb is None else gb.grad_buf.data.clone() for gb in self._buffers]
        for gb in self._buffers:
            if gb is not None:
                gb.grad_buf.data.zero_()
        return stash

    def _merge_reduced(self, stash: list, add: bool) -> None:
        """Put set-aside gradients back: added to the new reduction, or (the backward
        failed) restored as they were."""
        self.reducer.wait_all()
        for gb, saved in zip(self._buffers, stash):
            if gb is not None:
                gb.grad_buf.data.add_(saved) if add else gb.grad_buf.data.copy_(saved)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` applies an optimizer update."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def step(self) -> None:
        """End of a micro-step: apply the update at gradient-accumulation boundaries."""
        self._require_training("engine.step")
        if self.is_gradient_accumulation_boundary():
            if not self._backward_since_update:
                raise ZeroCoreError(
                    f"engine.step() at an accumulation boundary (micro-step "
                    f"{self.micro_steps}) with no engine.backward(loss) since the last update: "
                    f"nothing to apply. Call engine.backward(loss) before engine.step() (not "
                    f"loss.backward(), which bypasses the engine's gradient scaling and "
                    f"reduction)")
            self._optimizer_step()
            self._backward_since_update = False
        self.micro_steps += 1

    def _optimizer_step(self):
        self.reducer.flush()
        self.reducer.wait_all()
        present = [gb for gb in self._buffers if gb is not None]
        local = squared_norm(t for gb in present for t in gb.reduced_grad_tensors())
        sumsq = self._all_reduce_step_stats(local)
        scale = self.loss_scale
        overflow = not math.isfinite(sumsq)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
            skip = overflow  # fp16 always skips an overflowing step
        else:  # the same decision on every rank: the sum was all-reduced
            try:
                skip = self._nonfinite.should_skip(not overflow, self.global_steps, sumsq,
                                                   self._first_nonfinite_parameter,
                                                   self.global_rank)
            except NonFiniteGradientError:
                self._drop_window()
                raise
        if skip:
            self.skipped_steps += 1
            self._global_grad_norm = float("inf")
            self._finish_step(stepped=False)
            return
        norm = math.sqrt(sumsq) * self._postscale / scale
        factor = self._postscale / scale
        clip = self.config.gradient_clipping
        if clip > 0 and math.isfinite(norm):
            # torch.nn.utils.clip_grad_norm_'s coefficient
            factor *= min(1.0, clip / (norm + 1e-6))
        self.optimizer.grad_factor = factor
        self.optimizer.step()
        self._global_grad_norm = norm
        self._finish_step(stepped=True)

    def _all_reduce_step_stats(self, local_sumsq: torch.Tensor) -> float:
        """The global squared gradient norm; on the way, with the same all_reduce, check
        that every rank saw the same number of samples since the last update (ranks with
        different micro-batch sizes weight samples unequally: each rank's mean counts the
        same). Stage 0's gradients are already complete: only the sizes travel then."""
        n = float(self._window_samples)
        check = self.config.safety.check_batch_sizes and self.world_size > 1
        reduce_norm = self.stage > 0 and self.world_size > 1
        if not (reduce_norm or check):
            return float(local_sumsq.item())
        # on the norm's device: the collective carries one tensor, wherever gradients live
        counts = torch.tensor([n, n * n], dtype=torch.float64, device=local_sumsq.device)
        stats = torch.cat([(local_sumsq if reduce_norm else torch.zeros_like(local_sumsq))
                           .reshape(1), counts])
        self.comm.all_reduce(stats, "sum")
        sumsq, total, total_sq = stats.tolist()  # one device-to-host copy
        # all equal <=> N·Σn² = (Σn)² (Cauchy–Schwarz); exact while the numbers are below 2**53
        if check and total * total < 2.0 ** 53 and self.world_size * total_sq != total * total:
            self._raise_batch_mismatch(n)
        return sumsq if reduce_norm else float(local_sumsq.item())

    def _raise_batch_mismatch(self, n: float):
        """Collective (every rank saw the same sums): name each rank's sample count."""
        everyone = torch.empty(self.world_size, dtype=torch.float64)
        self.comm.all_gather_into(everyone, torch.tensor([n], dtype=torch.float64))
        counts = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(everyone.tolist()))
        self._drop_window()
        raise ZeroCoreError(
            f"step {self.global_steps}: ranks saw different numbers of samples since the last "
            f"update ({counts}; the leading dimension of the first tensor given to "
            f"engine(...)). Each rank's loss is a mean over its own samples, so uneven "
            f"batches would weight samples unequally. Give every rank the same micro-batch "
            f"size (DataLoader(drop_last=True) with a DistributedSampler). If the first input "
            f"is not batch-first (e.g. a sequence-first tensor padded per rank), set config "
            f"\"safety\": {{\"check_batch_sizes\": false}}. The weights were not updated")

    def _drop_window(self) -> None:
        """Forget this accumulation window (a step that raised): gradients, sample count."""
        self.zero_grad()
        self._window_samples = 0
        self._backward_since_update = False

    def _first_nonfinite_parameter(self) -> str | None:
        """Collective: the first parameter (``module.named_parameters()`` order) whose
        reduced gradient holds inf/NaN on any rank; only called on a non-finite step."""
        from zero_core.checkpoint.engine_state import layout_fragments, parameter_names
        names = parameter_names(self.module)
        order = {name: i for i, name in enumerate(names.values())}
        first = len(order)
        for gb in self._buffers:
            if gb is None:
                continue
            grads = getattr(gb, "grad_part", None)
            grads = grads if grads is not None else gb.grad_buf
            for f in layout_fragments(gb.layout, gb.params, names, {"g": grads},
                                      self.global_rank, [self.global_rank]):
                if order[f.name] < first and not bool(torch.isfinite(f.tensors["g"]).all()):
                    first = order[f.name]
        if self.world_size > 1:
            t = torch.tensor([first], dtype=torch.int64)
            self.comm.all_reduce(t, "min")
            first = int(t)
        return list(order)[first] if first < len(order) else None

    def _finish_step(self, stepped: bool):
        self.zero_grad()
        self._window_samples = 0
        if stepped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        if self.monitor.enabled and self.global_rank == 0:
            # what DeepSpeed 0.19.8 writes at each optimizer step, skipped steps included
            events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if self.loss_scaler is not None:
                events.append(("Train/Samples/loss_scale", self.loss_scale, self.global_samples))
            self.monitor.write_events(events)
        now = self.comm.ledger.snapshot()
        self._last_comm = CommLedger.difference(now, self._comm_mark)
        self._comm_mark = now

    def _require_training(self, what: str) -> None:
        if self.inference_only:
            raise ZeroCoreError(
                f"{what}: this engine was built without an optimizer, as an inference engine "
                f"(forward only, e.g. a frozen reference or reward model); pass optimizer= or "
                f"add an 'optimizer' section to the config to train the model")

    def zero_grad(self) -> None:
        """Drop accumulated gradients (the engine does this after every update)."""
        if self.inference_only:
            return
        for gb in self._buffers:
            if gb is not None:
                gb.zero_grads()
        self.reducer.mark_fresh()

    def train(self, mode: bool = True):
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def generate(self, *args, **kwargs):
        """Generate with the model's own ``generate`` (Hugging Face's GenerationMixin) as
        DeepSpeed's hybrid engine does: without autograd, in eval mode, the ``hybrid_engine``
        section deciding how stage 3 gathers (zero_core/generation/generate.py)."""
        from zero_core.generation.generate import generate
        return generate(self, *args, **kwargs)

    # ---- reports ------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return float(self.loss_scaler.scale) if self.loss_scaler is not None else 1.0

    def get_lr(self) -> list[float]:
        """Learning rate of every parameter group (none for an inference engine)."""
        if self.optimizer is None:
            return []
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the (unscaled, unclipped) averaged gradient at the last step; inf if
        that step overflowed; None before the first step."""
        return self._global_grad_norm

    @property
    def global_samples(self) -> int:
        """DeepSpeed's sample counter: train_batch_size per optimizer step (skipped ones too)."""
        return self.global_steps * self.config.train_batch_size

    @property
    def num_parameters(self) -> int:
        """Trainable parameters (Ψ), without padding."""
        return sum(gb.layout.numel for gb in self._buffers if gb is not None)

    @property
    def padding_elements(self) -> int:
        """Padding elements across all flat buffers of trainable parameters."""
        return sum(gb.layout.padded_numel - gb.layout.numel
                   for gb in self._buffers if gb is not None)

    def memory_report(self) -> dict:
        """Bytes per rank: the engine's own allocations by category (``ledger``), the
        formula of ARCHITECTURE §4 for the same model (``formula``; None for optimizers without a known
        per-parameter state size) and the accelerator's allocated/peak bytes."""
        formula = None
        if self._rule is not None and self._rule.kind in ("adam", "sgd", "lamb"):
            momentum = any(float(g.get("momentum", 0.0)) for g in self.optimizer.param_groups)
            k = optimizer_k(self._rule.kind, momentum)
            name = {torch.float32: "fp32", torch.bfloat16: "bf16"}
            formula = model_state_breakdown(self.stage, self.num_parameters, self.world_size,
                                            self.config.precision, k,
                                            master_dtype=name[self.master_dtype],
                                            states_dtype=name[self.state_dtype],
                                            grads_dtype=self.config.grad_accum_dtype_name)
            formula["model_states"] = sum(formula.values())
        elif self.inference_only:
            # parameters only (in the compute dtype), partitioned at stage 3
            frozen = (sum(u.numel for u in self.units) if self.stage == 3
                      else sum(p.numel() for p in self.module.parameters()))
            formula = {"parameters": model_state_breakdown(
                self.stage, frozen, self.world_size, self.config.precision)["parameters"]}
            formula["model_states"] = formula["parameters"]
        acc = self.runtime.accelerator
        offload = getattr(self.optimizer, "offload_report", None)
        return {"ledger": self.memory_ledger.report(), "formula": formula,
                **({"offload": offload()} if offload is not None else {}),
                "num_parameters": self.num_parameters, "padding_elements": self.padding_elements,
                "device": str(self.device),
                "accelerator": {"allocated": acc.memory_allocated(),
                                "peak": acc.max_memory_allocated()}}

    def comm_report(self) -> dict:
        """What this rank sent during the last optimizer step (all its micro-steps): by
        operation, sent bytes, inter-/intra-node bytes (CommLedger.difference format)."""
        return self._last_comm

    def destroy(self) -> None:
        """Remove the backward hooks (the model keeps its current values); close monitors."""
        if self.reducer is not None:
            self.reducer.remove_hooks()
        self.monitor.close()

    # ---- checkpoints (checkpoint/engine_state.py: format, resharding; save_load.py) ---------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        """Collective: save everything needed to resume into ``save_dir/tag`` (default tag
        ``global_step<N>``) atomically; returns that directory. A *tag* that differs across
        ranks is handled as ``checkpoint.tag_validation`` says (checkpoint/tags.py)."""
        from zero_core.checkpoint.save_load import save_checkpoint
        from zero_core.checkpoint.tags import validate_tag
        if tag is not None:  # the default tag comes from global_steps, equal on every rank
            tag = validate_tag(self.comm, str(tag), self.config.checkpoint.tag_validation)
        return save_checkpoint(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False):
        """Collective: load checkpoint *tag* (default: ``latest``), saved with any world size
        and stage; returns ``(checkpoint directory, client_state)``."""
        from zero_core.checkpoint.save_load import load_checkpoint
        return load_checkpoint(self, load_dir, tag, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)

    def _checkpoint_fragments(self, purpose):
        from zero_core.checkpoint.engine_state import zero_fragments
        return zero_fragments(self, purpose)

    def _checkpoint_restored(self):
        from zero_core.checkpoint.engine_state import zero_restored
        zero_restored(self)

    def _checkpoint_layout(self):
        from zero_core.checkpoint.engine_state import zero_layout
        return zero_layout(self)


def _leading_dim(args, kwargs) -> int:
    """Samples in one forward call: the leading dimension of the first tensor argument
    (positional first, then keyword, in order); 0 when there is none."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return int(v.shape[0]) if v.dim() else 1
    return 0
