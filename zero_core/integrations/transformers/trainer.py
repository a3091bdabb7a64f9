"""``ZeroCoreTrainer``: Hugging Face's ``transformers.Trainer`` with training on the
zero-core engine (``pip install 'zero-core[transformers]'``).

Tested with transformers 5.24.0 and accelerate 1.15.0 (the releases in the test extra); it
overrides a few of the Trainer's methods, some private, so other releases are refused at
import unless they still have them (:data:`OVERRIDDEN`).

Usage::

    trainer = ZeroCoreTrainer(model=model, args=TrainingArguments(..., use_cpu=True on CPU),
                              train_dataset=..., zero_config="ds_config.json")
    trainer.train()            # or train(resume_from_checkpoint=...), any world size
    trainer.evaluate(); trainer.predict(ds); trainer.save_model(dir)   # HF layout

Under ``mpirun`` call ``ZeroCoreTrainer.init_distributed(zero_config)`` before creating the
``TrainingArguments`` (accelerate starts torch.distributed there and needs the rendezvous
zero-core's MPI start-up provides). On CPU, ``use_cpu=True`` is what makes accelerate
treat the ranks as one job.

Where the engine comes in (HF's loop itself is not copied; the engine enters where
transformers/accelerate put DeepSpeed):

- ``_prepare_for_training`` (HF: ``deepspeed_init`` + ``accelerator.prepare`` +
  optimizer/scheduler): the config's ``"auto"`` values are filled (auto_values.py) and the
  engine built with ``zero_core.initialize``. Optimizer and scheduler are chosen as
  transformers chooses them for DeepSpeed: the config's ``optimizer`` / ``scheduler``
  sections when present (zero-core builds them), else the Trainer's own
  ``create_optimizer()`` (``args.optim``, HF's weight-decay groups) handed to the engine,
  and ``create_scheduler()`` (``args.lr_scheduler_type``, warmup) over the engine's
  optimizer. ``resume_from_checkpoint`` loads the engine checkpoint here (resharded when
  the world size changed).
- ``train(resume_from_checkpoint=...)`` on another world size: the saved global batch is
  kept by changing ``gradient_accumulation_steps`` before HF's loop counts its steps
  (trainer_config.py, ``resume_accumulation``), so that HF's data skipping lands exactly
  after the samples the checkpoint trained on.
- ``accelerator.backward`` (shadowed on this trainer's accelerator only): the engine's
  backward and step (trainer_engine.py, like accelerate's ``DeepSpeedEngineWrapper``);
  ``optimizer.step()`` / ``lr_scheduler.step()`` become no-ops; ``_clip_grad_norm`` /
  ``_get_grad_norm`` report the engine's global norm (clipping is the config's
  ``gradient_clipping``, filled from ``max_grad_norm``).
- ``_wrap_model``: evaluation and prediction after training run through the engine (at
  stage 3 it gathers the partitions); before training the plain model is used.
- checkpoints at ``save_steps``: ``save_model`` → ``save_pretrained`` (HF's safetensors
  layout, loadable by ``from_pretrained``), ``_save_optimizer_and_scheduler`` →
  ``engine.save_checkpoint`` (optimizer, scheduler, partitions), plus HF's own
  trainer_state.json and RNG files; ``_load_from_checkpoint`` is skipped (the engine
  checkpoint restores the module), ``_load_best_model`` loads the module from the engine
  checkpoint.

Logging is HF's: ``loss`` (averaged over ranks), ``learning_rate`` (the rate of the last
update), ``grad_norm`` (the engine's, before clipping), ``epoch``; callbacks see the same
events as with the plain Trainer.
"""
from __future__ import annotations

import os
import sys

import torch
import transformers
from transformers import Trainer

import zero_core
from zero_core.integrations.transformers.trainer_config import (
    check_world, engine_config, load_zero_config, refuse_unsupported, resume_accumulation,
    start_runtime)
from zero_core.integrations.transformers.trainer_engine import (EngineLoop, EngineOptimizer,
                                                                EngineScheduler, retire_engine)

TESTED_WITH = {"transformers": "5.24.0", "accelerate": "1.15.0"}

# the Trainer methods overridden below; a transformers release without them would run its
# own code there instead (e.g. DDP-wrap the model), so it is refused rather than half-used
OVERRIDDEN = ("_prepare_for_training", "_wrap_model", "_clip_grad_norm", "_get_grad_norm",
              "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
              "_load_from_checkpoint", "_load_best_model", "create_accelerator_and_postprocess",
              "save_model")
_missing = [name for name in OVERRIDDEN if not hasattr(Trainer, name)]
if _missing:
    raise ImportError(f"ZeroCoreTrainer overrides Trainer.{', Trainer.'.join(_missing)}, which "
                      f"transformers {transformers.__version__} does not have; it is tested "
                      f"with transformers {TESTED_WITH['transformers']}")

TRAINING_ARGS_NAME = "training_args.bin"     # what Trainer._save writes next to the model


class ZeroCoreTrainer(Trainer):
    """A ``transformers.Trainer`` that trains on the zero-core engine.

    ``zero_config``: a DeepSpeed-style config dict or JSON path (keyword only; ``"auto"``
    values allowed). Every other argument is ``Trainer``'s; ``optimizers=`` and the
    arguments :func:`~zero_core.integrations.transformers.trainer_config.refuse_unsupported`
    names are refused. See the module docstring for what runs where."""

    @staticmethod
    def init_distributed(zero_config=None):
        """Start zero-core's runtime (the config's ``comm_backend``, ``accelerator``,
        ``comm_timeout``, ``topology``) before the ``TrainingArguments`` exist — needed under
        mpirun, harmless elsewhere. Returns the runtime."""
        config = load_zero_config(zero_config) if zero_config is not None else {}
        return start_runtime(config)

    def __init__(self, model=None, args=None, *trainer_args, zero_config=None, **trainer_kwargs):
        self._zero_raw = load_zero_config(zero_config)
        self._zero_run = self._zero_raw   # the config of the current train() call
        if args is None:
            # what Trainer does without arguments, made here so that they can be checked
            args = transformers.TrainingArguments(output_dir="trainer_output")
        refuse_unsupported(args, trainer_kwargs)
        runtime = start_runtime(self._zero_raw)
        self._engine = None
        self._engine_loop: EngineLoop | None = None
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        check_world(self.args, runtime)

    # ---- properties ----------------------------------------------------------------------
    @property
    def engine(self):
        """The zero-core engine once train() has built it (else None)."""
        return self._engine

    # ---- training ---------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """``Trainer.train``; a checkpoint saved with another global batch (another world
        size) is resumed with the accumulation steps that keep it (see the module docstring)."""
        if resume_from_checkpoint is True:   # HF's meaning: the newest in output_dir
            from transformers.trainer_utils import get_last_checkpoint
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory "
                                 f"({self.args.output_dir})")
        self._zero_run = self._zero_raw
        if resume_from_checkpoint:
            kept = resume_accumulation(self._zero_raw, self.args, str(resume_from_checkpoint))
            if kept is not None:
                accumulation, self._zero_run = kept
                if self.args.process_index == 0:
                    world = self.args.world_size
                    print(f"zero-core: resuming {resume_from_checkpoint} on {world} "
                          f"rank{'s' if world != 1 else ''}: gradient_accumulation_steps "
                          f"{self.args.gradient_accumulation_steps} -> {accumulation} keeps "
                          f"the saved global batch (checkpoint.resume_batch \"keep_global\")",
                          file=sys.stderr, flush=True)
                self.args.gradient_accumulation_steps = accumulation
                self.accelerator.gradient_accumulation_steps = accumulation
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval)

    # ---- the accelerator's backward --------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        plain_backward = self.accelerator.backward

        def backward(loss, **kwargs):
            # the one call in HF's training_step that hands the loss to the backend
            if self._engine_loop is None:
                return plain_backward(loss, **kwargs)
            self._engine_loop.backward(loss, self.accelerator.sync_gradients)
        self.accelerator.backward = backward

    # ---- building the engine ---------------------------------------------------------------
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        # a second train(): continue from the trained weights with a new engine
        retire_engine(self._engine, self.model)
        self._engine = self._engine_loop = None
        self.model_wrapped = self.model
        if self._created_lr_scheduler:  # as HF: a scheduler made for an earlier run goes
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self._build_engine(max_steps)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self._engine, train_dataloader

    def _build_engine(self, max_steps: int) -> None:
        config = engine_config(self._zero_run, self.args, self.model, max_steps)
        optimizer = lr_scheduler = None
        if "optimizer" not in config:
            # transformers' choice under DeepSpeed: the Trainer's own optimizer
            self.optimizer = None
            optimizer = self.create_optimizer()
        if "scheduler" not in config:
            def make_scheduler(engine_optimizer):
                self.lr_scheduler = None
                return self.create_scheduler(num_training_steps=max_steps,
                                             optimizer=engine_optimizer)
            lr_scheduler = make_scheduler   # the engine calls it with its own optimizer
        engine, _, _, _ = zero_core.initialize(model=self.model, optimizer=optimizer,
                                               config=config, lr_scheduler=lr_scheduler)
        self._engine = engine
        if self.args.torch_compile:  # the engine compiles block by block (engine/compile.py)
            mode = self.args.torch_compile_mode
            engine.compile(backend=self.args.torch_compile_backend or "inductor",
                           compile_kwargs={"mode": mode} if mode else None)
        self._engine_loop = EngineLoop(engine)
        self.model_wrapped = engine
        self.optimizer = EngineOptimizer(engine)
        self.lr_scheduler = EngineScheduler(self._engine_loop)

    def _wrap_model(self, model, training=True, dataloader=None):
        if self._engine is not None and model in (self._engine, self._engine.module):
            return self._engine
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    # ---- gradient norm -------------------------------------------------------------------
    def _clip_grad_norm(self, model):
        if self._engine_loop is None:
            return super()._clip_grad_norm(model)
        return self._engine_loop.grad_norm()   # the engine clipped inside its step

    def _get_grad_norm(self, model, grad_norm=None):
        if self._engine_loop is None:
            return super()._get_grad_norm(model, grad_norm)
        return grad_norm if grad_norm is not None else self._engine_loop.grad_norm()

    # ---- checkpoints and saving ----------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # collective: partitions, optimizer and scheduler states, resharded on load
        self._engine.save_checkpoint(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if self._engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        self._engine.load_checkpoint(checkpoint)
        self._engine_loop.last_lrs = list(self._engine.get_lr())

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        # HF calls this before the engine exists, to load model.safetensors into the plain
        # model; the engine checkpoint (loaded once the engine is built) restores the
        # module, so that first read would only be thrown away
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}")

    def _load_best_model(self) -> None:
        if self._engine is None:
            return super()._load_best_model()
        self._engine.load_checkpoint(self.state.best_model_checkpoint, load_module_only=True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model in Hugging Face's layout (config.json + safetensors, loadable by
        ``from_pretrained``). Collective once training has built the engine: every rank
        calls it (as the Trainer's checkpointing does); rank 0 writes."""
        if self._engine is None:
            return super().save_model(output_dir, _internal_call)
        from zero_core.integrations.transformers.pretrained import save_pretrained
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_pretrained(self._engine, output_dir)
        if self.args.should_save:
            # what Trainer._save writes next to the weights
            processor = self.processing_class
            if processor is None:
                processor = getattr(self.data_collator, "tokenizer", None)
            if processor is not None:
                processor.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
