"""DeepSpeed-compatible training configuration, validated once into frozen dataclasses.

``parse_config(config, world_size)`` takes a dict, a path to a JSON file, an existing
:class:`Config` or ``None`` (all defaults) and returns a :class:`Config`. Every problem is a
:class:`~zero_core.errors.ConfigError` that names the key (dotted path), the value and what
would be valid. Nothing is silently defaulted or ignored:

* an unknown key is refused, with a "did you mean" suggestion;
* a key that DeepSpeed has but zero-core does not implement yet is refused *by name*
  (see ``NOT_YET_IMPLEMENTED``); the one exception is a value that asks for exactly what
  zero-core already does, i.e. the feature switched off (``NEUTRAL_VALUES``, e.g.
  ``"fp16": {"auto_cast": false}`` or ``"tensorboard": {"enabled": false}``);
* Hugging Face's ``"auto"`` placeholders are refused (the HF Trainer fills them in before
  DeepSpeed sees the config; zero-core needs the concrete number).

Supported keys
--------------

================================================================  ============  ==========================================
key                                                               default       meaning / valid values
================================================================  ============  ==========================================
train_batch_size                                                  derived       micro × accumulation × world size
train_micro_batch_size_per_gpu                                    derived / 1   samples per rank per forward
gradient_accumulation_steps                                       derived / 1   micro-batches per optimizer step
gradient_clipping                                                 0.0           max global L2 grad norm; 0 = off
steps_per_print                                                   10            integer >= 1
wall_clock_breakdown                                              false         bool
zero_allow_untested_optimizer                                     false         bool; accepted, no effect (the engine
                                                                                checks client optimizers itself)
fp16.enabled                                                      false         bool (not together with bf16)
fp16.loss_scale                                                   0.0           0 = dynamic, > 0 = static scale
fp16.initial_scale_power                                          16            dynamic scale starts at 2**power
fp16.loss_scale_window                                            1000          good steps before the scale doubles
fp16.hysteresis                                                   2             overflows absorbed before halving
fp16.consecutive_hysteresis                                       false         refill hysteresis on each good step
fp16.min_loss_scale                                               1.0           > 0, floor of the dynamic scale
bf16.enabled (also spelled ``bfloat16``)                          false         bool
optimizer.type                                                    required      Adam | AdamW | SGD (any case)
optimizer.params.lr                                               1e-3          >= 0
optimizer.params.betas (Adam, AdamW)                              [0.9, 0.999]  two numbers in [0, 1)
optimizer.params.eps (Adam, AdamW)                                1e-8          > 0
optimizer.params.weight_decay                                     0.0           >= 0
optimizer.params.adam_w_mode (Adam, AdamW)                        true          decoupled decay; DeepSpeed's default
                                                                                for "Adam" too; false is refused for AdamW
optimizer.params.bias_correction (Adam, AdamW)                    true          bool
optimizer.params.torch_adam (Adam, AdamW)                         false         accepted, no effect
optimizer.params.momentum (SGD)                                   0.0           >= 0
optimizer.params.dampening (SGD)                                  0.0           >= 0
optimizer.params.nesterov (SGD)                                   false         needs momentum > 0, dampening 0
scheduler.type                                                    required      WarmupLR | WarmupDecayLR | WarmupCosineLR
scheduler.params.warmup_min_lr (WarmupLR, WarmupDecayLR)          0.0           lr at the start; number or list
scheduler.params.warmup_max_lr (WarmupLR)                         optimizer lr  lr after warmup; number or list
scheduler.params.warmup_max_lr (WarmupDecayLR)                    0.001         lr after warmup; number or list
scheduler.params.warmup_num_steps                                 1000          >= 1 (at least 2 are used)
scheduler.params.warmup_type                                      "log"         "log" | "linear"
scheduler.params.total_num_steps (WarmupDecayLR, WarmupCosineLR)  required      >= 1
scheduler.params.warmup_min_ratio (WarmupCosineLR)                0.0           in [0, 1], × optimizer lr
scheduler.params.cos_min_ratio (WarmupCosineLR)                   1e-4          in [0, 1], × optimizer lr
scheduler.params.last_batch_iteration                             -1            >= -1 (resume position)
zero_optimization.stage                                           0             0, 1, 2 or 3
zero_optimization.reduce_bucket_size                              5e6           elements, >= 1
zero_optimization.allgather_bucket_size                           5e8           elements, >= 1
zero_optimization.overlap_comm                                    true          bool
zero_optimization.contiguous_gradients                            true          bool
zero_optimization.reduce_scatter                                  true          bool
zero_optimization.stage3_prefetch_bucket_size                     5e7           elements gathered ahead of use, >= 0
zero_optimization.stage3_param_persistence_threshold              1e5           parameters with fewer elements stay
                                                                                gathered until the next step, >= 0
zero_optimization.stage3_max_live_parameters                      1e9           elements gathered at once, >= 1
zero_optimization.stage3_max_reuse_distance                       1e9           keep a parameter gathered if it is used
                                                                                again within this many elements, >= 0
zero_optimization.stage3_gather_16bit_weights_on_model_save       false         bool; save_16bit_model() gathers
zero_optimization.prefetch_bucket_size                                          = stage3_prefetch_bucket_size
zero_optimization.param_persistence_threshold                                   = stage3_param_persistence_threshold
zero_optimization.max_live_parameters                                           = stage3_max_live_parameters
zero_optimization.max_reuse_distance                                            = stage3_max_reuse_distance
zero_optimization.gather_16bit_weights_on_model_save                            = stage3_gather_16bit_weights_on_...
zero_optimization.stage3_gather_fp16_weights_on_model_save                      = stage3_gather_16bit_weights_on_...
zero_optimization.zero_quantized_weights                          false         bool; ZeRO++ qwZ: stage-3 all-gathers
                                                                                carry int8 + block scales (stage 3 only)
zero_optimization.zero_quantized_nontrainable_weights             false         bool; qwZ for frozen parameters only
                                                                                (stage 3 only)
zero_optimization.zero_hpz_partition_size                         1             ZeRO++ hpZ: ranks sharing a secondary
                                                                                partition (normally the ranks per node);
                                                                                1 = off; divides the world size; stage 3
zero_optimization.zero_quantized_gradients                        false         bool; ZeRO++ qgZ: two-hop int4 gradient
                                                                                all-to-all (stage 3 only)
zero_optimization.sub_group_size                                  1e9           elements the offloaded optimizer steps at
                                                                                once (NVMe: one swap unit), >= 1
zero_optimization.offload_optimizer.device                        "none"        "none" | "cpu" | "nvme": fp32 master weights
                                                                                and optimizer states in host memory / in
                                                                                files; stepped on the CPU (stages 1-3)
zero_optimization.offload_optimizer.nvme_path                     null          directory for the swap files (device nvme;
                                                                                a subdirectory per rank is created/removed)
zero_optimization.offload_optimizer.pin_memory                    false         bool; page-locked host buffers where the
                                                                                accelerator has pinning (no-op on the CPU)
zero_optimization.offload_optimizer.buffer_count                  4             sub-group buffers in host memory (nvme):
                                                                                read-ahead + compute + write-behind, >= 3
zero_optimization.offload_optimizer.fast_init                     false         bool; accepted, no effect (state files
                                                                                always start as sparse zero files)
zero_optimization.offload_optimizer.ratio                         1.0           only 1.0 (everything offloaded)
zero_optimization.offload_optimizer.pipeline_read                 false         bool; accepted, no effect (reads are
                                                                                always pipelined)
zero_optimization.offload_optimizer.pipeline_write                false         bool; accepted, no effect (writes are
                                                                                always pipelined)
zero_optimization.offload_param.device                            "none"        "none" | "cpu" | "nvme": stage-3 parameter
                                                                                partitions in host memory / files
zero_optimization.offload_param.nvme_path                         null          directory for the parameter files (nvme)
zero_optimization.offload_param.pin_memory                        false         bool, as for offload_optimizer
zero_optimization.offload_param.buffer_count                      5             staging buffers for units read from
                                                                                files (nvme), >= 2
zero_optimization.offload_param.buffer_size                       1e8           elements per staging buffer; must hold
                                                                                a fetch unit's partition, >= 1
zero_optimization.offload_param.max_in_cpu                        1e9           partition elements kept in host memory
                                                                                instead of files (nvme), >= 0
activation_checkpointing.partition_activations                    false         bool; split saved inputs across the
                                                                                model-parallel group (mpu in configure)
activation_checkpointing.cpu_checkpointing                        false         bool; saved inputs in host memory (also
                                                                                without partitioning, unlike DeepSpeed)
activation_checkpointing.contiguous_memory_optimization           false         bool; one reused buffer per checkpoint
                                                                                (needs number_checkpoints)
activation_checkpointing.number_checkpoints                       null          checkpointed calls per forward pass (the
                                                                                contiguous buffer count), >= 1, or null
activation_checkpointing.synchronize_checkpoint_boundary          false         bool; device sync around each checkpoint
activation_checkpointing.profile                                  false         bool; time each forward/recompute
accelerator (zero-core)                                           null          "cpu", "cuda", "hpu", ... or null
comm_backend (zero-core)                                          null          "gloo", "mpi", "nccl", ... or null
comm_timeout (zero-core)                                          null          seconds > 0, or null
topology.ranks_per_node (zero-core)                               null          divisor of the world size, or null
================================================================  ============  ==========================================

Batch size: ``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps
× world_size``. Any two of the three fill in the third; all three must multiply out. If only
one is given, gradient_accumulation_steps is 1. If neither train_batch_size nor the micro
batch is given (DeepSpeed refuses this; zero-core defaults), the micro batch is 1.

The ``stage3_*`` keys have no effect below stage 3 (DeepSpeed configs often carry them); each
may be given under one of its spellings only.

Integer sizes may be written as integral floats (``5e8``). ``zero_optimization.overlap_comm``
defaults to true here (DeepSpeed: false for stages 0-2); it changes speed, not results.
``zero_optimization.reduce_bucket_size`` defaults to 5e6 elements (20 MB in fp32, close to
DDP's 25 MiB buckets) instead of DeepSpeed's 5e8: with 5e8 a model below 500M parameters is
one bucket, so no gradient reduction overlaps backward. It changes speed, not results.

The ``activation_checkpointing`` section is read by ``zero_core.checkpointing.configure(mpu,
deepspeed_config=...)`` (as in DeepSpeed, the model code calls it; the engine does not).

Adding a key later (stage 3, ZeRO++, offload, checkpoints): move its name from
``NOT_YET_IMPLEMENTED`` to ``SUPPORTED_KEYS``, read it in the section's ``_parse_*`` function
and add a row to the table above. ``tests/test_config.py`` checks the three stay in step.
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = [
    "Config", "FP16Config", "BF16Config", "OptimizerConfig", "SchedulerConfig", "ZeroConfig",
    "OffloadOptimizerConfig", "OffloadParamConfig",
    "TopologyConfig", "ActivationCheckpointingConfig", "parse_config",
    "parse_activation_checkpointing", "SUPPORTED_KEYS", "NOT_YET_IMPLEMENTED", "NEUTRAL_VALUES",
    "OPTIMIZER_TYPES", "SCHEDULER_TYPES",
]

# ---------------------------------------------------------------------------------------------
# The key tables: the one place that says what zero-core accepts. A section is named by its
# dotted path; sections whose keys depend on a "type" get ":<Type>" appended.
# ---------------------------------------------------------------------------------------------

_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction",
                "torch_adam")
_WARMUP_PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                  "last_batch_iteration")

SUPPORTED_KEYS: dict[str, tuple[str, ...]] = {
    "": ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
         "gradient_clipping", "fp16", "bf16", "bfloat16", "optimizer", "scheduler",
         "zero_optimization", "steps_per_print", "wall_clock_breakdown",
         "zero_allow_untested_optimizer", "activation_checkpointing",
         "accelerator", "comm_backend", "comm_timeout", "topology"),
    "fp16": ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale"),
    "bf16": ("enabled",),
    "optimizer": ("type", "params"),
    "optimizer.params:Adam": _ADAM_PARAMS,
    "optimizer.params:AdamW": _ADAM_PARAMS,
    "optimizer.params:SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "scheduler": ("type", "params"),
    "scheduler.params:WarmupLR": _WARMUP_PARAMS,
    "scheduler.params:WarmupDecayLR": _WARMUP_PARAMS + ("total_num_steps",),
    "scheduler.params:WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps",
                                        "cos_min_ratio", "warmup_type", "last_batch_iteration"),
    "zero_optimization": ("stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                          "contiguous_gradients", "reduce_scatter",
                          "stage3_prefetch_bucket_size", "prefetch_bucket_size",
                          "stage3_param_persistence_threshold", "param_persistence_threshold",
                          "stage3_max_live_parameters", "max_live_parameters",
                          "stage3_max_reuse_distance", "max_reuse_distance",
                          "stage3_gather_16bit_weights_on_model_save",
                          "gather_16bit_weights_on_model_save",
                          "stage3_gather_fp16_weights_on_model_save",
                          "offload_optimizer", "offload_param", "sub_group_size",
                          "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                          "zero_hpz_partition_size", "zero_quantized_gradients"),
    "zero_optimization.offload_optimizer": ("device", "nvme_path", "pin_memory", "buffer_count",
                                            "fast_init", "ratio", "pipeline_read",
                                            "pipeline_write"),
    "zero_optimization.offload_param": ("device", "nvme_path", "pin_memory", "buffer_count",
                                        "buffer_size", "max_in_cpu"),
    "topology": ("ranks_per_node",),
    "activation_checkpointing": ("partition_activations", "cpu_checkpointing",
                                 "contiguous_memory_optimization", "number_checkpoints",
                                 "synchronize_checkpoint_boundary", "profile"),
}

# DeepSpeed keys zero-core does not implement yet: pattern -> what the key is for. Refused by
# name, so that a DeepSpeed config never trains with a feature silently missing.
NOT_YET_IMPLEMENTED: dict[str, dict[str, str]] = {
    "": {
        "amp": "NVIDIA Apex AMP",
        "torch_autocast": "torch.autocast mixed precision",
        "communication_data_type": "a separate dtype for gradient communication",
        "seq_parallel_communication_data_type": "sequence-parallel communication dtype",
        "prescale_gradients": "gradient prescaling before the all-reduce",
        "gradient_predivide_factor": "gradient pre-division before the all-reduce",
        "gradient_allreduce_op": "choosing sum instead of mean for the gradient reduction",
        "sparse_gradients": "sparse embedding gradients",
        "checkpoint": "checkpoint options",
        "load_universal_checkpoint": "universal checkpoints",
        "use_node_local_storage": "node-local checkpoint storage",
        "pipeline": "pipeline parallelism",
        "tensor_parallel": "tensor parallelism (AutoTP)",
        "expert_parallel": "expert parallelism (AutoEP)",
        "sequence_parallel_size": "sequence parallelism",
        "elasticity": "elastic training",
        "autotuning": "the autotuner",
        "flops_profiler": "the FLOPs profiler",
        "comms_logger": "the communication logger (zero-core's ledger records every collective)",
        "tensorboard": "TensorBoard monitoring",
        "wandb": "Weights & Biases monitoring",
        "csv_monitor": "CSV monitoring",
        "comet": "Comet monitoring",
        "compression_training": "compression training",
        "data_efficiency": "data efficiency (curriculum learning, data routing)",
        "curriculum_learning": "curriculum learning",
        "progressive_layer_drop": "progressive layer drop",
        "eigenvalue": "eigenvalue computation",
        "quantize_training": "quantization-aware training",
        "weight_quantization": "weight quantization",
        "sparse_attention": "sparse attention kernels",
        "hybrid_engine": "the RLHF hybrid engine",
        "aio": "asynchronous NVMe I/O (ZeRO-Infinity offload)",
        "nebula": "Nebula checkpointing",
        "compile": "torch.compile / DeepCompile integration",
        "data_types": "separate gradient-accumulation dtype",
        "zero_force_ds_cpu_optimizer": "the DeepSpeed CPU optimizer switch",
        "memory_breakdown": "memory breakdown logging",
        "dump_state": "state dump at start",
        "disable_allgather": "broadcast instead of all-gather",
        "dataloader_drop_last": "the DeepSpeed data loader",
        "graph_harvesting": "CUDA graph harvesting",
        "timers": "throughput timers",
        "managed_gradient_accumulation": "client-managed accumulation boundaries",
        "use_data_before_expert_parallelism": "MoE data layout",
    },
    "fp16": {
        "auto_cast": "casting inputs to fp16",
        "fp16_master_weights_and_grads": "fp16 master weights",
    },
    "bf16": {
        "bf16_master_weights_and_grads": "bf16 master weights",
        "bf16_optimizer_states": "bf16 optimizer states",
        "immediate_grad_update": "immediate bf16 gradient updates",
        "check_grad_overflow": "overflow checks in bf16",
    },
    "optimizer.params:Adam": {"amsgrad": "AMSGrad", "fused": "the fused torch kernel switch"},
    "optimizer.params:AdamW": {"amsgrad": "AMSGrad", "fused": "the fused torch kernel switch"},
    "zero_optimization": {
        "stage3_model_persistence_threshold": "ZeRO stage 3 whole-model persistence limit",
        "model_persistence_threshold": "ZeRO stage 3 whole-model persistence limit",
        "stage3_module_granularity_threshold": "ZeRO stage 3 module granularity",
        "module_granularity_threshold": "ZeRO stage 3 module granularity",
        "stage3_use_all_reduce_for_fetch_params": "ZeRO stage 3 all-reduce fetch",
        "use_all_reduce_for_fetch_params": "ZeRO stage 3 all-reduce fetch",
        "stage3_*": "this ZeRO stage 3 option",
        "cpu_offload": "optimizer offload (ZeRO-Offload)",
        "cpu_offload_param": "parameter offload",
        "cpu_offload_use_pin_memory": "pinned offload buffers",
        "zeropp_loco_param": "ZeRO++ LoCo error feedback",
        "mics_shard_size": "MiCS sharding",
        "mics_hierarchical_params_gather": "MiCS hierarchical gather",
        "elastic_checkpoint": "elastic checkpoints",
        "load_from_fp32_weights": "checkpoint loading options",
        "allgather_partitions": "broadcast instead of all-gather for updated parameters",
        "round_robin_gradients": "round-robin gradient copies for offload",
        "ignore_unused_parameters": "the unused-parameter switch",
        "legacy_stage1": "legacy stage 1",
        "memory_efficient_linear": "memory-efficient linear layers",
        "pipeline_loading_checkpoint": "pipelined checkpoint loading",
        "override_module_apply": "module.apply override",
        "log_trace_cache_warnings": "stage 3 trace cache",
        "compute_grad_norm": "switching off the gradient norm",
        "parameter_alignment": "16-byte parameter alignment",
        "save_muon_momentum_buffer_in_memory": "the Muon optimizer",
        "use_multi_rank_bucket_allreduce": "multi-rank bucket all-reduce",
        "zenflow": "ZenFlow",
    },
}

# A not-yet-implemented key is accepted at exactly one value: the one that asks for what
# zero-core already does (DeepSpeed's default, the feature off). Any other value is refused.
NEUTRAL_VALUES: dict[str, Any] = {
    "fp16.auto_cast": False,
    "fp16.fp16_master_weights_and_grads": False,
    "bf16.bf16_master_weights_and_grads": False,
    "bf16.bf16_optimizer_states": False,
    "optimizer.params.amsgrad": False,
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "gradient_allreduce_op": "mean",
    "sparse_gradients": False,
    "memory_breakdown": False,
    "dump_state": False,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.cpu_offload": False,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.compute_grad_norm": True,
    "zero_optimization.parameter_alignment": False,
}
# Whole sections with an "enabled" switch: {"enabled": false, ...} asks for nothing.
_SWITCHABLE_SECTIONS = frozenset({
    "torch_autocast", "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler",
    "comms_logger", "elasticity", "autotuning", "hybrid_engine", "expert_parallel", "amp",
    "eigenvalue", "progressive_layer_drop", "curriculum_learning", "nebula",
})

OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_OPTIMIZERS_NOT_YET = ("Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Muon", "Adagrad",
                       "Lion", "FusedAdam", "CPUAdam", "Adafactor", "RMSprop")
_SCHEDULERS_NOT_YET = ("LRRangeTest", "OneCycle")

MAX_ZERO_STAGE = 3  # stages above this are refused as "not implemented yet"


# ---------------------------------------------------------------------------------------------
# The typed result.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FP16Config:
    """fp16 mixed precision. ``loss_scale`` 0 means dynamic scaling (DeepSpeed's meaning)."""

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False

    @property
    def dynamic(self) -> bool:
        """True when the loss scale adapts to overflows (``loss_scale == 0``)."""
        return self.loss_scale == 0.0

    @property
    def initial_scale(self) -> float:
        """The loss scale of the first step."""
        return float(2.0 ** self.initial_scale_power) if self.dynamic else self.loss_scale


@dataclass(frozen=True)
class BF16Config:
    """bfloat16 mixed precision (no loss scaling needed)."""

    enabled: bool = False


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer named in the config, with DeepSpeed's parameter names resolved.

    ``adamw_mode`` is True for "AdamW" and, as in DeepSpeed, for "Adam" unless
    ``adam_w_mode: false`` is given: DeepSpeed's "Adam" decouples weight decay by default.
    """

    type: str
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw_mode: bool = True
    bias_correction: bool = True
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    torch_adam: bool = False  # accepted for compatibility; zero-core picks its own kernel


@dataclass(frozen=True)
class SchedulerConfig:
    """LR schedule: ``type`` and its ``params`` with every default filled in.

    For WarmupLR, ``params["warmup_max_lr"]`` is None when not given: the optimizer's lr is
    used (as DeepSpeed does).
    """

    type: str
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where fp32 master weights and optimizer
    states live ("none": on the device; "cpu": host memory; "nvme": files under
    ``nvme_path``). ``buffer_count`` sub-group buffers bound host memory with nvme."""

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    fast_init: bool = False
    ratio: float = 1.0
    pipeline_read: bool = False
    pipeline_write: bool = False

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (stage 3): where parameter partitions live.
    With nvme, up to ``max_in_cpu`` partition elements stay in host memory and units are
    read through ``buffer_count`` staging buffers of ``buffer_size`` elements."""

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO stage and bucket sizes (in elements, not bytes)."""

    stage: int = 0
    reduce_bucket_size: int = 5_000_000  # DeepSpeed: 5e8 (see module docstring)
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    # stage 3 (elements; DeepSpeed's defaults)
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    # ZeRO++ (stage 3 only; zero_core/zeropp)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_hpz_partition_size: int = 1
    zero_quantized_gradients: bool = False
    # offload (zero_core/offload)
    sub_group_size: int = 1_000_000_000
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)

    @property
    def zeropp_enabled(self) -> bool:
        """True when any ZeRO++ feature (qwZ, hpZ, qgZ) is switched on."""
        return (self.zero_quantized_weights or self.zero_quantized_nontrainable_weights
                or self.zero_hpz_partition_size > 1 or self.zero_quantized_gradients)


@dataclass(frozen=True)
class TopologyConfig:
    """Override of ranks per node (None = what the launcher says)."""

    ranks_per_node: int | None = None


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's ``activation_checkpointing`` section (ZeRO-R), used by
    :func:`zero_core.checkpointing.configure`. ``number_checkpoints`` is how many
    checkpointed calls can hold saved inputs at once (None: not given)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class Config:
    """A validated zero-core configuration (see the module docstring for every key)."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float = 0.0
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    # DeepSpeed's permission for client optimizers under ZeRO. Accepted without effect: the
    # engine checks a client optimizer itself (element-wise update rules only at stages 1-2).
    zero_allow_untested_optimizer: bool = False
    accelerator: str | None = None
    comm_backend: str | None = None
    comm_timeout: float | None = None
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    world_size: int = 1  # the data-parallel world size the batch sizes were resolved for

    @property
    def precision(self) -> str:
        """"fp16", "bf16" or "fp32": the dtype of forward/backward compute."""
        if self.fp16.enabled:
            return "fp16"
        if self.bf16.enabled:
            return "bf16"
        return "fp32"

    @property
    def compute_dtype(self):
        """torch.float16, torch.bfloat16 or torch.float32, following :attr:`precision`."""
        import torch  # here, so that parsing a config never needs torch
        dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
        return dtypes[self.precision]

    def to_dict(self) -> dict:
        """The config as DeepSpeed-style JSON data; ``parse_config`` of it gives back an equal
        Config (for the same world size)."""
        out: dict[str, Any] = {
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "gradient_clipping": self.gradient_clipping,
            "fp16": dataclasses.asdict(self.fp16),
            "bf16": dataclasses.asdict(self.bf16),
            "zero_optimization": dataclasses.asdict(self.zero_optimization),
            "steps_per_print": self.steps_per_print,
            "wall_clock_breakdown": self.wall_clock_breakdown,
            "zero_allow_untested_optimizer": self.zero_allow_untested_optimizer,
            "accelerator": self.accelerator,
            "comm_backend": self.comm_backend,
            "comm_timeout": self.comm_timeout,
            "topology": dataclasses.asdict(self.topology),
            "activation_checkpointing": dataclasses.asdict(self.activation_checkpointing),
        }
        if self.optimizer is not None:
            opt = self.optimizer
            if opt.type == "SGD":
                params = {"lr": opt.lr, "momentum": opt.momentum, "dampening": opt.dampening,
                          "weight_decay": opt.weight_decay, "nesterov": opt.nesterov}
            else:
                params = {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
                          "weight_decay": opt.weight_decay, "adam_w_mode": opt.adamw_mode,
                          "bias_correction": opt.bias_correction, "torch_adam": opt.torch_adam}
            out["optimizer"] = {"type": opt.type, "params": params}
        if self.scheduler is not None:
            params = {k: (list(v) if isinstance(v, tuple) else v)
                      for k, v in self.scheduler.params.items()}
            out["scheduler"] = {"type": self.scheduler.type, "params": params}
        return out


# ---------------------------------------------------------------------------------------------
# Value checks. Each names the dotted key, the value and what would be valid.
# ---------------------------------------------------------------------------------------------

def _fail(path: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"config key '{path}' = {value!r}: {expected}")


def _refuse_auto(path: str, value: Any) -> None:
    if isinstance(value, str) and value.strip().lower() == "auto":
        raise _fail(path, value, "'auto' is a Hugging Face Trainer placeholder that the Trainer "
                                 "replaces before DeepSpeed reads the config; zero-core needs the "
                                 "concrete value here")


def _as_int(path: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    _refuse_auto(path, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, value, f"expected an integer{_range_text(lo, hi)}")
    if isinstance(value, float):
        # JSON writers and humans write sizes like 5e8; accept them when they are whole.
        if not math.isfinite(value) or not value.is_integer():
            raise _fail(path, value, f"expected an integer{_range_text(lo, hi)} "
                                     f"(a float is accepted only when it is whole, like 5e8)")
        value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _fail(path, value, f"out of range: expected an integer{_range_text(lo, hi)}")
    return value


def _as_float(path: str, value: Any, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False, hi_open: bool = False) -> float:
    _refuse_auto(path, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, value, f"expected a number{_range_text(lo, hi, lo_open, hi_open)}")
    number = float(value)
    if not math.isfinite(number):
        raise _fail(path, value, f"expected a finite number{_range_text(lo, hi, lo_open, hi_open)}")
    too_low = lo is not None and (number <= lo if lo_open else number < lo)
    too_high = hi is not None and (number >= hi if hi_open else number > hi)
    if too_low or too_high:
        raise _fail(path, value, f"out of range: expected a number"
                                 f"{_range_text(lo, hi, lo_open, hi_open)}")
    return number


def _as_bool(path: str, value: Any) -> bool:
    _refuse_auto(path, value)
    if not isinstance(value, bool):
        raise _fail(path, value, "expected true or false (a JSON boolean, not a string or number)")
    return value


def _as_name(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, value, "expected a non-empty string")
    return value.strip()


def _range_text(lo, hi, lo_open=False, hi_open=False) -> str:
    lo, hi = (None if v is None else f"{v:g}" for v in (lo, hi))
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi}"
    return ""


def _suggest(word: str, candidates) -> str:
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    if word.lower() in lowered:
        return f"; did you mean '{lowered[word.lower()]}'?"
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _pending_feature(table: str, key: str) -> str | None:
    for pattern, what in NOT_YET_IMPLEMENTED.get(table, {}).items():
        if fnmatch.fnmatchcase(key, pattern):
            return what
    return None


class _Section:
    """One JSON object of the config: checks its keys against the tables, then hands out
    validated values. ``table`` names the SUPPORTED_KEYS entry, ``path`` the dotted location."""

    def __init__(self, raw: Any, path: str, table: str):
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise _fail(path, raw, "expected a JSON object ({...})")
        self.raw = dict(raw)
        self.path = path
        self.table = table
        self._check_keys()

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _check_keys(self) -> None:
        supported = SUPPORTED_KEYS[self.table]
        for key in list(self.raw):
            if not isinstance(key, str):
                raise _fail(self.key_path(str(key)), key, "keys must be strings")
            if key in supported:
                continue
            path = self.key_path(key)
            value = self.raw[key]
            feature = _pending_feature(self.table, key)
            if feature is not None:
                if self._is_neutral(key, value):
                    del self.raw[key]  # asks for what zero-core does anyway
                    continue
                if self._table_path(key) in NEUTRAL_VALUES:
                    neutral = json.dumps(NEUTRAL_VALUES[self._table_path(key)])
                    hint = f"; only {neutral} (the feature off) is accepted for now"
                elif key in _SWITCHABLE_SECTIONS and not self.path:
                    hint = "; remove the key (or set \"enabled\": false) to train without it"
                else:
                    hint = "; remove the key to train without it"
                raise ConfigError(f"config key '{path}' ({feature}) is not implemented yet in "
                                  f"zero-core{hint}")
            where = f"in '{self.path}'" if self.path else "at the top level"
            if ":" in self.table:
                where += f" for {self.table.split(':', 1)[1]}"
            raise ConfigError(
                f"unknown config key '{path}'{_suggest(key, supported)} "
                f"(valid keys {where}: {', '.join(supported)})")

    def _table_path(self, key: str) -> str:
        # NEUTRAL_VALUES use the table's name ("bf16.x" also for "bfloat16", no ":Type").
        section = self.table.split(":")[0]
        return f"{section}.{key}" if section else key

    def _is_neutral(self, key: str, value: Any) -> bool:
        if self._table_path(key) in NEUTRAL_VALUES:
            want = NEUTRAL_VALUES[self._table_path(key)]
            return type(value) is type(want) and value == want or (
                isinstance(want, float) and not isinstance(value, bool)
                and isinstance(value, (int, float)) and float(value) == want)
        if not self.path and key in _SWITCHABLE_SECTIONS:
            return isinstance(value, Mapping) and value.get("enabled", False) is False
        return False

    def has(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any, convert, *args, **kwargs) -> Any:
        # Reading a key the tables do not list is a bug here, not a user error.
        assert key in SUPPORTED_KEYS[self.table], f"{key} not in SUPPORTED_KEYS[{self.table!r}]"
        if key not in self.raw:
            return default
        return convert(self.key_path(key), self.raw[key], *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Sections.
# ---------------------------------------------------------------------------------------------

def _parse_fp16(raw: Any) -> FP16Config:
    s = _Section(raw, "fp16", "fp16")
    cfg = FP16Config(
        enabled=s.get("enabled", False, _as_bool),
        loss_scale=s.get("loss_scale", 0.0, _as_float, lo=0.0),
        initial_scale_power=s.get("initial_scale_power", 16, _as_int, 0, 64),
        loss_scale_window=s.get("loss_scale_window", 1000, _as_int, 1),
        hysteresis=s.get("hysteresis", 2, _as_int, 1),
        min_loss_scale=s.get("min_loss_scale", 1.0, _as_float, lo=0.0, lo_open=True),
        consecutive_hysteresis=s.get("consecutive_hysteresis", False, _as_bool),
    )
    if cfg.enabled and cfg.dynamic and cfg.initial_scale < cfg.min_loss_scale:
        raise _fail("fp16.initial_scale_power", cfg.initial_scale_power,
                    f"the initial loss scale 2**{cfg.initial_scale_power} = {cfg.initial_scale:g} "
                    f"is below fp16.min_loss_scale = {cfg.min_loss_scale:g}; raise "
                    f"initial_scale_power or lower min_loss_scale")
    return cfg


def _parse_bf16(raw: Any, path: str) -> BF16Config:
    s = _Section(raw, path, "bf16")
    return BF16Config(enabled=s.get("enabled", False, _as_bool))


def _canonical_type(path: str, value: Any, valid: tuple[str, ...], pending: tuple[str, ...],
                    what: str, any_case: bool) -> str:
    name = _as_name(path, value)
    for v in valid:
        if v == name or (any_case and v.lower() == name.lower()):
            return v
    for p in pending:
        if p.lower() == name.lower():
            raise ConfigError(f"config key '{path}' = {value!r}: the {p} {what} is not "
                              f"implemented yet in zero-core; use one of {', '.join(valid)}")
    raise _fail(path, value, f"unknown {what}{_suggest(name, valid)} (valid: {', '.join(valid)})")


def _parse_betas(path: str, value: Any) -> tuple[float, float]:
    _refuse_auto(path, value)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _fail(path, value, "expected a list of two numbers [beta1, beta2], each in [0, 1)")
    return (_as_float(f"{path}[0]", value[0], 0.0, 1.0, hi_open=True),
            _as_float(f"{path}[1]", value[1], 0.0, 1.0, hi_open=True))


def _parse_optimizer(raw: Any) -> OptimizerConfig | None:
    if raw is None:
        return None
    s = _Section(raw, "optimizer", "optimizer")
    if not s.has("type"):
        raise ConfigError(f"config key 'optimizer.type' is missing: name the optimizer, one of "
                          f"{', '.join(OPTIMIZER_TYPES)}")
    kind = s.get("type", None, _canonical_type, OPTIMIZER_TYPES, _OPTIMIZERS_NOT_YET, "optimizer",
                 True)
    p = _Section(s.raw.get("params"), "optimizer.params", f"optimizer.params:{kind}")
    lr = p.get("lr", 1e-3, _as_float, lo=0.0)
    weight_decay = p.get("weight_decay", 0.0, _as_float, lo=0.0)
    if kind == "SGD":
        momentum = p.get("momentum", 0.0, _as_float, lo=0.0)
        dampening = p.get("dampening", 0.0, _as_float, lo=0.0)
        nesterov = p.get("nesterov", False, _as_bool)
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise _fail("optimizer.params.nesterov", True,
                        f"Nesterov momentum needs momentum > 0 and dampening = 0 (got momentum="
                        f"{momentum:g}, dampening={dampening:g})")
        return OptimizerConfig(type=kind, lr=lr, weight_decay=weight_decay, adamw_mode=False,
                               momentum=momentum, dampening=dampening, nesterov=nesterov)
    # Adam / AdamW. DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
    adam_w_mode = p.get("adam_w_mode", True, _as_bool)
    if kind == "AdamW" and not adam_w_mode:
        raise _fail("optimizer.params.adam_w_mode", False,
                    "contradicts optimizer.type 'AdamW'; for L2-regularised Adam use type 'Adam' "
                    "with adam_w_mode false")
    return OptimizerConfig(
        type=kind, lr=lr, weight_decay=weight_decay, adamw_mode=adam_w_mode,
        betas=p.get("betas", (0.9, 0.999), _parse_betas),
        eps=p.get("eps", 1e-8, _as_float, lo=0.0, lo_open=True),
        bias_correction=p.get("bias_correction", True, _as_bool),
        torch_adam=p.get("torch_adam", False, _as_bool),
    )


def _lr_or_list(path: str, value: Any) -> float | tuple[float, ...]:
    """A learning rate (>= 0) or one per parameter group (DeepSpeed allows a list)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise _fail(path, value, "expected a number >= 0 or a non-empty list of them "
                                     "(one per parameter group)")
        return tuple(_as_float(f"{path}[{i}]", v, lo=0.0) for i, v in enumerate(value))
    return _as_float(path, value, lo=0.0)


def _warmup_type(path: str, value: Any) -> str:
    if value not in ("log", "linear"):
        raise _fail(path, value, f"expected \"log\" or \"linear\""
                                 f"{_suggest(str(value), ('log', 'linear'))}")
    return value


def _warmup_steps(path: str, value: Any) -> int:
    steps = _as_int(path, value)
    if steps < 1:
        raise _fail(path, value, "expected an integer >= 1 (DeepSpeed warms up over at least 2 "
                                 "steps; there is no warmup-free setting)")
    return steps


def _parse_scheduler(raw: Any) -> SchedulerConfig | None:
    if raw is None:
        return None
    s = _Section(raw, "scheduler", "scheduler")
    if not s.has("type"):
        raise ConfigError(f"config key 'scheduler.type' is missing: name the schedule, one of "
                          f"{', '.join(SCHEDULER_TYPES)}")
    kind = s.get("type", None, _canonical_type, SCHEDULER_TYPES, _SCHEDULERS_NOT_YET,
                 "LR scheduler", False)  # DeepSpeed matches schedule names exactly
    raw_params = s.raw.get("params")
    p = _Section(raw_params, "scheduler.params", f"scheduler.params:{kind}")
    params: dict[str, Any] = {
        "warmup_num_steps": p.get("warmup_num_steps", 1000, _warmup_steps),
        "warmup_type": p.get("warmup_type", "log", _warmup_type),
        "last_batch_iteration": p.get("last_batch_iteration", -1, _as_int, -1),
    }
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        if not p.has("total_num_steps"):
            raise ConfigError(f"config key 'scheduler.params.total_num_steps' is missing: "
                              f"{kind} needs the total number of optimizer steps (an integer >= 1)")
        params["total_num_steps"] = p.get("total_num_steps", None, _as_int, 1)
    if kind in ("WarmupLR", "WarmupDecayLR"):
        params["warmup_min_lr"] = p.get("warmup_min_lr", 0.0, _lr_or_list)
        # DeepSpeed: WarmupLR warms up to the optimizer's lr, WarmupDecayLR to 0.001.
        params["warmup_max_lr"] = p.get("warmup_max_lr", None if kind == "WarmupLR" else 0.001,
                                        _lr_or_list)
        lo, hi = params["warmup_min_lr"], params["warmup_max_lr"]
        if isinstance(lo, tuple) and isinstance(hi, tuple) and len(lo) != len(hi):
            raise _fail("scheduler.params.warmup_max_lr", list(hi),
                        f"has {len(hi)} entries but warmup_min_lr has {len(lo)}; both lists need "
                        f"one entry per parameter group")
    else:
        params["warmup_min_ratio"] = p.get("warmup_min_ratio", 0.0, _as_float, 0.0, 1.0)
        params["cos_min_ratio"] = p.get("cos_min_ratio", 1e-4, _as_float, 0.0, 1.0)
    return SchedulerConfig(type=kind, params=params)


_ZEROPP_NAMES = {
    "zero_quantized_weights": "qwZ (quantized weight all-gathers)",
    "zero_quantized_nontrainable_weights": "qwZ for frozen weights",
    "zero_hpz_partition_size": "hpZ (secondary partitions inside the node)",
    "zero_quantized_gradients": "qgZ (quantized gradient all-to-all)",
}


def _parse_zeropp(s: "_Section", stage: int, world_size: int) -> dict:
    """The ZeRO++ keys; switched on below stage 3 they are an error (ZeRO++ changes how
    stage 3 gathers its partitioned parameters, which stages 0-2 do not have)."""
    values = {
        "zero_quantized_weights": s.get("zero_quantized_weights", False, _as_bool),
        "zero_quantized_nontrainable_weights": s.get("zero_quantized_nontrainable_weights",
                                                     False, _as_bool),
        "zero_hpz_partition_size": s.get("zero_hpz_partition_size", 1, _as_int, 1),
        "zero_quantized_gradients": s.get("zero_quantized_gradients", False, _as_bool),
    }
    off = {"zero_hpz_partition_size": 1}
    for key, value in values.items():
        if stage < 3 and value != off.get(key, False):
            raise _fail(f"zero_optimization.{key}", value,
                        f"ZeRO++ {_ZEROPP_NAMES[key]} works on stage 3's partitioned parameters; "
                        f"set zero_optimization.stage to 3 to use it — at stage {stage} only "
                        f"{str(off.get(key, False)).lower()} (the feature off) is accepted")
    hpz = values["zero_hpz_partition_size"]
    if world_size % hpz:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise _fail("zero_optimization.zero_hpz_partition_size", hpz,
                    f"must divide the world size {world_size} (valid: "
                    f"{', '.join(map(str, divisors))}; normally the ranks per node)")
    return values


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _offload_device(path: str, value: Any) -> str:
    if value not in OFFLOAD_DEVICES:
        raise _fail(path, value, f"expected one of {', '.join(map(repr, OFFLOAD_DEVICES))}"
                                 f"{_suggest(str(value), OFFLOAD_DEVICES)}")
    return value


def _parse_offload_section(s: "_Section", key: str, stage: int) -> tuple:
    sub = _Section(s.raw.get(key), f"zero_optimization.{key}", f"zero_optimization.{key}")
    device = sub.get("device", "none", _offload_device)
    path = sub.get("nvme_path", None, _optional(_as_name))
    if device == "nvme" and path is None:
        raise _fail(f"zero_optimization.{key}.nvme_path", None,
                    "device 'nvme' needs a directory for the swap files (a fast local disk, "
                    "e.g. \"/local_nvme\"); a subdirectory per rank is created there")
    return sub, device, path


def _parse_offload(s: "_Section", stage: int) -> dict:
    """offload_optimizer / offload_param / sub_group_size (zero_core/offload)."""
    sub, device, path = _parse_offload_section(s, "offload_optimizer", stage)
    if device != "none" and stage < 1:
        raise _fail("zero_optimization.offload_optimizer.device", device,
                    "offloading the optimizer needs ZeRO stage 1, 2 or 3 (it offloads the "
                    "partitioned optimizer states); set zero_optimization.stage >= 1")
    ratio = sub.get("ratio", 1.0, _as_float, 0.0, 1.0)
    if ratio != 1.0:
        raise _fail("zero_optimization.offload_optimizer.ratio", ratio,
                    "partial offload is not implemented; only 1.0 (all optimizer states "
                    "offloaded) is accepted")
    opt = OffloadOptimizerConfig(
        device=device, nvme_path=path, pin_memory=sub.get("pin_memory", False, _as_bool),
        buffer_count=sub.get("buffer_count", 4, _as_int, 3),
        fast_init=sub.get("fast_init", False, _as_bool), ratio=ratio,
        pipeline_read=sub.get("pipeline_read", False, _as_bool),
        pipeline_write=sub.get("pipeline_write", False, _as_bool))
    sub, device, path = _parse_offload_section(s, "offload_param", stage)
    if device != "none" and stage != 3:
        raise _fail("zero_optimization.offload_param.device", device,
                    f"parameter offload works on stage 3's partitioned parameters; set "
                    f"zero_optimization.stage to 3 (now {stage}) or device to 'none'")
    param = OffloadParamConfig(
        device=device, nvme_path=path, pin_memory=sub.get("pin_memory", False, _as_bool),
        buffer_count=sub.get("buffer_count", 5, _as_int, 2),
        buffer_size=sub.get("buffer_size", 100_000_000, _as_int, 1),
        max_in_cpu=sub.get("max_in_cpu", 1_000_000_000, _as_int, 0))
    return {"offload_optimizer": opt, "offload_param": param,
            "sub_group_size": s.get("sub_group_size", 1_000_000_000, _as_int, 1)}


def _parse_zero(raw: Any, world_size: int = 1) -> ZeroConfig:
    s = _Section(raw, "zero_optimization", "zero_optimization")
    if s.has("stage"):
        stage = s.get("stage", 0, _as_int)
        if not 0 <= stage <= MAX_ZERO_STAGE:
            raise _fail("zero_optimization.stage", stage,
                        f"expected 0, 1, 2 or 3 (0 = DDP, 1 = optimizer states partitioned, "
                        f"2 = + gradients partitioned, 3 = + parameters partitioned)")
    else:
        stage = 0

    def stage3(names, default, conv, *bounds):
        given = [n for n in names if s.has(n)]
        if len(given) > 1:
            raise _fail(f"zero_optimization.{given[1]}", s.raw[given[1]],
                        f"also given as zero_optimization.{given[0]}; keep one spelling")
        return s.get(given[0], default, conv, *bounds) if given else default

    return ZeroConfig(
        stage=stage,
        reduce_bucket_size=s.get("reduce_bucket_size", 5_000_000, _as_int, 1),
        allgather_bucket_size=s.get("allgather_bucket_size", 500_000_000, _as_int, 1),
        overlap_comm=s.get("overlap_comm", True, _as_bool),
        contiguous_gradients=s.get("contiguous_gradients", True, _as_bool),
        reduce_scatter=s.get("reduce_scatter", True, _as_bool),
        stage3_prefetch_bucket_size=stage3(
            ("stage3_prefetch_bucket_size", "prefetch_bucket_size"), 50_000_000, _as_int, 0),
        stage3_param_persistence_threshold=stage3(
            ("stage3_param_persistence_threshold", "param_persistence_threshold"), 100_000,
            _as_int, 0),
        stage3_max_live_parameters=stage3(
            ("stage3_max_live_parameters", "max_live_parameters"), 1_000_000_000, _as_int, 1),
        stage3_max_reuse_distance=stage3(
            ("stage3_max_reuse_distance", "max_reuse_distance"), 1_000_000_000, _as_int, 0),
        stage3_gather_16bit_weights_on_model_save=stage3(
            ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
             "stage3_gather_fp16_weights_on_model_save"), False, _as_bool),
        **_parse_zeropp(s, stage, world_size),
        **_parse_offload(s, stage),
    )


def _parse_topology(raw: Any, world_size: int) -> TopologyConfig:
    s = _Section(raw, "topology", "topology")
    rpn = s.get("ranks_per_node", None, _optional(_as_int), 1)
    if rpn is not None and world_size % rpn:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise _fail("topology.ranks_per_node", rpn,
                    f"must divide the world size {world_size} (valid: "
                    f"{', '.join(map(str, divisors))}, or null for what the launcher reports)")
    return TopologyConfig(ranks_per_node=rpn)


def parse_activation_checkpointing(raw: Any) -> ActivationCheckpointingConfig:
    """Validate DeepSpeed's ``activation_checkpointing`` section on its own (a dict or
    None); :func:`parse_config` calls it for the whole config."""
    s = _Section(raw, "activation_checkpointing", "activation_checkpointing")
    cfg = ActivationCheckpointingConfig(
        partition_activations=s.get("partition_activations", False, _as_bool),
        cpu_checkpointing=s.get("cpu_checkpointing", False, _as_bool),
        contiguous_memory_optimization=s.get("contiguous_memory_optimization", False, _as_bool),
        number_checkpoints=s.get("number_checkpoints", None, _optional(_as_int), 1),
        synchronize_checkpoint_boundary=s.get("synchronize_checkpoint_boundary", False, _as_bool),
        profile=s.get("profile", False, _as_bool),
    )
    if cfg.contiguous_memory_optimization and cfg.number_checkpoints is None:
        # the buffers are preallocated per checkpoint, so their count must be known
        raise _fail("activation_checkpointing.number_checkpoints", None,
                    "contiguous_memory_optimization needs the number of checkpointed calls per "
                    "forward pass (an integer >= 1, e.g. the number of checkpointed layers)")
    return cfg


def _optional(convert):
    def convert_or_none(path, value, *args, **kwargs):
        return None if value is None else convert(path, value, *args, **kwargs)
    return convert_or_none


def _resolve_batch(s: _Section, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro batch per rank, accumulation steps) from any two of them."""
    tb = s.get("train_batch_size", None, _optional(_as_int), 1)
    mb = s.get("train_micro_batch_size_per_gpu", None, _optional(_as_int), 1)
    ga = s.get("gradient_accumulation_steps", None, _optional(_as_int), 1)
    ws = world_size

    def not_divisible(what_path, what, by_text, by):
        lower, upper = (what // by) * by, (what // by + 1) * by
        options = " or ".join(str(v) for v in (lower, upper) if v > 0)
        return _fail(what_path, what, f"must be divisible by {by_text} = {by} so that "
                                      f"train_batch_size = train_micro_batch_size_per_gpu × "
                                      f"gradient_accumulation_steps × world_size holds; "
                                      f"try {options}")

    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * ws:
            raise _fail("train_batch_size", tb,
                        f"must equal train_micro_batch_size_per_gpu × gradient_accumulation_steps "
                        f"× world_size = {mb} × {ga} × {ws} = {mb * ga * ws}; give only two of "
                        f"the three to have the third derived")
    elif tb is not None and mb is not None:
        if tb % (mb * ws):
            raise not_divisible("train_batch_size", tb,
                                f"train_micro_batch_size_per_gpu × world_size = {mb} × {ws}",
                                mb * ws)
        ga = tb // (mb * ws)
    elif tb is not None:
        ga = 1 if ga is None else ga
        if tb % (ga * ws):
            raise not_divisible("train_batch_size", tb,
                                f"gradient_accumulation_steps × world_size = {ga} × {ws}",
                                ga * ws)
        mb = tb // (ga * ws)
    else:
        mb = 1 if mb is None else mb
        ga = 1 if ga is None else ga
        tb = mb * ga * ws
    return tb, mb, ga


# ---------------------------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------------------------

def _load(config: Any) -> Mapping:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, os.PathLike)):
        text = os.fspath(config)
        if isinstance(text, str) and text.lstrip().startswith("{") and not os.path.exists(text):
            source, name = text, "<config string>"
        else:
            try:
                with open(text, encoding="utf-8") as f:
                    source, name = f.read(), text
            except OSError as exc:
                raise ConfigError(f"cannot read the config file {text!r}: {exc.strerror}; pass a "
                                  f"path to a JSON file, a dict or None") from None
        try:
            data = json.loads(source)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"the config {name} is not valid JSON: {exc.msg} at line "
                              f"{exc.lineno}, column {exc.colno}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"the config {name} must hold a JSON object at the top level, not "
                              f"{type(data).__name__}")
        return data
    raise ConfigError(f"config must be a dict, a path to a JSON file, a Config or None, not "
                      f"{type(config).__name__}")


def parse_config(config: Any = None, world_size: int = 1) -> Config:
    """Validate *config* once and return a frozen :class:`Config`.

    *config* is a dict, a path (str or PathLike) to a JSON file, JSON text itself (a string
    starting with "{"), an existing Config (returned as is when it was resolved for the same
    world size) or None (all defaults).
    *world_size* is the number of data-parallel ranks the batch sizes are resolved against.
    Raises ConfigError naming the key, the value and what would be valid.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r}: expected an integer >= 1 (the number of "
                          f"data-parallel ranks)")
    if isinstance(config, Config):
        if config.world_size != world_size:
            raise ConfigError(
                f"this Config was resolved for world size {config.world_size} "
                f"(train_batch_size={config.train_batch_size}), not {world_size}; parse the "
                f"original dict or file again for the new world size")
        return config

    top = _Section(_load(config), "", "")
    if top.has("bf16") and top.has("bfloat16"):
        raise ConfigError("config keys 'bf16' and 'bfloat16' are both given; they are two "
                          "spellings of the same section, keep one ('bf16')")
    fp16 = _parse_fp16(top.raw.get("fp16"))
    bf16_key = "bfloat16" if top.has("bfloat16") else "bf16"
    bf16 = _parse_bf16(top.raw.get(bf16_key), bf16_key)
    if fp16.enabled and bf16.enabled:
        raise _fail(f"{bf16_key}.enabled", True, "fp16 and bf16 cannot both be enabled; pick one "
                                                 "(bf16 needs no loss scaling)")
    tb, mb, ga = _resolve_batch(top, world_size)
    return Config(
        train_batch_size=tb,
        train_micro_batch_size_per_gpu=mb,
        gradient_accumulation_steps=ga,
        gradient_clipping=top.get("gradient_clipping", 0.0, _as_float, lo=0.0),
        fp16=fp16,
        bf16=bf16,
        optimizer=_parse_optimizer(top.raw.get("optimizer")),
        scheduler=_parse_scheduler(top.raw.get("scheduler")),
        zero_optimization=_parse_zero(top.raw.get("zero_optimization"), world_size),
        steps_per_print=top.get("steps_per_print", 10, _as_int, 1),
        wall_clock_breakdown=top.get("wall_clock_breakdown", False, _as_bool),
        zero_allow_untested_optimizer=top.get("zero_allow_untested_optimizer", False, _as_bool),
        accelerator=top.get("accelerator", None, _optional(_as_name)),
        comm_backend=top.get("comm_backend", None, _optional(_as_name)),
        comm_timeout=top.get("comm_timeout", None, _optional(_as_float), lo=0.0, lo_open=True),
        topology=_parse_topology(top.raw.get("topology"), world_size),
        activation_checkpointing=parse_activation_checkpointing(
            top.raw.get("activation_checkpointing")),
        world_size=world_size,
    )
