"""What ``ZeroCoreTrainer`` (trainer.py) hands the engine: its ``zero_config`` read, the
Trainer features it cannot serve refused, and the config completed from the
``TrainingArguments`` so that the engine and the Trainer's loop agree.

- :func:`load_zero_config`: a dict or the path of a JSON file, copied.
- :func:`refuse_unsupported`: one :class:`UnsupportedTrainerFeature` naming each Trainer
  argument that would bring its own distributed machinery (DeepSpeed, FSDP,
  torch.compile, ...) or that the engine cannot follow.
- :func:`start_runtime`: zero-core's runtime, with the config's runtime keys.
- :func:`engine_config`: ``"auto"`` values filled (auto_values.py), then the keys the
  Trainer's loop decides, where the config leaves them out, set from the arguments
  (transformers leaves them out and DeepSpeed falls back to its defaults: a config
  without ``gradient_accumulation_steps`` would then step every micro-batch while the
  Trainer accumulates).
- :func:`resume_accumulation`: the accumulation steps that keep a checkpoint's global
  batch when it is resumed on another world size (below).

Resuming on another world size. HF's loop finds where to go on in the data from the
saved ``global_step`` alone: ``global_step // updates per epoch`` epochs done, then
``global_step % updates per epoch`` optimizer steps of the epoch skipped
(``skip_first_batches``). The sampling order is one global order per epoch, the same on
any world size (accelerate's seedable sampler, seeded by ``data_seed``/``seed`` plus the
epoch, cut into micro-batches of which rank r reads r, r+W, ...), so one optimizer step
consumes the next ``per_device_train_batch_size x gradient_accumulation_steps x world
size`` samples of it. The skip is therefore exact only when that global batch is the
saved one: resumed with a smaller one (2 ranks -> 1 with the same arguments) the samples
of the last saved steps are trained again and the run takes more, smaller steps than the
schedule restored from the checkpoint was made for. So, as the engine's own resume does
(``checkpoint.resume_batch`` "keep_global", the default), the global batch is kept by
changing ``gradient_accumulation_steps``; "keep_micro" (train on with a smaller global
batch) is refused here, since HF's step counters cannot express it.
"""
from __future__ import annotations

import copy
import os

from zero_core.checkpoint import store
from zero_core.checkpoint.resume import accumulation_keeping, saved_global_batch
from zero_core.config import read_config
from zero_core.errors import ConfigError
from zero_core.integrations.transformers.auto_values import fill_auto_values, trainer_clipping


class UnsupportedTrainerFeature(ConfigError):
    """A TrainingArguments/Trainer option ZeroCoreTrainer does not serve (which, and what
    to do instead)."""


class TrainerConfigConflict(ConfigError):
    """The zero-core config and the TrainingArguments/Trainer disagree on something the
    engine and the Trainer's loop must agree on."""


def load_zero_config(zero_config) -> dict:
    """A private copy of *zero_config*: a dict, or the path of a JSON file."""
    if zero_config is None:
        raise ConfigError("ZeroCoreTrainer needs zero_config=: a DeepSpeed-style config dict "
                          "or the path of a JSON file (\"auto\" values are filled from the "
                          "TrainingArguments)")
    return read_config(zero_config)


def refuse_unsupported(args, trainer_kwargs: dict) -> None:
    """Raise one UnsupportedTrainerFeature listing every option of *args* (and of the
    Trainer's own keyword arguments) that ZeroCoreTrainer cannot serve."""
    found = []
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None \
            or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        found.append("TrainingArguments.deepspeed (or ACCELERATE_USE_DEEPSPEED): DeepSpeed and "
                     "zero-core would both partition the model; give the DeepSpeed config as "
                     "zero_config= and drop deepspeed=")
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_config", None) \
            or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        found.append("TrainingArguments.fsdp / fsdp_config (or ACCELERATE_USE_FSDP): FSDP is "
                     "another sharding engine; use zero_optimization.stage 3 instead")
    if getattr(args, "parallelism_config", None) is not None:
        found.append("TrainingArguments.parallelism_config (tensor/context/sequence "
                     "parallelism): zero-core is data parallel only")
    if getattr(args, "auto_find_batch_size", False):
        found.append("TrainingArguments.auto_find_batch_size: the engine's micro batch is "
                     "fixed at initialization; set per_device_train_batch_size")
    if getattr(args, "n_gpu", 0) > 1:
        found.append(f"{args.n_gpu} GPUs in one process (torch.nn.DataParallel): launch one "
                     f"process per device (torchrun or mpirun)")
    if getattr(args, "push_to_hub", False):
        found.append("TrainingArguments.push_to_hub: not supported; push the directory "
                     "save_model() writes yourself")
    if getattr(args, "label_smoothing_factor", 0.0):
        # HF's compute_loss decides whether to shift labels from the unwrapped model's class
        # name; through the engine it would see the engine's and skip the causal-LM shift
        found.append("TrainingArguments.label_smoothing_factor: not supported yet (the "
                     "label shift for causal LMs would be skipped); set it to 0 or smooth in "
                     "your own compute_loss")
    if trainer_kwargs.get("optimizers") not in (None, (None, None)):
        found.append("Trainer(optimizers=...): the engine builds the optimizer over its "
                     "partitions; put it in the config's 'optimizer'/'scheduler' sections, "
                     "or subclass and override create_optimizer/create_scheduler (called "
                     "without those sections)")
    if found:
        raise UnsupportedTrainerFeature("ZeroCoreTrainer cannot run with:\n"
                                        + "\n".join(f"  - {f}" for f in found))


def start_runtime(config: dict):
    """zero-core's runtime with the config's runtime keys (idempotent; init_distributed
    refuses a conflict with a runtime already started differently)."""
    from zero_core.runtime.context import init_distributed
    topology = config.get("topology") or {}
    return init_distributed(config.get("accelerator"), config.get("comm_backend"),
                            config.get("comm_timeout"), topology.get("ranks_per_node"))


def check_world(args, runtime) -> None:
    """The Trainer (through accelerate) and the engine must see the same ranks: otherwise
    every rank would read the whole data set while the engine averages gradients."""
    if args.world_size != runtime.world_size:
        hint = (" On CPU, accelerate treats the processes as one job only with "
                "TrainingArguments(use_cpu=True)." if runtime.device.type == "cpu" else "")
        raise TrainerConfigConflict(
            f"TrainingArguments see world size {args.world_size} but zero-core runs on "
            f"{runtime.world_size} ranks.{hint} Under mpirun, start zero-core first "
            f"(ZeroCoreTrainer.init_distributed(zero_config)) before creating the "
            f"TrainingArguments, so that accelerate joins its process group.")


def engine_config(raw: dict, args, model, num_training_steps: int) -> dict:
    """The config the engine is built from: *raw* with its "auto" values filled and the
    keys the Trainer's loop decides completed from *args* (see the module docstring)."""
    config = fill_auto_values(raw, args, model=model, num_training_steps=num_training_steps)
    config.setdefault("train_micro_batch_size_per_gpu", args.per_device_train_batch_size)
    config.setdefault("gradient_accumulation_steps", args.gradient_accumulation_steps)
    config.setdefault("gradient_clipping", trainer_clipping(args))
    # accelerate's DeepSpeed plugin adds these sections from the Trainer's mixed precision
    for section, wanted in (("fp16", bool(args.fp16)), ("bf16", bool(args.bf16))):
        if wanted and section not in config and not (section == "bf16" and "bfloat16" in config):
            config[section] = {"enabled": True}
    _check_agreement(config, args)
    return config


def _check_agreement(config: dict, args) -> None:
    """Values the Trainer's loop relies on that fill_auto_values does not compare because
    they were derived rather than written (a train_batch_size alone implies the rest)."""
    micro = config["train_micro_batch_size_per_gpu"]
    accum = config["gradient_accumulation_steps"]
    wrong = []
    if micro != args.per_device_train_batch_size:
        wrong.append(f"train_micro_batch_size_per_gpu={micro} vs per_device_train_batch_size="
                     f"{args.per_device_train_batch_size}")
    if accum != args.gradient_accumulation_steps:
        wrong.append(f"gradient_accumulation_steps={accum} vs TrainingArguments "
                     f"gradient_accumulation_steps={args.gradient_accumulation_steps}")
    total = config.get("train_batch_size")
    if total is not None and total != micro * accum * args.world_size:
        wrong.append(f"train_batch_size={total} vs world_size*per_device_train_batch_size*"
                     f"gradient_accumulation_steps={micro * accum * args.world_size}")
    if wrong:
        raise TrainerConfigConflict("the zero-core config and the TrainingArguments disagree:\n"
                                    + "\n".join(f"  - {w}" for w in wrong)
                                    + "\nSet these config values to \"auto\" or drop them.")


def resume_accumulation(raw: dict, args, checkpoint: str) -> tuple[int, dict] | None:
    """``(gradient_accumulation_steps, config)`` that keep the global batch the engine
    checkpoint in *checkpoint* (an HF ``checkpoint-N`` folder) was trained with, when
    *args* (``per_device_train_batch_size x gradient_accumulation_steps x world_size``)
    give another one; None when they agree or the folder holds no engine checkpoint (the
    load reports that). *config* is *raw* with an explicit ``gradient_accumulation_steps``
    changed to match. Raises :class:`TrainerConfigConflict` when the saved batch cannot be
    kept (see the module docstring)."""
    if not os.path.exists(os.path.join(checkpoint, store.LATEST)):
        return None
    _, meta = store.read_metadata(checkpoint)
    saved = saved_global_batch(meta)
    micro, world = args.per_device_train_batch_size, args.world_size
    now = micro * args.gradient_accumulation_steps * world
    if saved is None or saved == now:
        return None
    where = (f"resuming {checkpoint} (global batch {saved}, saved by {meta.get('world_size')} "
             f"ranks) on {world} rank{'s' if world != 1 else ''} with global batch {now} "
             f"(per_device_train_batch_size {micro} x gradient_accumulation_steps "
             f"{args.gradient_accumulation_steps} x world size {world})")
    mode = (raw.get("checkpoint") or {}).get("resume_batch", "keep_global")
    if mode == "keep_micro":
        raise TrainerConfigConflict(
            f"{where}: checkpoint.resume_batch \"keep_micro\" is not supported by "
            f"ZeroCoreTrainer: HF's Trainer counts the data already trained on in optimizer "
            f"steps of the saved size, so samples of the interrupted epoch would be trained "
            f"twice or skipped. Use \"keep_global\" (the default) or arguments whose global "
            f"batch is {saved}")
    accumulation = accumulation_keeping(saved, micro, world)
    if accumulation is None:
        raise TrainerConfigConflict(
            f"{where}: keeping the global batch needs per_device_train_batch_size x world "
            f"size = {micro} x {world} to divide {saved}; choose a "
            f"per_device_train_batch_size that does (or a world size that does)")
    config = copy.deepcopy(raw)
    value = config.get("gradient_accumulation_steps")
    if value is not None and value != "auto":
        config["gradient_accumulation_steps"] = accumulation
    return accumulation, config
