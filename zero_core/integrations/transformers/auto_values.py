"""Hugging Face's ``"auto"`` config values: filled from ``TrainingArguments`` and the model.

Owns :func:`fill_auto_values`. DeepSpeed configs written for the HF ``Trainer`` say
``"auto"`` where the Trainer is to put its own value; transformers does it in
``HfTrainerDeepSpeedConfig.trainer_config_process`` (when the ``TrainingArguments`` are made)
and ``trainer_config_finalize`` (once the model and the number of steps are known), and
accelerate's ``DeepSpeedPlugin`` (which the Trainer runs through) fills a few more with its
defaults. The facts below are read from transformers 5.24.0 and accelerate 1.15.0:

=====================================================  ==========================================
key                                                     value (``TrainingArguments`` field)
=====================================================  ==========================================
train_micro_batch_size_per_gpu                          per_device_train_batch_size
gradient_accumulation_steps                             gradient_accumulation_steps
train_batch_size                                        world_size × micro batch × accumulation
gradient_clipping                                       max_grad_norm (None or <= 0: 0.0, off)
optimizer.params.lr / betas / eps / weight_decay        learning_rate / [adam_beta1, adam_beta2] /
                                                        adam_epsilon / weight_decay
scheduler.params.warmup_min_lr                          0 (never compared)
scheduler.params.warmup_max_lr                          learning_rate
scheduler.params.total_num_steps                        num_training_steps
scheduler.params.warmup_num_steps                       max(1, get_warmup_steps(num_training_steps))
fp16.enabled / bf16.enabled                             fp16 or fp16_full_eval / bf16 or bf16_full_eval
zero_optimization.reduce_bucket_size                    hidden²  (model.config)
zero_optimization.stage3_prefetch_bucket_size           int(0.9 · hidden²), stage 3 only
zero_optimization.stage3_param_persistence_threshold    10 · hidden, stage 3 only
zero_optimization.stage                                 2 (accelerate's default)
zero_optimization.offload_*.device / nvme_path          "none" (accelerate's default)
zero_optimization.stage3_gather_16bit_weights_on_...    False (accelerate's default)
=====================================================  ==========================================

``hidden`` is ``model.config.hidden_size``, else the largest of ``hidden_sizes``, else the
same in ``model.config.text_config``. As in transformers, a value that is *not* ``"auto"``
is compared with the argument it would have been filled from (every row above except
warmup_min_lr, the hidden-size rows and accelerate's rows); every disagreement is listed in
one :class:`AutoValueMismatchError`. Where zero-core goes beyond transformers it says so:
``bfloat16.enabled`` (DeepSpeed's other name for the bf16 section, which transformers leaves
``"auto"`` and DeepSpeed would then refuse) is filled like ``bf16.enabled``, and an
``"auto"`` that cannot be filled — no model hidden size, no number of steps, a stage-3 key
in a stage 0-2 config, a key transformers never fills — is an
:class:`UnfillableAutoError` naming the key and the fix, not a string left for the engine
to trip over.

Only attributes are read from *args*, so anything carrying the fields named above works
(the config corpus test passes a ``SimpleNamespace``); ``transformers`` is not imported.
"""
from __future__ import annotations

import copy
import math

from zero_core.errors import ConfigError

AUTO = "auto"

# transformers' trainer_config_finalize: keys filled from the model's hidden size
_HIDDEN_KEYS = ("zero_optimization.reduce_bucket_size",
                "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.stage3_param_persistence_threshold")
_STAGE3_ONLY = _HIDDEN_KEYS[1:]

# accelerate's DeepSpeedPlugin, built by TrainingArguments without plugin arguments: these
# "auto"s become the plugin's defaults (never compared: must_match=False there)
_ACCELERATE_DEFAULTS = {
    "zero_optimization.stage": 2,
    "zero_optimization.offload_optimizer.device": "none",
    "zero_optimization.offload_param.device": "none",
    "zero_optimization.offload_optimizer.nvme_path": "none",
    "zero_optimization.offload_param.nvme_path": "none",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
}


class AutoValueMismatchError(ConfigError):
    """A config value that is not "auto" disagrees with the TrainingArguments value it
    stands for (transformers raises the same finding as a ValueError)."""


class UnfillableAutoError(ConfigError):
    """An "auto" that nothing given can fill (which key, and what to pass or write)."""


class _Filler:
    """One pass over a copy of the config: fills, and records mismatches and unfillable keys."""

    def __init__(self, config: dict):
        self.config = config
        self.mismatches: list[str] = []
        self.unfillable: list[str] = []

    def node(self, dotted: str):
        """(parent dict, last key) of *dotted*, or (None, None) when a section on the way is
        missing: like transformers, a missing section is never created."""
        *sections, key = dotted.split(".")
        node = self.config
        for section in sections:
            node = node.get(section)
            if not isinstance(node, dict):
                return None, None
        return node, key

    def get(self, dotted: str):
        parent, key = self.node(dotted)
        return None if parent is None else parent.get(key)

    def is_auto(self, dotted: str) -> bool:
        return self.get(dotted) == AUTO

    def fill(self, dotted: str, value, arg_name: str | None = None) -> None:
        """Replace "auto" at *dotted* by *value*; with *arg_name*, a present value that is
        not "auto" must equal *value* (transformers' fill_match), else it is recorded."""
        parent, key = self.node(dotted)
        if parent is None:
            return
        current = parent.get(key)
        if current == AUTO:
            parent[key] = value
        elif arg_name is not None and current is not None and current != value:
            self.mismatches.append(f"  - config {dotted}={current!r} vs TrainingArguments "
                                   f"{arg_name}={value!r}")

    def cannot_fill(self, dotted: str, fix: str) -> None:
        if self.is_auto(dotted):
            self.unfillable.append(f"  - {dotted}: {fix}")


def fill_auto_values(config: dict, args, model=None, num_training_steps: int | None = None) -> dict:
    """A new config dict: *config* with every ``"auto"`` replaced as the HF Trainer replaces
    it (see the module docstring for each key's value), from *args* (``TrainingArguments``
    or any object with its fields), *model* (whose ``config`` gives the hidden size) and
    *num_training_steps* (the optimizer steps of the whole run; the Trainer's
    ``max_steps``). *config* itself is not changed.

    Raises :class:`UnfillableAutoError` for an ``"auto"`` nothing given can fill and
    :class:`AutoValueMismatchError` listing every explicit value that contradicts *args*
    (both are :class:`~zero_core.errors.ConfigError`)."""
    if not isinstance(config, dict):
        raise ConfigError(f"fill_auto_values needs the config as a dict, got "
                          f"{type(config).__name__}; load a JSON file with json.load first")
    f = _Filler(copy.deepcopy(config))
    _fill_from_arguments(f, args)
    _fill_accelerate_defaults(f)
    _fill_from_model(f, model)
    _fill_from_steps(f, args, num_training_steps)
    _report_leftovers(f)
    if f.unfillable:
        extra = ("\nAlso, these values contradict TrainingArguments:\n" + "\n".join(f.mismatches)
                 if f.mismatches else "")
        raise UnfillableAutoError("these \"auto\" config values cannot be filled:\n"
                                  + "\n".join(f.unfillable) + extra)
    if f.mismatches:
        raise AutoValueMismatchError(
            "these config values contradict the TrainingArguments (the Trainer would run "
            "with one value and the engine with the other):\n" + "\n".join(f.mismatches)
            + "\nSet them to \"auto\" (filled from TrainingArguments), or change the "
              "TrainingArguments to agree.")
    return f.config


def trainer_clipping(args) -> float:
    """The HF Trainer's clipping as a ``gradient_clipping`` value: ``max_grad_norm``, where
    None or <= 0 (the Trainer's "do not clip") is written 0.0, as DeepSpeed's (and so
    zero-core's) default for an absent key is 1.0."""
    norm = args.max_grad_norm
    return float(norm) if norm is not None and norm > 0 else 0.0


def _fill_from_arguments(f: _Filler, args) -> None:
    """transformers' trainer_config_process: what TrainingArguments alone decide."""
    micro = args.per_device_train_batch_size
    accumulation = args.gradient_accumulation_steps
    # auto_find_batch_size changes the micro batch as it goes: transformers then fills the
    # batch keys without comparing them
    batch_checked = not getattr(args, "auto_find_batch_size", False)
    f.fill("train_micro_batch_size_per_gpu", micro,
           "per_device_train_batch_size" if batch_checked else None)
    f.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    f.fill("train_batch_size", args.world_size * micro * accumulation,
           "world_size*per_device_train_batch_size*gradient_accumulation_steps"
           if batch_checked else None)
    f.fill("gradient_clipping", trainer_clipping(args), "max_grad_norm")
    f.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]")
    f.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0)       # not a Trainer argument: never compared
    f.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if getattr(args, "save_on_each_node", False):
        # transformers: DeepSpeed assumes shared storage unless told otherwise
        f.config.setdefault("checkpoint", {})["use_node_local_storage"] = True
    fp16 = bool(args.fp16 or getattr(args, "fp16_full_eval", False))
    bf16 = bool(args.bf16 or getattr(args, "bf16_full_eval", False))
    f.fill("fp16.enabled", fp16, "fp16|fp16_full_eval")
    f.fill("bf16.enabled", bf16, "bf16|bf16_full_eval")
    # beyond transformers: DeepSpeed reads the bf16 section under this name too
    f.fill("bfloat16.enabled", bf16, "bf16|bf16_full_eval")


def _fill_accelerate_defaults(f: _Filler) -> None:
    for dotted, value in _ACCELERATE_DEFAULTS.items():
        f.fill(dotted, value)


def hidden_size_of(model) -> int | None:
    """The hidden size transformers reads from ``model.config`` for the bucket sizes."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None) is not None:
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


def _fill_from_model(f: _Filler, model) -> None:
    """transformers' trainer_config_finalize, first half: bucket sizes from the hidden size."""
    autos = [k for k in _HIDDEN_KEYS if f.is_auto(k)]
    if not autos:
        return
    stage3 = f.get("zero_optimization.stage") == 3
    if not stage3:
        # transformers fills these two only at stage 3 and leaves the string otherwise
        for key in _STAGE3_ONLY:
            f.cannot_fill(key, f"\"auto\" is filled only at ZeRO stage 3 (this config has "
                               f"stage {f.get('zero_optimization.stage')!r}); remove the key "
                               f"or give a number")
    hidden = hidden_size_of(model)
    if hidden is None:
        why = ("no model was given" if model is None else
               f"{type(model).__name__}.config has neither hidden_size nor hidden_sizes")
        for key in autos:
            if stage3 or key not in _STAGE3_ONLY:
                f.cannot_fill(key, f"filled from the model's hidden size, but {why}; pass "
                                   f"model= or write a number (transformers uses hidden², "
                                   f"0.9·hidden², 10·hidden)")
        return
    f.fill("zero_optimization.reduce_bucket_size", hidden * hidden)
    if stage3:
        f.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
        f.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)


def warmup_steps_of(args, num_training_steps: int | None) -> int | None:
    """``TrainingArguments.get_warmup_steps``: warmup_steps ≥ 1 is a count, below 1 a
    fraction of the run (None when that fraction has no run length to apply to)."""
    warmup = getattr(args, "warmup_steps", 0) or 0
    if warmup >= 1:
        return int(warmup)
    if num_training_steps is None:
        return None
    if hasattr(args, "get_warmup_steps"):
        return int(args.get_warmup_steps(num_training_steps))
    return math.ceil(num_training_steps * warmup)


def _fill_from_steps(f: _Filler, args, num_training_steps: int | None) -> None:
    """trainer_config_finalize, second half: the scheduler's run length and warmup."""
    if num_training_steps is None:
        f.cannot_fill("scheduler.params.total_num_steps",
                      "filled from the number of optimizer steps of the run; pass "
                      "num_training_steps= (the Trainer passes its max_steps) or write a number")
    else:
        f.fill("scheduler.params.total_num_steps", num_training_steps,
               "num_training_steps (calculated)")
    warmup = warmup_steps_of(args, num_training_steps)
    if warmup is None:
        f.cannot_fill("scheduler.params.warmup_num_steps",
                      f"warmup_steps={args.warmup_steps} is a fraction of the run, whose length "
                      f"is unknown; pass num_training_steps= or write a number")
        return
    # transformers keeps it at least 1: DeepSpeed >= 0.19.6 refuses a warmup of 0 steps
    f.fill("scheduler.params.warmup_num_steps", max(1, warmup), "warmup_steps")


def _report_leftovers(f: _Filler) -> None:
    """Any other "auto" is one transformers does not fill either (DeepSpeed would get the
    string): name it here rather than let the engine's type checks find it."""
    named = {line.split(":")[0].strip(" -") for line in f.unfillable}

    def walk(node, path):
        for key, value in node.items():
            dotted = f"{path}{key}"
            if isinstance(value, dict):
                walk(value, dotted + ".")
            elif value == AUTO and dotted not in named:
                f.unfillable.append(f"  - {dotted}: transformers does not fill this key from "
                                    f"anything; write its value")
    walk(f.config, "")
