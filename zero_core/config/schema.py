"""The typed result of parsing a config: frozen dataclasses, one per section
(:class:`FP16Config`, :class:`BF16Config`, :class:`OptimizerConfig`, :class:`SchedulerConfig`,
:class:`ZeroConfig` with its offload sections, :class:`TopologyConfig`,
:class:`ActivationCheckpointingConfig`) and the whole :class:`Config`, with DeepSpeed's
defaults and the derived properties the engine reads. They hold values only; validation
lives in :mod:`zero_core.config.parser` and the key reference in :mod:`zero_core.config.keys`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from zero_core.config.monitors import MonitorConfig
from zero_core.config.precision import torch_dtype

__all__ = [
    "Config", "FP16Config", "BF16Config", "OptimizerConfig", "SchedulerConfig", "ZeroConfig",
    "OffloadOptimizerConfig", "OffloadParamConfig", "TopologyConfig",
    "ActivationCheckpointingConfig", "TorchAutocastConfig", "CheckpointConfig", "SafetyConfig",
    "NONFINITE_ACTIONS",
]

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
    # DeepSpeed's default: engine.forward casts no inputs; true casts floating inputs to fp16
    auto_cast: bool = False

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
    """bfloat16 mixed precision (no loss scaling needed).

    ``bf16_master_weights_and_grads``: the master weights (and the gradients the optimizer
    reads) stay in bf16 instead of an fp32 copy; ``bf16_optimizer_states``: the optimizer
    states are bf16 too (needs the first). ``check_grad_overflow`` (DeepSpeed's default: on):
    a step whose global gradient norm is not finite is skipped."""

    enabled: bool = False
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False
    check_grad_overflow: bool = True


@dataclass(frozen=True)
class TorchAutocastConfig:
    """DeepSpeed's ``torch_autocast`` section: the forward runs under
    ``torch.autocast(dtype)`` (``dtype`` None: torch's default for the device); parameters
    keep the training mode's dtype (fp32, or bf16 with ``bf16.enabled``).
    ``lower_precision_safe_modules`` are class paths whose parameters' gradients are reduced
    in the autocast dtype at ZeRO stages 1-3 (None: DeepSpeed's list, Linear and ConvNd);
    engine/autocast.py applies both."""

    enabled: bool = False
    dtype: str | None = None  # "bf16" | "fp16" | "fp32" | None
    lower_precision_safe_modules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    """DeepSpeed's ``checkpoint`` section. ``tag_validation``: "WARN" | "IGNORE" | "FAIL"
    when ranks save under different tags (DeepSpeed's default WARN).

    zero-core's own keys (checkpoint/periodic.py, checkpoint/resume.py): ``save_dir`` where
    the engine saves by itself every ``save_interval_steps`` optimizer steps and/or
    ``save_interval_minutes`` (rank 0's clock), in the background when ``async_save``;
    ``keep_last`` complete checkpoints are kept (None: all); ``resume`` "auto" (load the
    newest complete checkpoint in save_dir at initialize if there is one), "require" (it is
    an error if there is none) or "never"; ``resume_batch`` "keep_global" (a different
    world size keeps the saved global batch by changing the accumulation steps) or
    "keep_micro" (the config's batch values apply as parsed)."""

    tag_validation: str = "WARN"
    save_dir: str | None = None
    save_interval_steps: int | None = None
    save_interval_minutes: float | None = None
    async_save: bool = False
    keep_last: int | None = None
    resume: str = "auto"
    resume_batch: str = "keep_global"


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
    # Lamb: the trust ratio ||w|| / ||update|| is clamped to [min_coeff, max_coeff]
    max_coeff: float = 10.0
    min_coeff: float = 0.01
    # OneBitAdam (optim/onebit.py): uncompressed warm-up steps before 1-bit communication
    freeze_step: int = 100000
    comm_backend_name: str | None = None   # 1-bit optimizers; None: not given (DeepSpeed: "nccl")
    # ZeroOneAdam (optim/onebit.py): the variance and local-step schedule
    var_freeze_step: int = 100000
    var_update_scaler: int = 16
    local_step_scaler: int = 32678
    local_step_clipper: int = 16
    # OneBitLamb (optim/onebit.py): the frozen coefficient's average and its scaling factor
    coeff_beta: float = 0.9
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1


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
    ratio: float = 1.0                 # < 1: partial offload (offload/partial.py)
    super_offload: bool = False        # speculative host steps (offload/speculative.py)
    cpuadam_cores_perc: float = 0.8    # the speculative worker's share of the cores

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
class ZenFlowConfig:
    """``zero_optimization.zenflow`` (DeepSpeed's keys and defaults; zero_core/offload/zenflow.py
    says what each does, config/zenflow_section.py what is refused)."""

    topk_ratio: float = 0.1
    select_strategy: str = "auto"
    select_interval: int | str = "auto"
    update_interval: int | str = "auto"
    auto_ratio: float = 0.99           # with update_interval "auto": offload/zenflow_auto.py
    overlap_step: bool = False
    offload: bool = False
    full_warm_up_rounds: int = 0
    pt_reserved_cores_perc: float = 0.5


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO stage and bucket sizes (in elements, not bytes)."""

    stage: int = 0
    reduce_bucket_size: int = 5_000_000  # DeepSpeed: 5e8 (see zero_core.config.keys)
    overlap_comm: bool = True
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
    # many nodes (zero_core/runtime/partition_comm.py): MiCS shard groups (-1: off, the
    # model states spread over every rank) and node-aware partition collectives
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    node_aware_collectives: bool = True
    # offload (zero_core/offload)
    sub_group_size: int = 1_000_000_000
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    zenflow: ZenFlowConfig | None = None  # None: off (zero_core/offload/zenflow.py)

    @property
    def zeropp_enabled(self) -> bool:
        """True when any ZeRO++ feature (qwZ, hpZ, qgZ) is switched on."""
        return (self.zero_quantized_weights or self.zero_quantized_nontrainable_weights
                or self.zero_hpz_partition_size > 1 or self.zero_quantized_gradients)


@dataclass(frozen=True)
class TopologyConfig:
    """Override of ranks per node (None = what the launcher says)."""

    ranks_per_node: int | None = None


#: what a step whose global gradient norm is inf/NaN does (fp32 and bf16; fp16 has its scaler)
NONFINITE_ACTIONS = ("skip", "raise", "ignore")


@dataclass(frozen=True)
class SafetyConfig:
    """zero-core's ``safety`` section: what the engine checks so that nothing fails silently.

    ``nonfinite_gradients``: a step whose global gradient norm is inf/NaN (fp32, bf16) is
    skipped on every rank and counted (``"skip"``), raises on every rank (``"raise"``), or
    is applied as it is (``"ignore"``, the pre-0.2 behaviour; bf16's
    ``check_grad_overflow: false`` means this too). ``max_consecutive_skips``: that many
    skipped steps in a row raise, since the run is not recovering (0: no limit).
    ``check_ranks_agree``: at ``initialize`` every rank's config, parameters and versions
    are compared. ``check_batch_sizes``: at each step, the samples every rank fed through
    ``engine(...)`` since the last one (leading dimension of the first tensor input).
    ``launcher_notice``: one line when
    a job starts without a launcher."""

    nonfinite_gradients: str = "skip"
    max_consecutive_skips: int = 10
    check_ranks_agree: bool = True
    check_batch_sizes: bool = True
    launcher_notice: bool = True


@dataclass(frozen=True)
class GenerationConfig:
    """zero-core's ``generation`` section: ``max_live_parameters`` is the budget, in
    elements, of fetch units stage 3 keeps gathered across forward passes run without
    autograd (decode steps); None means ``stage3_max_live_parameters``
    (docs/GENERATION.md)."""

    max_live_parameters: int | None = None


@dataclass(frozen=True)
class HybridEngineConfig:
    """DeepSpeed's ``hybrid_engine`` section, as ``engine.generate`` honours it: with
    ``enabled``, ``pin_parameters`` gathers the whole model once per call (false: within the
    generation budget), ``release_inference_cache`` frees the gathered copies when generate
    returns (false: when training resumes), ``max_out_tokens`` bounds prompt plus new
    tokens. ``inference_tp_size`` must be 1 (no tensor parallelism here)."""

    enabled: bool = False
    max_out_tokens: int = 512
    inference_tp_size: int = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """DeepSpeed's ``flops_profiler`` section (engine/flops.py), plus zero-core's own
    ``peak_tflops`` (the peak the MFU is stated against; None: datasheet or measured)."""

    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None
    peak_tflops: float | None = None


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
    """A validated zero-core configuration (:mod:`zero_core.config.keys` lists every key)."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float = 1.0  # DeepSpeed 0.19's default; 0 = off
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    steps_per_print: int | None = 10  # None: never (Accelerate's float("inf"))
    wall_clock_breakdown: bool = False
    accelerator: str | None = None
    comm_backend: str | None = None
    comm_timeout: float | None = None
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    # gradient path (DeepSpeed's names): the dtype gradients are reduced in, and the one the
    # partitioned gradient accumulates in (None: the compute dtype); the averaging split
    communication_data_type: str | None = None
    grad_accum_dtype: str | None = None
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    torch_autocast: TorchAutocastConfig = field(default_factory=TorchAutocastConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)  # the four monitor sections
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
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
        return torch_dtype(self.precision)

    @property
    def comm_dtype_name(self) -> str:
        """The dtype gradients are reduced in: ``communication_data_type``, else the
        compute dtype (DeepSpeed's rule)."""
        return self.communication_data_type or self.precision

    @property
    def grad_accum_dtype_name(self) -> str:
        """The dtype the partitioned gradient accumulates in (default: the compute dtype)."""
        return self.grad_accum_dtype or self.precision

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
            "accelerator": self.accelerator,
            "comm_backend": self.comm_backend,
            "comm_timeout": self.comm_timeout,
            "topology": dataclasses.asdict(self.topology),
            "activation_checkpointing": dataclasses.asdict(self.activation_checkpointing),
            "communication_data_type": self.communication_data_type,
            "prescale_gradients": self.prescale_gradients,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "data_types": {"grad_accum_dtype": self.grad_accum_dtype},
            "torch_autocast": {
                "enabled": self.torch_autocast.enabled, "dtype": self.torch_autocast.dtype,
                "lower_precision_safe_modules": (
                    None if self.torch_autocast.lower_precision_safe_modules is None
                    else list(self.torch_autocast.lower_precision_safe_modules))},
            "checkpoint": dataclasses.asdict(self.checkpoint),
            "safety": dataclasses.asdict(self.safety),
            "generation": dataclasses.asdict(self.generation),
            "hybrid_engine": dataclasses.asdict(self.hybrid_engine),
            "flops_profiler": dataclasses.asdict(self.flops_profiler),
            **{name: dataclasses.asdict(getattr(self.monitor, name))
               for name in ("tensorboard", "csv_monitor", "wandb", "comet")},
        }
        if self.optimizer is not None:
            opt = self.optimizer
            if opt.type == "SGD":
                params = {"lr": opt.lr, "momentum": opt.momentum, "dampening": opt.dampening,
                          "weight_decay": opt.weight_decay, "nesterov": opt.nesterov}
            else:
                params = {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
                          "weight_decay": opt.weight_decay, "adam_w_mode": opt.adamw_mode,
                          "bias_correction": opt.bias_correction}
                if opt.type == "Lamb":
                    params.update(max_coeff=opt.max_coeff, min_coeff=opt.min_coeff)
                    del params["adam_w_mode"]
            out["optimizer"] = {"type": opt.type, "params": params}
        if self.scheduler is not None:
            params = {k: (list(v) if isinstance(v, tuple) else v)
                      for k, v in self.scheduler.params.items()}
            out["scheduler"] = {"type": self.scheduler.type, "params": params}
        return out

