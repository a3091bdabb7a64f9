"""The zero-core engine seen through the three handles the HF Trainer's loop drives: the
backward call, ``trainer.optimizer`` and ``trainer.lr_scheduler``.

The Trainer's loop (transformers 5.24 ``Trainer._run_epoch``) does, per micro-batch,
``accelerator.backward(loss)`` and, at its accumulation boundary, clip → ``optimizer.step()``
→ read the learning rate → ``lr_scheduler.step()`` → ``model.zero_grad()``. Under DeepSpeed,
accelerate's ``DeepSpeedEngineWrapper`` turns the backward call into the engine's
backward + step and makes the optimizer/scheduler steps no-ops; :class:`EngineLoop` does
the same for zero-core's engine:

- :meth:`EngineLoop.backward` undoes the engine's own ``1/gradient_accumulation_steps``
  (the Trainer has already scaled the loss for accumulation, or normalized it by the
  token count of the whole accumulated batch — as transformers tells DeepSpeed with
  ``scale_wrt_gas=False``), runs the engine's backward and ``step()`` (which updates at
  boundaries, clipping and stepping the scheduler inside), and keeps the engine's
  boundary on the Trainer's: at an epoch's end the Trainer closes a shorter window.
- :class:`EngineOptimizer` / :class:`EngineScheduler`: ``step()`` does nothing (the engine
  already did); ``get_last_lr()`` is the rate the last update used — what the plain
  Trainer logs as ``learning_rate`` (it reads it before stepping its scheduler) —
  state dicts are the engine's optimizer's / scheduler's.
"""
from __future__ import annotations

import torch

from zero_core.errors import ZeroCoreError


class EngineLoop:
    """Drives one engine from the Trainer's per-micro-batch calls."""

    def __init__(self, engine):
        self.engine = engine
        # the rates the last optimizer update used (before any: the current ones)
        self.last_lrs = list(engine.get_lr())

    def backward(self, loss: torch.Tensor, sync_gradients: bool) -> None:
        engine = self.engine
        self._align_boundary(sync_gradients)
        if sync_gradients:
            self.last_lrs = list(engine.get_lr())
        # the engine divides by its gradient_accumulation_steps; the Trainer's loss is
        # already scaled for accumulation
        engine.backward(loss * engine.gradient_accumulation_steps)
        engine.step()

    def _align_boundary(self, sync_gradients: bool) -> None:
        """Make the engine's next step() an update exactly when the Trainer's loop closes
        its accumulation window (the micro-step counter is where both DeepSpeed's and
        zero-core's boundary is read from; DeepSpeed offers set_gradient_accumulation_boundary
        for the same purpose)."""
        engine = self.engine
        at_boundary = engine.is_gradient_accumulation_boundary()
        if sync_gradients and not at_boundary:
            # a short last window of the epoch: jump to its final micro-step
            gas = engine.gradient_accumulation_steps
            engine.micro_steps += gas - 1 - engine.micro_steps % gas
        elif at_boundary and not sync_gradients:
            raise ZeroCoreError(
                f"the Trainer accumulates more micro-batches than the engine's "
                f"gradient_accumulation_steps={engine.gradient_accumulation_steps}: the config "
                f"and TrainingArguments.gradient_accumulation_steps must agree")

    def grad_norm(self):
        """The global gradient norm of the last update (before clipping), as the Trainer
        logs it; None before the first update. A device tensor: the Trainer reads it
        (``.item()``) only when it logs, so other steps do not wait for the device."""
        return self.engine.global_grad_norm_tensor()


class EngineOptimizer:
    """``trainer.optimizer`` while the engine trains: its update runs inside the backward
    call (EngineLoop), so ``step``/``zero_grad`` do nothing here. ``param_groups`` and the
    state dicts are the engine optimizer's (callbacks read the former)."""

    def __init__(self, engine):
        self.engine = engine
        self.optimizer = engine.optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        if closure is not None:
            raise ZeroCoreError("ZeroCoreTrainer's optimizer steps inside the engine; a "
                                "closure cannot be re-evaluated there")
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        # the engine's checkpoint (engine.load_checkpoint) is the way its partitions are
        # restored; a bare optimizer state dict cannot be resharded
        raise ZeroCoreError("load the optimizer through the engine's checkpoint "
                            "(train(resume_from_checkpoint=...)), not load_state_dict")

    def __repr__(self):
        return f"EngineOptimizer({self.optimizer!r})"


class EngineScheduler:
    """``trainer.lr_scheduler`` while the engine trains: the engine steps its scheduler
    after each update, so ``step`` does nothing; ``get_last_lr`` is the rate the last update
    used (see the module docstring)."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.scheduler = loop.engine.lr_scheduler

    def step(self, *args, **kwargs) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return list(self.loop.last_lrs)

    def state_dict(self):
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state):
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)

    def __repr__(self):
        return f"EngineScheduler({self.scheduler!r})"


def retire_engine(engine, model) -> None:
    """Before a second ``train()`` builds its engine: the earlier *engine* lets go of
    *model* (``engine.hand_back_model``). At stage 3 it holds the model's only values (its
    partitions), so it hands the model back partitioned as ``zero_core.Init`` leaves it,
    from its fp32 master, and the new engine adopts those partitions; below stage 3 the
    parameters hold the values and only the engine's hooks are removed. The
    new engine then gets a new optimizer and scheduler, as transformers' DeepSpeed
    integration does (``deepspeed_init`` drops ``trainer.optimizer``)."""
    if engine is None:
        return
    if engine.module is model:
        engine.hand_back_model()
    else:
        engine.destroy()   # another model (model_init=): the old one is dropped
