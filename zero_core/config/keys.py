"""The key tables of zero-core's DeepSpeed-compatible config, the one place that says what
is accepted: ``SUPPORTED_KEYS`` (every key zero-core reads, per section), ``NOT_YET_IMPLEMENTED``
(DeepSpeed keys refused by name until zero-core implements them), ``NEUTRAL_VALUES`` (the one
value each of those may still take: the feature off), the optimizer and LR-schedule names, and
the reference table below of every supported key with its default and valid values, which
``tests/test_config.py`` checks against the tables.

Supported keys
--------------

================================================================  ============  ==========================================
key                                                               default       meaning / valid values
================================================================  ============  ==========================================
train_batch_size                                                  derived       micro × accumulation × world size
train_micro_batch_size_per_gpu                                    derived / 1   samples per rank per forward
gradient_accumulation_steps                                       derived / 1   micro-batches per optimizer step
gradient_clipping                                                 1.0           max global L2 grad norm (DeepSpeed 0.19's default); 0 = off
steps_per_print                                                   10            integer >= 1, or inf (never; Accelerate):
                                                                                rank 0's "step=N, skipped, lr, mom" line
                                                                                every N steps (engine/timers.py)
wall_clock_breakdown                                              false         bool; per-phase ms (fwd, bwd, step, ...)
                                                                                and MB sent, at the steps_per_print
                                                                                cadence; synchronizes: diagnostic only
fp16.enabled                                                      false         bool (not together with bf16)
fp16.loss_scale                                                   0.0           0 = dynamic, > 0 = static scale
fp16.initial_scale_power                                          16            dynamic scale starts at 2**power
fp16.loss_scale_window                                            1000          good steps before the scale doubles
fp16.hysteresis                                                   2             overflows absorbed before halving
fp16.consecutive_hysteresis                                       false         refill hysteresis on each good step
fp16.min_loss_scale                                               1.0           > 0, floor of the dynamic scale
fp16.auto_cast                                                    false         bool; engine.forward casts floating
                                                                                inputs to fp16 (DeepSpeed's meaning; no
                                                                                input is ever cast otherwise)
bf16.enabled (also spelled ``bfloat16``)                          false         bool
bf16.bf16_master_weights_and_grads                                false         bool; no fp32 master copy: the optimizer
                                                                                updates bf16 values from bf16 gradients
bf16.bf16_optimizer_states                                        false         bool; optimizer states in bf16 (needs
                                                                                bf16_master_weights_and_grads)
bf16.check_grad_overflow                                          true          bool; skip a step whose gradient norm is
                                                                                not finite (engine.skipped_steps)
torch_autocast.enabled                                            false         bool; forward under torch.autocast; params
                                                                                keep fp32, or bf16 with bf16.enabled (no fp16)
torch_autocast.dtype                                              null          "bf16" | "fp16" | null (device default);
                                                                                "bf16" (or null on CPU) with bf16.enabled
torch_autocast.lower_precision_safe_modules                       null          class paths (exact; null: Linear, ConvNd):
                                                                                stage 1-3 grads reduced in the autocast dtype
communication_data_type                                           null          "fp32" | "fp16" | "bf16": the dtype
                                                                                gradients are reduced in; null = the
                                                                                compute dtype
prescale_gradients                                                false         bool; divide by the world size before
                                                                                the reduction (zero-core's default too)
gradient_predivide_factor                                         1.0           > 0; f != 1: divide by f before the
                                                                                reduction and by world/f after it
data_types.grad_accum_dtype                                       null          null | compute dtype | "fp32" (bf16/fp16
                                                                                training): dtype of accumulated grads
data_types.param_dtype                                            null          must match fp16/bf16.enabled
tensorboard.enabled                                               false         bool; rank 0 writes DeepSpeed's events
tensorboard.output_path                                           ""            directory ("": the working directory)
tensorboard.job_name                                              "DeepSpeed…"  subdirectory (default "DeepSpeedJobName")
csv_monitor.enabled                                               false         bool; rank 0 writes DeepSpeed's events
csv_monitor.output_path                                           ""            directory ("": the working directory)
csv_monitor.job_name                                              "DeepSpeed…"  subdirectory (default "DeepSpeedJobName")
wandb.enabled                                                     false         bool (needs the wandb package)
wandb.group                                                       null          W&B run group
wandb.team                                                        null          W&B entity
wandb.project                                                     "deepspeed"   W&B project
comet.enabled                                                     false         bool (needs comet_ml)
comet.samples_log_interval                                        100           samples between two logs of an event
comet.project                                                     null          passed to comet_ml.start
comet.workspace                                                   null          passed to comet_ml.start
comet.api_key                                                     null          passed to comet_ml.start
comet.experiment_name                                             null          passed to comet_ml.start
comet.experiment_key                                              null          passed to comet_ml.start
comet.online                                                      null          passed to comet_ml.start
comet.mode                                                        null          passed to comet_ml.start
checkpoint.tag_validation                                         "Warn"        "Warn" | "Ignore" | "Fail": ranks saving
                                                                                under different tags
checkpoint.save_dir (zero-core)                                   null          directory of periodic saves and of resume
checkpoint.save_interval_steps (zero-core)                        null          save every N optimizer steps (>= 1)
checkpoint.save_interval_minutes (zero-core)                      null          save every T minutes (> 0; rank 0's clock)
checkpoint.async_save (zero-core)                                 false         bool; periodic saves written in the
                                                                                background (save_checkpoint's default)
checkpoint.keep_last (zero-core)                                  null          complete checkpoints kept in save_dir
                                                                                (>= 1; null: all)
checkpoint.resume (zero-core)                                     "auto"        "auto" | "require" | "never": load the
                                                                                newest checkpoint of save_dir at start
checkpoint.resume_batch (zero-core)                               "keep_global" "keep_global" | "keep_micro": the batch
                                                                                on another world size
optimizer.type                                                    required      Adam | AdamW | SGD | Lamb | OneBitAdam |
                                                                                ZeroOneAdam | OneBitLamb (1-bit: stage 0)
optimizer.params.lr                                               1e-3          >= 0
optimizer.params.betas (Adam, AdamW)                              [0.9, 0.999]  two numbers in [0, 1)
optimizer.params.eps (Adam, AdamW)                                1e-8          > 0
optimizer.params.weight_decay                                     0.0           >= 0
optimizer.params.adam_w_mode (Adam, AdamW)                        true          decoupled decay; DeepSpeed's default
                                                                                for "Adam" too; false is refused for AdamW
optimizer.params.bias_correction (Adam, AdamW)                    true          bool
optimizer.params.max_coeff (Lamb, OneBitLamb)                     10.0          > 0, upper clamp of the trust ratio
optimizer.params.min_coeff (Lamb, OneBitLamb)                     0.01          >= 0, lower clamp of the trust ratio
optimizer.params.momentum (SGD)                                   0.0           >= 0
optimizer.params.dampening (SGD)                                  0.0           >= 0
optimizer.params.nesterov (SGD)                                   false         needs momentum > 0, dampening 0
optimizer.params.freeze_step (OneBitAdam, OneBitLamb)             100000        >= 0; uncompressed warm-up steps
optimizer.params.var_freeze_step (ZeroOneAdam)                    100000        >= 0; last step that may update the variance
optimizer.params.var_update_scaler (ZeroOneAdam)                  16            >= 1; full steps per doubling of their interval
optimizer.params.local_step_scaler (ZeroOneAdam)                  32678         >= 1; local steps per doubling of their interval
optimizer.params.local_step_clipper (ZeroOneAdam)                 16            >= 1; largest local-step interval
optimizer.params.coeff_beta (OneBitLamb)                          0.9           in [0, 1); average of warm-up coefficients
optimizer.params.factor_max (OneBitLamb)                          4.0           > 0; clamp of the frozen coefficient's factor
optimizer.params.factor_min (OneBitLamb)                          0.5           >= 0, <= factor_max; its lower clamp
optimizer.params.factor_threshold (OneBitLamb)                    0.1           >= 0; the factor's largest change per step
optimizer.params.comm_backend_name (1-bit optimizers)             "nccl"        "nccl"|"mpi"|"hccl"|"compressed"; the engine's
                                                                                communicator carries it (warns if another)
optimizer.params.cuda_aware (1-bit optimizers)                    false         only false (communicators stage memory)
scheduler.type                                                    required      WarmupLR | WarmupDecayLR | WarmupCosineLR
scheduler.params.warmup_min_lr (WarmupLR, WarmupDecayLR)          0.0           lr at the start; number or list
scheduler.params.warmup_max_lr (WarmupLR)                         optimizer lr  lr after warmup; number or list
scheduler.params.warmup_max_lr (WarmupDecayLR)                    0.001         lr after warmup; number or list
scheduler.params.warmup_num_steps                                 1000          >= 0 (at least 2 are used; 0 is
                                                                                the HF Trainer's "no warmup")
scheduler.params.warmup_type                                      "log"         "log" | "linear"
scheduler.params.total_num_steps (WarmupDecayLR, WarmupCosineLR)  required      >= 1
scheduler.params.warmup_min_ratio (WarmupCosineLR)                0.0           in [0, 1], × optimizer lr
scheduler.params.cos_min_ratio (WarmupCosineLR)                   1e-4          in [0, 1], × optimizer lr
scheduler.params.last_batch_iteration                             -1            >= -1 (resume position)
zero_optimization.stage                                           0             0, 1, 2 or 3
zero_optimization.reduce_bucket_size                              5e6           elements, >= 1
zero_optimization.overlap_comm                                    true          bool
zero_optimization.reduce_scatter                                  true          bool
zero_optimization.stage3_prefetch_bucket_size                     5e7           elements gathered ahead of use, >= 0
zero_optimization.stage3_param_persistence_threshold              1e5           parameters with fewer elements stay
                                                                                gathered until the next step, >= 0
zero_optimization.stage3_max_live_parameters                      1e9           elements gathered at once, >= 0
                                                                                (0: nothing beyond what runs now)
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
zero_optimization.mics_shard_size                                 -1            MiCS: ranks one copy of the model states is
                                                                                spread over (normally the ranks per node),
                                                                                replicated across groups; -1 = off;
                                                                                divides the world size; stages 1-3
zero_optimization.mics_hierarchical_params_gather                 false         bool; MiCS shard groups spanning nodes
                                                                                gather node-aware (below)
zero_optimization.node_aware_collectives                          true          bool; on several nodes, partition
                                                                                all-gathers cross nodes once then fan out
                                                                                in the node (reduce-scatters in reverse)
zero_optimization.sub_group_size                                  1e9           elements the offloaded optimizer steps at
                                                                                once (NVMe: one swap unit), >= 0
                                                                                (0: the smallest sub-groups)
zero_optimization.offload_optimizer.device                        "none"        "none" | "cpu" | "nvme": fp32 master weights
                                                                                and optimizer states in host memory / in
                                                                                files; stepped on the CPU (stages 1-3)
zero_optimization.offload_optimizer.nvme_path                     null          directory for the swap files (device nvme;
                                                                                a subdirectory per rank is created/removed)
zero_optimization.offload_optimizer.pin_memory                    false         bool; page-locked host buffers where the
                                                                                accelerator has pinning (no-op on the CPU)
zero_optimization.offload_optimizer.buffer_count                  4             sub-group buffers in host memory (nvme):
                                                                                read-ahead + compute + write-behind, >= 3
zero_optimization.offload_optimizer.ratio                         1.0           [0, 1]; first 1-ratio of sub-groups on device
zero_optimization.offload_optimizer.super_offload                 false         bool; host step speculated, checked at step()
zero_optimization.offload_optimizer.cpuadam_cores_perc            0.8           (0, 1]; super_offload worker's share of cores
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
zero_optimization.zenflow.topk_ratio                              0.1           0 < r < 1: top columns on the device
zero_optimization.zenflow.select_strategy                         "auto"        "auto" (= "epoch", 1) | "step" | "epoch"
zero_optimization.zenflow.select_interval                         "auto"        "auto" | steps/epochs >= 0 (0: select once)
zero_optimization.zenflow.update_interval                         "auto"        "auto" (auto_ratio) | integer >= 1
zero_optimization.zenflow.auto_ratio                              0.99          0..1; "auto": share of 2-D weights due
zero_optimization.zenflow.overlap_step                            false         bool; host update on a worker thread
zero_optimization.zenflow.offload                                 false         bool; device moments in host memory
zero_optimization.zenflow.full_warm_up_rounds                     0             steps of full host updates first, >= 0
zero_optimization.zenflow.pt_reserved_cores_perc                  0.5           0..1; cores the worker thread keeps off
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
safety.nonfinite_gradients (zero-core)                            "skip"        "skip" | "raise" | "ignore": a step with an
                                                                                inf/NaN gradient norm (fp32, bf16; fp16
                                                                                skips through its loss scaler); bf16
                                                                                check_grad_overflow false = "ignore"
safety.max_consecutive_skips (zero-core)                          10            skipped steps in a row that raise, >= 0
                                                                                (0: never)
safety.check_ranks_agree (zero-core)                              true          bool; compare config, parameters and
                                                                                versions across ranks at initialize
safety.check_batch_sizes (zero-core)                              true          bool; compare the samples per rank at
                                                                                every step (leading dimension of the
                                                                                first tensor given to engine(...))
safety.launcher_notice (zero-core)                                true          bool; one line when no launcher started
                                                                                the job (also ZERO_CORE_QUIET=1)
generation.max_live_parameters (zero-core)                        null          elements >= 0 that stage 3 keeps gathered
                                                                                across forwards without autograd (decode
                                                                                steps); null = stage3_max_live_parameters
hybrid_engine.enabled                                             false         bool; engine.generate gathers as
                                                                                pin_parameters says (docs/GENERATION.md)
hybrid_engine.max_out_tokens                                      512           >= 1; engine.generate refuses prompts +
                                                                                new tokens above it
hybrid_engine.inference_tp_size                                   1             1 (tensor parallelism is refused)
hybrid_engine.release_inference_cache                             false         bool; free the gathered copies when
                                                                                generate returns (else at training)
hybrid_engine.pin_parameters                                      true          bool; gather the whole model once per
                                                                                generate (false: within the budget)
elasticity.enabled                                                false         bool; true: the batch triple is computed
                                                                                (zero_core/config/elasticity.py); false:
                                                                                the section has no effect
elasticity.max_train_batch_size                                   required      >= 1, largest acceptable global batch
elasticity.micro_batch_sizes                                      required      list of integers >= 1 (micro batch per
                                                                                rank candidates)
elasticity.min_gpus                                               1             >= 1, smallest world size planned for
elasticity.max_gpus                                               10000         >= min_gpus, largest world size planned
elasticity.prefer_larger_batch                                    true          bool; tie-break between global batches
elasticity.ignore_non_elastic_batch_info                          false         bool; true: elastic values override the
                                                                                batch keys (else those are refused)
elasticity.version                                                0.2           0.1 | 0.2 (0.2 plans in whole nodes)
elasticity.num_gpus_per_node                                      1             >= 1; ranks per node (version 0.2)
elasticity.model_parallel_size                                    1             only 1 (model parallelism is refused)
flops_profiler.enabled                                            false         bool; rank 0 profiles one step (engine/flops.py)
flops_profiler.profile_step                                       1             >= 0: optimizer steps done before the profiled one
flops_profiler.recompute_fwd_factor                               0.0           >= 0; bwd FLOPs = (2 + factor) x fwd (recompute)
flops_profiler.module_depth                                       -1            >= -1; deepest module level shown (-1: all)
flops_profiler.top_modules                                        1             >= 1; module classes listed per depth
flops_profiler.detailed                                           true          bool; the per-module tree
flops_profiler.output_file                                        null          file written atomically instead of stdout
flops_profiler.peak_tflops (zero-core)                            null          > 0: peak TFLOP/s per device for the MFU (null:
                                                                                datasheet GPU table, else a measured matmul)
================================================================  ============  ==========================================

Accepted without effect (``NO_EFFECT_KEYS``, any value): DeepSpeed keys that tune only speed,
logging or a DeepSpeed-internal mechanism, each with the reason in the table.

Keys no table lists. Unknown top-level keys are ignored with a
:class:`~zero_core.errors.ConfigWarning` naming them, as DeepSpeed ignores them. Inside a
section, DeepSpeed decides: in a section it reads key by key (``LENIENT_SECTIONS``, in
:mod:`zero_core.config.deepspeed_sections`) an unknown
key is ignored with a ``ConfigWarning`` naming its dotted path; in a section it validates as a
whole (pydantic models that forbid extra keys, constructor arguments) an unknown key is an
error, as there. In both, a near-miss of a key DeepSpeed or zero-core reads there is an error
with a "did you mean": a misspelt key never trains with the default of the key it meant (the
rule is in :mod:`zero_core.config.checks`).

A section switched off with ``"enabled": false`` is not read: its key names are checked as
above, its values are not (the section keeps its defaults, as DeepSpeed leaves the feature
off), and a not-yet-implemented key in it asks for nothing. A refused feature's section
(``_SWITCHABLE_SECTIONS``) is accepted when every switch in it is off; its keys are checked
against DeepSpeed's (``DEEPSPEED_SECTION_KEYS``) the same way.

Batch size: ``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps
× world size``; any two of the three are enough (the third is derived). With ``elasticity``
enabled the section decides all three (config/elasticity.py); a resumed run on another world
size keeps the saved global batch (``checkpoint.resume_batch``, checkpoint/resume.py).

The ``activation_checkpointing`` section is read by ``zero_core.checkpointing.configure(mpu,
deepspeed_config=...)`` (as in DeepSpeed, the model code calls it; the engine does not).

Adding a key later (stage 3, ZeRO++, offload, checkpoints): move its name from
``NOT_YET_IMPLEMENTED`` to ``SUPPORTED_KEYS``, read it in the section's ``_parse_*`` function
(:mod:`zero_core.config.parser`) and add a row to the table above. ``tests/test_config.py``
checks the three stay in step.
"""
from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_KEYS", "NO_EFFECT_KEYS", "NOT_YET_IMPLEMENTED", "NEUTRAL_VALUES",
           "OPTIMIZER_TYPES", "SCHEDULER_TYPES",
           "MAX_ZERO_STAGE"]

# ---------------------------------------------------------------------------------------------
# The key tables: the one place that says what zero-core accepts. A section is named by its
# dotted path; sections whose keys depend on a "type" get ":<Type>" appended.
# ---------------------------------------------------------------------------------------------

_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction")
_ONEBIT = ("lr", "betas", "eps", "weight_decay", "comm_backend_name", "cuda_aware")
_WARMUP_PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                  "last_batch_iteration")

SUPPORTED_KEYS: dict[str, tuple[str, ...]] = {
    "": ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
         "gradient_clipping", "fp16", "bf16", "bfloat16", "optimizer", "scheduler",
         "zero_optimization", "steps_per_print", "wall_clock_breakdown",
         "activation_checkpointing",
         "communication_data_type", "prescale_gradients", "gradient_predivide_factor",
         "data_types", "torch_autocast", "checkpoint",
         "tensorboard", "csv_monitor", "wandb", "comet",
         "accelerator", "comm_backend", "comm_timeout", "topology", "safety", "generation",
         "hybrid_engine", "elasticity", "flops_profiler"),
    "fp16": ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "auto_cast"),
    "bf16": ("enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states",
             "check_grad_overflow"),
    "optimizer": ("type", "params"),
    "optimizer.params:Adam": _ADAM_PARAMS,
    "optimizer.params:AdamW": _ADAM_PARAMS,
    "optimizer.params:SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "optimizer.params:Lamb": ("lr", "betas", "eps", "weight_decay", "bias_correction",
                              "max_coeff", "min_coeff"),
    "optimizer.params:OneBitAdam": _ONEBIT + ("freeze_step",),
    "optimizer.params:OneBitLamb": _ONEBIT + ("max_coeff", "min_coeff", "freeze_step",
                                              "coeff_beta", "factor_max", "factor_min",
                                              "factor_threshold"),
    "optimizer.params:ZeroOneAdam": _ONEBIT + ("var_freeze_step", "var_update_scaler",
                                               "local_step_scaler", "local_step_clipper"),
    "scheduler": ("type", "params"),
    "scheduler.params:WarmupLR": _WARMUP_PARAMS,
    "scheduler.params:WarmupDecayLR": _WARMUP_PARAMS + ("total_num_steps",),
    "scheduler.params:WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps",
                                        "cos_min_ratio", "warmup_type", "last_batch_iteration"),
    "zero_optimization": ("stage", "reduce_bucket_size", "overlap_comm", "reduce_scatter",
                          "stage3_prefetch_bucket_size", "prefetch_bucket_size",
                          "stage3_param_persistence_threshold", "param_persistence_threshold",
                          "stage3_max_live_parameters", "max_live_parameters",
                          "stage3_max_reuse_distance", "max_reuse_distance",
                          "stage3_gather_16bit_weights_on_model_save",
                          "gather_16bit_weights_on_model_save",
                          "stage3_gather_fp16_weights_on_model_save",
                          "offload_optimizer", "offload_param", "sub_group_size",
                          "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                          "zero_hpz_partition_size", "zero_quantized_gradients",
                          "mics_shard_size", "mics_hierarchical_params_gather",
                          "node_aware_collectives", "zenflow"),
    "zero_optimization.offload_optimizer": ("device", "nvme_path", "pin_memory", "buffer_count",
                                            "ratio", "super_offload", "cpuadam_cores_perc"),
    "zero_optimization.offload_param": ("device", "nvme_path", "pin_memory", "buffer_count",
                                        "buffer_size", "max_in_cpu"),
    "zero_optimization.zenflow": ("topk_ratio", "select_strategy", "select_interval", "offload",
        "update_interval", "auto_ratio", "overlap_step", "full_warm_up_rounds",
        "pt_reserved_cores_perc"),
    "data_types": ("grad_accum_dtype", "param_dtype"),
    "torch_autocast": ("enabled", "dtype", "lower_precision_safe_modules"),
    "checkpoint": ("tag_validation", "save_dir", "save_interval_steps", "save_interval_minutes",
                   "async_save", "keep_last", "resume", "resume_batch"),
    "tensorboard": ("enabled", "output_path", "job_name"),
    "csv_monitor": ("enabled", "output_path", "job_name"),
    "wandb": ("enabled", "group", "team", "project"),
    "comet": ("enabled", "samples_log_interval", "project", "workspace", "api_key",
              "experiment_name", "experiment_key", "online", "mode"),
    "topology": ("ranks_per_node",),
    "elasticity": ("enabled", "max_train_batch_size", "micro_batch_sizes", "min_gpus", "max_gpus",
                   "prefer_larger_batch", "ignore_non_elastic_batch_info", "version",
                   "num_gpus_per_node", "model_parallel_size"),
    "generation": ("max_live_parameters",),
    "hybrid_engine": ("enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache",
                      "pin_parameters"),
    "safety": ("nonfinite_gradients", "max_consecutive_skips", "check_ranks_agree",
               "check_batch_sizes", "launcher_notice"),
    "flops_profiler": ("enabled", "recompute_fwd_factor", "profile_step", "module_depth",
                       "top_modules", "detailed", "output_file", "peak_tflops"),
    "activation_checkpointing": ("partition_activations", "cpu_checkpointing",
                                 "contiguous_memory_optimization", "number_checkpoints",
                                 "synchronize_checkpoint_boundary", "profile"),
}

# DeepSpeed keys that only tune speed, logging or a DeepSpeed-internal mechanism zero-core does
# not have, and that DeepSpeed documents as leaving the training result unchanged: accepted at
# any value, without effect (the reason is what the reference table below says).
NO_EFFECT_KEYS: dict[str, str] = {
    "zero_allow_untested_optimizer": "DeepSpeed's permission for client optimizers under ZeRO; "
                                     "zero-core checks a client optimizer itself (element-wise "
                                     "update rules only at stages 1-2)",
    "optimizer.params.torch_adam": "picks torch.optim.Adam instead of DeepSpeed's fused Adam "
                                   "kernel (the same update; zero-core picks its own kernel)",
    "zero_optimization.allgather_bucket_size": "the bucket size of DeepSpeed's stage 1-2 "
                                               "all-gather of updated parameters (speed and "
                                               "memory only; zero-core gathers per group)",
    "zero_optimization.contiguous_gradients": "whether DeepSpeed copies gradients into one "
                                              "buffer (memory fragmentation only; zero-core's "
                                              "gradients always live in flat buffers)",
    "hybrid_engine.tp_gather_partition_size": "layers per gather under tensor parallelism, "
                                              "which is off (inference_tp_size must be 1)",
    "elasticity.min_time": "a hint to the cluster's resource scheduler; DeepSpeed's batch "
                           "computation does not read it either",
    "zero_force_ds_cpu_optimizer": "picks DeepSpeed's CPU Adam kernel for offload; zero-core "
                                   "always steps offloaded states with its own CPU kernel",
    "aio": "tunes DeepSpeed's async-I/O library; zero-core's NVMe path has its own I/O",
    "dataloader_drop_last": "DeepSpeed's training_data loader keeps a short last batch unless "
                            "true; zero-core's (initialize(training_data=)) always leaves out "
                            "the tail that does not fill a micro-step on every rank, so that a "
                            "resumed run reads each sample once (docs/usage.md)",
    "seq_parallel_communication_data_type": "only used with sequence parallelism, which is "
                                            "off (sequence_parallel_size 1)",
    "timers": "throughput timer logging",
    "vocabulary_size": "DeepSpeed only warns when it is not a multiple of 8 (tensor-core "
                       "alignment)",
    "datastates_ckpt": "DeepSpeed's DataStates checkpoint engine (speed only; DeepSpeed falls "
                       "back to torch.save without it; zero-core's background saves are "
                       "checkpoint.async_save)",
    "log_level": "DeepSpeed's own logger level",
    "disable_python_gc": "when DeepSpeed runs Python's garbage collector (speed only)",
    "legacy_fusion": "which fused kernel DeepSpeed's fp16 optimizer calls (speed only)",
    "optimizer.legacy_fusion": "which fused kernel DeepSpeed's fp16 optimizer calls (speed "
                               "only; DeepSpeed reads it here, in the optimizer section)",
    "zero_optimization.enable_sanity_checks": "DeepSpeed's internal debugging checks",
    "bf16.immediate_grad_update": "when DeepSpeed's bf16 optimizer adds gradients into its "
                                  "fp32 copy; the sum is the same",
    "zero_optimization.round_robin_gradients": "the order of gradient copies for offload "
                                               "(speed only)",
    "zero_optimization.memory_efficient_linear": "a stage-3 linear-layer implementation that "
                                                 "saves activation memory; results are equal",
    "zero_optimization.log_trace_cache_warnings": "stage-3 trace-cache logging",
    "zero_optimization.stage3_allgather_sequential": "gathers stage-3 parameters one by one "
                                                     "instead of in buckets (memory and speed "
                                                     "only; the gathered values are the same)",
    "zero_optimization.allgather_sequential": "gathers stage-3 parameters one by one instead "
                                              "of in buckets (memory and speed only)",
    "zero_optimization.use_multi_rank_bucket_allreduce": "how DeepSpeed batches all-reduces "
                                                         "(speed only)",
    "zero_optimization.stage3_module_granularity_threshold": "how DeepSpeed groups small "
                                                             "modules into fetches (speed only)",
    "zero_optimization.module_granularity_threshold": "how DeepSpeed groups small modules into "
                                                      "fetches (speed only)",
    "zero_optimization.offload_optimizer.fast_init": "DeepSpeed's fast NVMe state-file "
                                                     "initialisation; zero-core's state files "
                                                     "always start as sparse zero files",
    "zero_optimization.offload_optimizer.pipeline_read": "DeepSpeed's overlapped NVMe reads; "
                                                         "zero-core's are always overlapped",
    "zero_optimization.offload_optimizer.pipeline_write": "DeepSpeed's overlapped NVMe writes; "
                                                          "zero-core's are always overlapped",
    "checkpoint.parallel_write": "pipeline-stage parallel writes (no pipeline here)",
    "checkpoint.checkpoint_serialization": "torch.save serialization of DeepSpeed's files; "
                                           "zero-core writes safetensors",
    "checkpoint.writer": "DeepSpeed's fast/decoupled checkpoint writers (speed only; "
                         "zero-core's writes are atomic and verified)",
}

# DeepSpeed keys zero-core does not implement yet: pattern -> what the key is for. Refused by
# name, so that a DeepSpeed config never trains with a feature silently missing.
NOT_YET_IMPLEMENTED: dict[str, dict[str, str]] = {
    "": {
        "amp": "NVIDIA Apex AMP",
        "gradient_allreduce_op": "choosing sum instead of mean for the gradient reduction",
        "sparse_gradients": "sparse embedding gradients",
        "load_universal_checkpoint": "universal checkpoints",
        "use_node_local_storage": "node-local checkpoint storage",
        "pipeline": "pipeline parallelism",
        "tensor_parallel": "tensor parallelism (AutoTP)",
        "expert_parallel": "expert parallelism (AutoEP)",
        "sequence_parallel_size": "sequence parallelism",
        "autotuning": "the autotuner",
        "comms_logger": "the communication logger (zero-core's ledger records every collective)",
        "compression_training": "compression training",
        "data_efficiency": "data efficiency (curriculum learning, data routing)",
        "curriculum_learning": "curriculum learning",
        "progressive_layer_drop": "progressive layer drop",
        "eigenvalue": "eigenvalue computation",
        "quantize_training": "quantization-aware training",
        "weight_quantization": "weight quantization",
        "sparse_attention": "sparse attention kernels",
        "nebula": "Nebula checkpointing",
        "compile": "DeepCompile (compile.deepcompile: DeepSpeed's own compiler passes; "
                   "engine.compile() compiles the model's blocks with torch.compile)",
        "memory_breakdown": "memory breakdown logging",
        "dump_state": "state dump at start",
        "disable_allgather": "broadcast instead of all-gather",
        "graph_harvesting": "CUDA graph harvesting",
        "managed_gradient_accumulation": "client-managed accumulation boundaries",
        "use_data_before_expert_parallelism": "MoE data layout",
    },
    "fp16": {
        "fp16_master_weights_and_grads": "fp16 master weights",
    },
    "data_types": {
        "buffer_dtype": "a separate dtype for module buffers",
        "keep_in_fp32_modules": "modules kept in fp32 under bf16/fp16",
    },
    "checkpoint": {
        "load_universal": "loading universal checkpoints",
        "use_node_local_storage": "node-local checkpoint storage",
    },
    "optimizer.params:Adam": {"amsgrad": "AMSGrad", "fused": "the fused torch kernel switch"},
    "optimizer.params:AdamW": {"amsgrad": "AMSGrad", "fused": "the fused torch kernel switch"},
    "optimizer.params:Lamb": {"max_grad_norm": "FusedLamb's own gradient clipping (use "
                                               "gradient_clipping)",
                              "eps_inside_sqrt": "eps inside the square root",
                              "amsgrad": "AMSGrad"},
    **{f"optimizer.params:{k}": {"amsgrad": "AMSGrad (DeepSpeed refuses it here too)",
                                 "max_grad_norm": "the optimizer's own clipping (use "
                                                  "gradient_clipping)",
                                 "eps_inside_sqrt": "eps inside the square root"}
       for k in ("OneBitAdam", "OneBitLamb", "ZeroOneAdam")},
    "zero_optimization": {
        "stage3_model_persistence_threshold": "ZeRO stage 3 whole-model persistence limit",
        "model_persistence_threshold": "ZeRO stage 3 whole-model persistence limit",
        "stage3_use_all_reduce_for_fetch_params": "ZeRO stage 3 all-reduce fetch",
        "use_all_reduce_for_fetch_params": "ZeRO stage 3 all-reduce fetch",
        "stage3_*": "this ZeRO stage 3 option",
        "cpu_offload": "optimizer offload (ZeRO-Offload; use offload_optimizer)",
        "cpu_offload_param": "parameter offload (use offload_param)",
        "cpu_offload_use_pin_memory": "pinned offload buffers (use offload_*.pin_memory)",
        "zeropp_loco_param": "ZeRO++ LoCo error feedback",
        "elastic_checkpoint": "elastic checkpoints",
        "load_from_fp32_weights": "loading the master weights from the 16-bit weights",
        "allgather_partitions": "broadcast instead of all-gather for updated parameters",
        "ignore_unused_parameters": "an error for parameters that get no gradient",
        "legacy_stage1": "legacy stage 1",
        "pipeline_loading_checkpoint": "pipelined checkpoint loading",
        "override_module_apply": "module.apply override",
        "compute_grad_norm": "switching off the gradient norm",
        "parameter_alignment": "16-byte parameter alignment",
        "save_muon_momentum_buffer_in_memory": "the Muon optimizer",
        "leaf_module": "stage-3 leaf modules (fetching a module's whole subtree at once)",
    },
    "hybrid_engine": {
        "enable_cuda_graph": "CUDA graphs for generation",
    },
}

# A not-yet-implemented key is accepted at exactly one value: the one that asks for what
# zero-core already does (DeepSpeed's default, the feature off). Any other value is refused.
NEUTRAL_VALUES: dict[str, Any] = {
    "fp16.fp16_master_weights_and_grads": False,
    "optimizer.params.amsgrad": False,
    "optimizer.params.max_grad_norm": 0.0,
    "optimizer.params.eps_inside_sqrt": False,
    "gradient_allreduce_op": "mean",
    "sparse_gradients": False,
    "memory_breakdown": False,
    "dump_state": False,
    "disable_allgather": False,
    "graph_harvesting": False,
    "managed_gradient_accumulation": False,
    "use_data_before_expert_parallelism": False,
    "load_universal_checkpoint": False,
    "use_node_local_storage": False,
    "sequence_parallel_size": 1,
    "data_types.buffer_dtype": None,
    "checkpoint.load_universal": False,
    "checkpoint.use_node_local_storage": False,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.cpu_offload": False,
    "zero_optimization.cpu_offload_param": False,
    "zero_optimization.cpu_offload_use_pin_memory": False,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.legacy_stage1": False,
    "zero_optimization.pipeline_loading_checkpoint": False,
    "zero_optimization.override_module_apply": True,
    "zero_optimization.compute_grad_norm": True,
    "zero_optimization.parameter_alignment": False,
    "zero_optimization.use_all_reduce_for_fetch_params": False,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": False,
    "zero_optimization.zeropp_loco_param": None,
    "hybrid_engine.enable_cuda_graph": False,
}
# Whole sections that ask for nothing when every switch in them is off: "enabled": false
# anywhere inside, "deepcompile": false, sizes of 1 ("autotp_size": 1, "tp_size": 1); DeepSpeed
# defaults each of these switches to off, so a section with none of them asks for nothing.
_SWITCHABLE_SECTIONS = frozenset({
    "comms_logger", "autotuning", "expert_parallel", "amp",
    "eigenvalue", "progressive_layer_drop", "curriculum_learning", "nebula", "compile",
    "tensor_parallel", "compression_training", "data_efficiency", "quantize_training",
    "weight_quantization",
})

OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_OPTIMIZERS_NOT_YET = ("Muon", "Adagrad",
                       "Lion", "FusedAdam", "CPUAdam", "Adafactor", "RMSprop", "MuAdam",
                       "MuAdamW", "MuSGD")
_SCHEDULERS_NOT_YET = ("LRRangeTest", "OneCycle")

MAX_ZERO_STAGE = 3  # stages above this are refused as "not implemented yet"
