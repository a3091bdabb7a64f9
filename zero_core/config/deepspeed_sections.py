"""What DeepSpeed itself accepts inside its sections, where zero-core follows it: the
sections whose unknown keys DeepSpeed ignores (``LENIENT_SECTIONS``: zero-core warns, naming
the key), and the keys DeepSpeed reads in the sections of features zero-core refuses unless
switched off (``DEEPSPEED_SECTION_KEYS``). Read by checks.py; the key tables of what zero-core
itself reads are keys.py's.
"""
from __future__ import annotations

# Sections DeepSpeed reads key by key (dict lookups), ignoring the keys it does not know there:
# section -> the end of the warning that names such a key ("ignored, as DeepSpeed ..."). zero-core
# ignores the key too, aloud; a near-miss of a key read there stays an error (checks.py). Every
# section not listed refuses an unknown key, as DeepSpeed does: zero_optimization and its
# offload_* (pydantic models with extra keys forbidden since DeepSpeed 0.7.0), tensorboard /
# csv_monitor / wandb / comet and hybrid_engine (pydantic since they exist), comms_logger and
# tensor_parallel (pydantic), optimizer.params and scheduler.params (keyword arguments of the
# optimizer and the schedule class: a TypeError there), and zero-core's own sections (safety,
# topology, generation). The top level ("") is lenient too, with its own warning (checks.py).
# Where DeepSpeed reads each (DeepSpeed's repository, deepspeed/...):
#   fp16, bf16: runtime/config.py get_fp16_enabled, get_dynamic_loss_scale_args,
#     get_bfloat16_enabled (get_scalar_param) up to 0.17.0; since 0.17.1 (PR #6976)
#     runtime/precision_config.py, pydantic models that forbid extra keys. Configs written for
#     the releases before (GPT-NeoX's "fp16": {"fp16": true, ...}, trlx's Apex "opt_level", a
#     bf16 block copied from an fp16 one) ran with those keys ignored, and still do there.
#   compile: not read at all from 0.14.4 (PR #5581) to 0.16.5; a pydantic model before (0.13.2
#     to 0.14.3: enabled / backend / kwargs for torch.compile) and after (0.16.6, PR #7154:
#     DeepCompile). Its keys only ever changed speed; axolotl's {"disable": false, "backend":
#     "inductor"} is of that era.
#   optimizer, scheduler: runtime/config.py get_optimizer_name / _params / _legacy_fusion,
#     get_scheduler_name / _params. data_types: get_data_types_params(...).get(...).
#     torch_autocast: get_torch_autocast_* (get_scalar_param). checkpoint:
#     get_checkpoint_params(...).get(...) and model_checkpointing/config.py.
#     activation_checkpointing: activation_checkpointing/config.py (get_scalar_param).
#     elasticity: elasticity/config.py ElasticityConfig (dict.get).
#   flops_profiler: profiling/config.py; nebula: nebula/config.py; eigenvalue,
#     progressive_layer_drop: runtime/config.py get_eigenvalue_* / get_pld_*; curriculum_learning,
#     data_efficiency: runtime/data_pipeline/config.py; autotuning: autotuning/config.py (all
#     get_scalar_param); expert_parallel: module_inject/auto_ep_config.py (dict.get).
_AS_DEEPSPEED = "as DeepSpeed ignores it"
LENIENT_SECTIONS: dict[str, str] = {
    "fp16": "as DeepSpeed up to 0.17.0 ignores it",
    "bf16": "as DeepSpeed up to 0.17.0 ignores it",
    "compile": "as DeepSpeed 0.14.4 to 0.16.5 ignores the whole section (torch.compile "
               "settings change speed only; zero-core compiles with engine.compile())",
    **dict.fromkeys(("optimizer", "scheduler", "data_types", "torch_autocast", "checkpoint",
                     "activation_checkpointing", "elasticity", "flops_profiler", "nebula",
                     "eigenvalue", "progressive_layer_drop", "curriculum_learning",
                     "data_efficiency", "autotuning", "expert_parallel"), _AS_DEEPSPEED),
}

# The first-level keys DeepSpeed reads in the sections of features zero-core refuses unless
# switched off (_SWITCHABLE_SECTIONS), from DeepSpeed's config classes: they are checked like
# any section's keys (LENIENT_SECTIONS says whether an unknown one is a warning or an error; a
# near-miss is an error). Sections not listed (amp: Apex's own arguments; compression_training,
# quantize_training, weight_quantization: groups nested per technique) get their switch names
# checked for near-misses only.
DEEPSPEED_SECTION_KEYS: dict[str, tuple[str, ...]] = {
    "comms_logger": ("enabled", "prof_all", "prof_ops", "verbose", "debug"),
    "nebula": ("enabled", "enable_nebula_load", "nebula_load_path", "persistent_storage_path",
               "persistent_time_interval", "num_of_version_in_retention"),
    "eigenvalue": ("enabled", "verbose", "max_iter", "tol", "stability",
                   "gas_boundary_resolution", "layer_name", "layer_num"),
    "progressive_layer_drop": ("enabled", "theta", "gamma"),
    "curriculum_learning": ("enabled", "curriculum_type", "min_difficulty", "max_difficulty",
                            "schedule_type", "schedule_config"),
    "data_efficiency": ("enabled", "seed", "data_sampling", "data_routing"),
    "autotuning": ("enabled", "fast", "results_dir", "exps_dir", "overwrite",
                   "start_profile_step", "end_profile_step", "metric_path", "tuner_type",
                   "tuner_early_stopping", "tuner_num_trials", "arg_mappings",
                   "max_train_batch_size", "min_train_batch_size",
                   "max_train_micro_batch_size_per_gpu", "min_train_micro_batch_size_per_gpu",
                   "num_tuning_micro_batch_sizes", "mp_size", "metric", "model_info_path",
                   "model_info"),
    "expert_parallel": ("enabled", "autoep_size", "expert_tensor_parallel_size",
                        "validate_folding_routing", "preset_model", "moe_layer_pattern",
                        "expert_pattern", "router_pattern", "use_grouped_mm",
                        "disable_triton_grouped_mm", "route_norm", "route_scale", "score_apply",
                        "combine_impl", "num_expert_groups", "num_limited_groups", "score_func",
                        "top_k", "load_balance_coeff", "routed_scaling_factor", "expert_w1",
                        "expert_w2", "expert_w3", "num_experts_attr", "top_k_attr",
                        "has_shared_experts", "shared_experts_pattern",
                        "shared_experts_gate_pattern"),
    "compile": ("deepcompile", "free_activation", "free_activation_threshold",
                "offload_activation", "offload_activation_pin_memory", "offload_opt_states",
                "double_buffer", "symmetric_memory", "debug_log", "offload_parameters",
                "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
                "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors",
                "passes"),
    "tensor_parallel": ("autotp_size", "dtype", "tp_overlap_comm", "tensor_parallel", "tp",
                        "injection_policy_tuple", "partition_config", "preset_model",
                        "keep_module_on_host", "replace_with_kernel_inject", "kernel_inject"),
}
