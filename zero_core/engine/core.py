"""The ZeRO training engine: the step every stage shares (built by ``zero_core.initialize``,
factory.py). What differs between stages comes from the engine's :class:`StageParts`
(contract.py): stage0to2/parts.py or stage3/parts.py.

One optimizer step, at a gradient-accumulation boundary (engine/update.py):

1. backward hooks have reduced each gradient bucket or fetch unit (the stage's reducer);
   wait for them;
2. one all_reduce of this rank's sum of squared gradients gives the global norm — and,
   since inf/NaN survive the sum, the overflow flag, identical on every rank; the same
   vector carries every rank's micro-batch size, so ranks fed different sizes are caught;
3. on overflow the step is skipped (fp16: and the loss scale lowered; fp32/bf16: as
   ``safety.nonfinite_gradients`` says, optim/nonfinite.py); otherwise gradients are
   multiplied once by ``1/loss_scale × clip coefficient`` and the partitioned optimizer
   updates this rank's slice and all-gathers the new values (optim/partitioned.py).
   All of it is decided on the device; the host learns the verdict one step later.

The ``1/(world_size · gradient_accumulation_steps)`` of averaging is folded into the loss
before backward, so reductions are plain sums and no pass over the gradients is spent on it.
With DeepSpeed's ``gradient_predivide_factor`` f ≠ 1 the division is split as DeepSpeed splits
it: 1/f before the reduction (in the loss), f/world_size after it (in the step's one
multiplication, ``grad_factor``). DeepSpeed's default sums first and divides after; dividing
first gives the same mean up to one rounding and spares a pass (ARCHITECTURE §4).
"""
from __future__ import annotations

import logging
import os

import torch

from zero_core.checkpoint.schedule import Checkpointing
from zero_core.config import Config
from zero_core.config.precision import dtype_name
from zero_core.engine.autocast import autocast_context, autocast_loss_scaler, mark_comm_dtypes
from zero_core.engine.contract import StageParts
from zero_core.engine.optimizer_choice import build_optimizer
from zero_core.engine.step_stats import leading_dim
from zero_core.engine.timers import WallClock
from zero_core.engine.update import UpdateStep
from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.interfaces.engine_parts import BuildContext, CheckpointSubject
from zero_core.interfaces.ledger import CommLedger
from zero_core.optim.loss_scaler import build_loss_scaler
from zero_core.optim.nonfinite import NonFiniteGuard
from zero_core.memory import MemoryLedger, model_state_breakdown, optimizer_k
from zero_core.monitor.master import MonitorMaster, build_monitor
from zero_core.optim.rules import (collect_param_groups, resolve_user_optimizer,
                                   rule_from_config, rule_from_torch_optimizer)
from zero_core.optim.onebit import gate_reduction
from zero_core.runtime.context import Runtime
from zero_core.runtime.partition_comm import build_sharding

log = logging.getLogger("zero_core.engine")


class ZeroEngine(torch.nn.Module):
    """Wraps *model* for data-parallel ZeRO training at any stage; *parts* is the stage's
    :class:`StageParts` class (``factory.STAGE_PARTS``). Build it with :func:`initialize`.
    ``engine.parts`` is the stage's object (stage 3: units, coordinator, gatherer, ...)."""

    def __init__(self, model: torch.nn.Module, config: Config, runtime: Runtime,
                 parts: type[StageParts], optimizer=None, model_parameters=None,
                 lr_scheduler=None):
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
        self._skipped_steps = 0
        # engine.backward() ran since the last update: an update without one is misuse
        # (step() alone, or loss.backward() bypassing the engine's scaling and reduction)
        self._backward_since_update = False
        # samples of this accumulation window seen by forward (leading dimension of the first
        # tensor input): compared across ranks at the step (safety.check_batch_sizes)
        self._window_samples = 0
        self._reduced_at = -1  # stages 0/1: micro-step whose backward reduced in place
        self._global_grad_norm: float | None = None
        self.memory_ledger = MemoryLedger()
        # bf16.bf16_master_weights_and_grads / bf16_optimizer_states (config/precision_sections.py)
        self.master_dtype = (torch.bfloat16 if config.bf16.bf16_master_weights_and_grads
                             else torch.float32)
        self.state_dtype = torch.bfloat16 if config.bf16.bf16_optimizer_states else torch.float32

        optimizer = resolve_user_optimizer(optimizer, model_parameters, model)
        # no optimizer at all: an inference engine (DeepSpeed-Chat's frozen reference and
        # reward models): forward only, every parameter frozen, no optimizer state
        self.inference_only = optimizer is None and config.optimizer is None
        groups = ([] if self.inference_only
                  else collect_param_groups(model, model_parameters, optimizer))
        if not self.inference_only and not any(p.requires_grad for g in groups
                                                for p in g["params"]):
            raise ConfigError("no trainable parameters: every parameter passed has "
                              "requires_grad=False (or model_parameters is empty)")

        # the ranks the stage partitions over (all; MiCS's shard group), as the stage's
        # communicator: runtime/partition_comm.py
        zc = config.zero_optimization
        self.sharding = build_sharding(
            self.comm, zc, self.stage, uses_qgz=self.stage == 3 and zc.zero_quantized_gradients,
            reduces_once_per_step=self.stage == 1 or self.gradient_accumulation_steps == 1)
        self.build_context = BuildContext(
            config=config, comm=self.sharding.comm, world_comm=self.comm,
            accelerator=runtime.accelerator, kernels=runtime.kernels, device=self.device,
            rank=self.sharding.rank, world_size=self.sharding.world_size, stage=self.stage,
            compute_dtype=self.compute_dtype, master_dtype=self.master_dtype,
            state_dtype=self.state_dtype, memory_ledger=self.memory_ledger,
            inference_only=self.inference_only)
        mark_comm_dtypes(model, config, self.device)  # lower_precision_safe_modules
        self.parts = parts(self.build_context)
        self.parts.prepare_model(model)
        self.parts.build(model, groups)
        self.optimizer = self.reducer = self.loss_scaler = self.lr_scheduler = None
        self._rule = self._update = None
        if not self.inference_only:
            self._build_training_parts(optimizer, groups, lr_scheduler)
        # periodic and async saves, the data position (checkpoint/schedule.py)
        self._saves = Checkpointing(config.checkpoint, self.comm)
        self.resumed_client_state = None  # client_state of the checkpoint.resume load
        self._comm_mark = self.comm.ledger.snapshot()
        self._last_comm = CommLedger.difference(self._comm_mark, self._comm_mark)
        self.wall_clock = WallClock(self)  # wall_clock_breakdown, steps_per_print (timers.py)

    def _build_training_parts(self, optimizer, groups, lr_scheduler) -> None:
        """The optimizer over the partitions, the gradient reducer, loss scaler, non-finite
        guard and LR scheduler (an inference engine has none of them)."""
        config = self.config
        rule = (rule_from_torch_optimizer(optimizer, self.stage) if optimizer is not None
                else rule_from_config(config.optimizer))
        hyper_groups = optimizer.param_groups if optimizer is not None else groups
        self.optimizer = build_optimizer(  # plain, offloaded, ZenFlow, 1-bit, ...
            self.build_context, hyper_groups, rule, self.parts, self.zero_grad,
            self.sharding.comm, self.state_dtype)
        self._rule = rule
        self.reducer = self.parts.build_reducer(
            gate_reduction(self.optimizer, self.is_gradient_accumulation_boundary))
        self.reducer.register_hooks()
        self.optimizer.follow_reducer(self.reducer, lambda: (  # SuperOffload (speculative.py)
            self.is_gradient_accumulation_boundary(), self.micro_steps, self._postscale,
            self.loss_scaler))
        self.loss_scaler = (build_loss_scaler(config.fp16).to(self.device) if config.fp16.enabled
                            else autocast_loss_scaler(config, self.device))
        self._nonfinite = NonFiniteGuard(config.safety.nonfinite_gradients,
                                         config.safety.max_consecutive_skips, config.precision)
        self.lr_scheduler = self._resolve_scheduler(lr_scheduler)
        self._update = UpdateStep(self)

    # ---- construction ---------------------------------------------------------------------
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
        with self.wall_clock("fwd"):
            args = tuple(self._to_device(a) for a in args)
            kwargs = {k: self._to_device(v) for k, v in kwargs.items()}
            if self.training and torch.is_grad_enabled():
                self._window_samples += leading_dim(args, kwargs)
            with self._autocast():
                return self.module(*args, **kwargs)

    def _autocast(self):
        return autocast_context(self.config, self.device)  # torch_autocast: engine/autocast.py

    def _to_device(self, x):
        if isinstance(x, torch.Tensor):
            if x.device != self.device:
                # from pinned memory (DataLoader(pin_memory=True)) without waiting for the
                # device; a pageable source is copied synchronously either way
                x = x.to(self.device, non_blocking=x.device.type == "cpu" and x.is_pinned())
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
        # the fp16 scale stays on the device (a tensor): reading it would synchronize
        scale = self.loss_scaler.current if self.loss_scaler is not None else 1.0
        factor = scale / (self.gradient_accumulation_steps * self._prescale)
        # stages 0/1 reduce the full gradient buffer in place at the boundary's backward; a
        # second backward there (retain_graph) would reduce the already-reduced sum again
        again = (self.stage in (0, 1) and self.is_gradient_accumulation_boundary()
                 and self._reduced_at == self.micro_steps)
        with self.wall_clock("bwd"):
            stash = self._set_aside_reduced() if again else None
            done = False
            try:
                with self.wall_clock("bwd_inner"):
                    (loss.float() * factor).backward(retain_graph=retain_graph)
                with self.wall_clock("bwd_allreduce"):
                    self.reducer.flush()
                done = True
            finally:
                if stash is not None:
                    self._merge_reduced(stash, add=done)
        if self.stage in (0, 1) and self.is_gradient_accumulation_boundary():
            self._reduced_at = self.micro_steps
        if self.is_gradient_accumulation_boundary():
            self.optimizer.speculate(self.reducer, self._postscale, self.loss_scaler)
        self._backward_since_update = True
        return loss

    def _set_aside_reduced(self) -> list:
        """Move the reduced gradients out of the buffers (which are zeroed), so that the
        next backward reduces only its own gradients."""
        self.reducer.wait_all()
        stash = [None if gb is None else gb.grad_buf.data.clone() for gb in self.parts.buffers]
        for gb in self.parts.buffers:
            if gb is not None:
                gb.grad_buf.data.zero_()
        return stash

    def _merge_reduced(self, stash: list, add: bool) -> None:
        """Put set-aside gradients back: added to the new reduction, or (the backward
        failed) restored as they were."""
        self.reducer.wait_all()
        for gb, saved in zip(self.parts.buffers, stash):
            if gb is not None:
                gb.grad_buf.data.add_(saved) if add else gb.grad_buf.data.copy_(saved)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` applies an optimizer update."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def step(self) -> None:
        """End of a micro-step: apply the update at gradient-accumulation boundaries."""
        self._require_training("engine.step")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            if not self._backward_since_update:
                raise ZeroCoreError(
                    f"engine.step() at an accumulation boundary (micro-step "
                    f"{self.micro_steps}) with no engine.backward(loss) since the last update: "
                    f"nothing to apply. Call engine.backward(loss) before engine.step() (not "
                    f"loss.backward(), which bypasses the engine's gradient scaling and "
                    f"reduction)")
            with self.wall_clock("step"):
                self._optimizer_step()
                self.parts.after_update()
            self._backward_since_update = False
        self.micro_steps += 1
        if boundary:  # after the count: a save here records the finished micro-step
            self._saves.after_update(self.global_steps, self.save_checkpoint)

    def _optimizer_step(self):
        self._update.run()

    def _drop_window(self) -> None:
        """Forget this accumulation window (a step that raised): gradients, sample count."""
        self.zero_grad()
        self._window_samples = 0
        self._backward_since_update = False

    def _settle(self, collective: bool = False) -> None:
        """Take the last update's verdict into the books (engine/update.py)."""
        if self._update is not None:
            self._update.settle(collective)

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
        for gb in self.parts.buffers:
            if gb is not None:
                gb.zero_grads()
        self.reducer.mark_fresh()

    def train(self, mode: bool = True):
        self.module.train(mode)
        self.training = mode
        self.parts.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None,
                schedule=None) -> None:
        """torch.compile the model's blocks (DeepSpeed's engine.compile); see engine/compile.py."""
        from zero_core.engine.compile import compile_engine
        compile_engine(self, backend, compile_kwargs, schedule)

    @property
    def is_compiled(self) -> bool:
        """True after :meth:`compile`."""
        return getattr(self, "_compiled", False)

    def compile_report(self) -> dict:
        """What :meth:`compile` compiled, with the graph breaks and graphs since."""
        from zero_core.engine.compile import compile_report
        return compile_report(self)

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
        self._settle()
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the (unscaled, unclipped) averaged gradient at the last step; inf if
        that step overflowed; None before the first step."""
        self._settle()
        return self._global_grad_norm

    def global_grad_norm_tensor(self) -> torch.Tensor | None:
        """:meth:`get_global_grad_norm` as a 0-dim tensor on the device, without waiting
        for the device (for loggers that read it only now and then)."""
        return self._update.last_norm if self._update is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (non-finite gradients, fp16 overflows)."""
        self._settle()
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_steps = value

    @property
    def global_samples(self) -> int:
        """DeepSpeed's sample counter: train_batch_size per optimizer step (skipped ones too)."""
        return self.global_steps * self.config.train_batch_size

    @property
    def num_parameters(self) -> int:
        """Trainable parameters (Ψ), without padding."""
        return sum(gb.layout.numel for gb in self.parts.buffers if gb is not None)

    @property
    def padding_elements(self) -> int:
        """Padding elements across all flat buffers of trainable parameters."""
        return sum(gb.layout.padded_numel - gb.layout.numel
                   for gb in self.parts.buffers if gb is not None)

    def memory_report(self) -> dict:
        """Bytes per rank: the engine's own allocations by category (``ledger``), the
        formula of ARCHITECTURE §4 for the same model (``formula``; None for optimizers without a known
        per-parameter state size) and the accelerator's allocated/peak bytes."""
        formula = None
        if self._rule is not None and self._rule.kind in ("adam", "sgd", "lamb"):
            momentum = any(float(g.get("momentum", 0.0)) for g in self.optimizer.param_groups)
            k = optimizer_k(self._rule.kind, momentum)
            formula = model_state_breakdown(self.stage, self.num_parameters,
                                            self.sharding.world_size,
                                            self.config.precision, k,
                                            master_dtype=dtype_name(self.master_dtype),
                                            states_dtype=dtype_name(self.state_dtype),
                                            grads_dtype=self.config.grad_accum_dtype_name)
            formula["model_states"] = sum(formula.values())
        elif self.inference_only:
            # parameters only (in the compute dtype), partitioned at stage 3
            frozen = self.parts.parameter_numel(self.module)
            formula = {"parameters": model_state_breakdown(
                self.stage, frozen, self.sharding.world_size,
                self.config.precision)["parameters"]}
            formula["model_states"] = formula["parameters"]
        acc = self.runtime.accelerator
        offload = getattr(self.optimizer, "offload_report", None)
        return {"ledger": self.memory_ledger.report(), "formula": formula,
                **({"offload": offload()} if offload is not None else {}),
                "num_parameters": self.num_parameters, "padding_elements": self.padding_elements,
                "device": str(self.device),
                "accelerator": {"allocated": acc.memory_allocated(),
                                "peak": acc.max_memory_allocated()},
                **self.parts.memory_report()}

    def get_wall_clock_timers(self) -> dict:
        """DeepSpeed's: ms per timer of the last optimizer step (wall_clock_breakdown)."""
        return dict(self.wall_clock.last)

    def comm_report(self) -> dict:
        """What this rank sent during the last optimizer step (all its micro-steps): by
        operation, sent bytes, inter-/intra-node bytes (CommLedger.difference format)."""
        return self._last_comm

    def destroy(self) -> None:
        """Remove the engine's hooks (the model keeps its current values; at stage 3 the
        parameters stay partitioned: gather them with GatheredParameters); close monitors."""
        self._settle()
        self._saves.close()
        self._close()
        self.parts.destroy()

    def _close(self) -> None:
        """Remove the gradient hooks and close the monitors (what the engine itself owns)."""
        if self.reducer is not None:
            self.reducer.remove_hooks()
        self.monitor.close()

    def hand_back_model(self) -> torch.nn.Module:
        """Retire this engine and return its model as ``zero_core.initialize`` adopts it
        (a second training run on the same model, training after an evaluation engine):
        at stage 3 partitioned the way ``zero_core.Init`` leaves a model, from the fp32
        master where there is one (Stage3Parts.hand_back_model). Collective: every rank
        calls it. Do not use the engine afterwards."""
        self.wait_for_checkpoint()
        module = self.parts.hand_back_model(self.module)
        self._close()
        return module

    # ---- the model, whole ---------------------------------------------------------------------
    def module_state_dict(self, rank0_only: bool = False) -> dict:
        """The model's full state dict (parameter values in the compute dtype, buffers); at
        stage 3 gathered one fetch unit at a time. With *rank0_only*, other ranks get
        ``{}`` (and at stage 3 never hold more than one unit in full). Collective."""
        return self.parts.state_dict(self.module, rank0_only, exclude_frozen=False)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Save the model's state dict (values in the compute dtype: fp16/bf16, or fp32 in
        fp32 training) with ``torch.save`` from rank 0 to *save_dir*/*save_filename*, as
        DeepSpeed does. At stage 3 the parameters are gathered only when
        ``stage3_gather_16bit_weights_on_model_save`` is true; when it is false nothing is
        saved and False is returned (DeepSpeed's behaviour), with a warning. Collective."""
        if (self.stage == 3 and
                not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save):
            log.warning("save_16bit_model: not saved, because zero_optimization."
                        "stage3_gather_16bit_weights_on_model_save is false; set it to true to "
                        "gather the partitioned parameters on save")
            return False
        state = self.parts.state_dict(self.module, rank0_only=True,
                                      exclude_frozen=exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            tmp = path + ".tmp"
            torch.save(state, tmp)
            os.replace(tmp, path)
        if self.world_size > 1:
            self.comm.barrier()
        return True

    # ---- checkpoints (checkpoint/engine_state.py: format, resharding; save_load.py) ---------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        async_save=None):
        """Collective: save everything needed to resume into ``save_dir/tag`` (default tag
        ``global_step<N>``) atomically; returns that directory. A *tag* that differs across
        ranks is handled as ``checkpoint.tag_validation`` says (checkpoint/tags.py).
        *async_save* (default ``checkpoint.async_save``): written in the background and
        committed later (checkpoint/background.py, :meth:`wait_for_checkpoint`)."""
        from zero_core.checkpoint.save_load import save_checkpoint
        from zero_core.checkpoint.tags import validate_tag
        self._settle(collective=True)
        self.wait_for_checkpoint()  # one save in flight at a time
        if tag is not None:  # the default tag comes from global_steps, equal on every rank
            tag = validate_tag(self.comm, str(tag), self.config.checkpoint.tag_validation)
        in_background = self.config.checkpoint.async_save if async_save is None else async_save
        final = save_checkpoint(self.checkpoint_subject(), save_dir, tag, client_state,
                                save_latest, self._saves.background if in_background else None)
        self._saves.saved(committed=not in_background)
        return final

    def wait_for_checkpoint(self) -> str | None:
        """Collective: wait for the async save in flight and commit it; returns its
        directory (None if none was in flight). A failure of its background writes is
        raised here (or at the step that commits it), on every rank."""
        return self._saves.wait()

    def track_data(self, sampler) -> None:
        """Save *sampler*'s position with every checkpoint (ResumableSampler calls this)."""
        self._saves.track_data(sampler)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False):
        """Collective: load checkpoint *tag* (default: ``latest``), saved with any world size
        and stage; returns ``(checkpoint directory, client_state)``."""
        from zero_core.checkpoint.save_load import load_checkpoint
        self._settle(collective=True)
        self.wait_for_checkpoint()
        return load_checkpoint(self.checkpoint_subject(), load_dir, tag, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)

    def checkpoint_subject(self) -> CheckpointSubject:
        """What the checkpoint procedures see of this engine (no more)."""
        from zero_core.checkpoint.engine_state import refuse_unsupported_optimizer

        def fragments(purpose):
            refuse_unsupported_optimizer(self._rule)
            flat_state = self.optimizer.flat_state if self.optimizer is not None else []
            replicas = self.sharding.replicas
            if purpose == "save" and replicas is not None and replicas.rank > 0:
                return []   # MiCS: the first shard group's copy is the one saved
            return self.parts.checkpoint_fragments(purpose, self.module, flat_state)

        def restored():
            self.parts.checkpoint_restored()
            self.zero_grad()

        def set_counters(global_steps, micro_steps, skipped_steps):
            self.global_steps, self.micro_steps = global_steps, micro_steps
            self.skipped_steps = skipped_steps

        return CheckpointSubject(
            module=self.module, comm=self.comm, device=self.device, rank=self.global_rank,
            world_size=self.world_size, stage=self.stage, engine_name=type(self).__name__,
            compute_dtype=self.compute_dtype, master_dtype=self.master_dtype,
            state_dtype=self.state_dtype,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            loss_scaler=self.loss_scaler, rule=self._rule,
            counters={"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                      "skipped_steps": self.skipped_steps},
            fragments=fragments, restored=restored,
            layout=lambda: self.parts.checkpoint_layout(self.module),
            set_counters=set_counters,
            batch={"train_batch_size": self.config.train_batch_size,
                   "micro_batch": self.config.train_micro_batch_size_per_gpu,
                   "gradient_accumulation_steps": self.gradient_accumulation_steps},
            data_state=self._saves.data_state, restore_data=self._saves.restore_data)
