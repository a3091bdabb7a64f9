"""``ZeroCoreStrategy``: PyTorch Lightning training on the zero-core engine.

Owns everything between Lightning's ``Trainer`` and ``zero_core.initialize``: the config
(Trainer arguments folded in, contradictions refused), the launch environment (Lightning's
cluster environment and zero-core's launcher discovery made to agree before the runtime
starts), the engine's life in the Trainer (backward, step, forward through the engine),
precision (the engine's bf16/fp16, never an autocast or scaler of Lightning's on top) and
checkpoints (the engine's sharded directory, Lightning's own state as its client state).

Importing this module registers ``Trainer(strategy="zero_core" | "zero_core_stage_2" |
"zero_core_stage_3")``. Lightning is an optional extra: the engine never imports this.
"""
from __future__ import annotations

import contextlib
import copy
import os
from datetime import timedelta

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType

import zero_core
from zero_core.config import parse_config, read_config
from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.integrations.lightning_data import TrainingData
from zero_core.runtime.launch import discover

#: Lightning precision -> the engine's half-precision section (None: fp32 training)
PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": "bf16", "bf16-true": "bf16",
              "bf16": "bf16", "16-mixed": "fp16", "16-true": "fp16", "16": "fp16"}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_SECTION_NAMES = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16",)}


# ---- config ------------------------------------------------------------------------------------
def load_config(config, stage: int | None) -> dict:
    """A private copy of *config* (dict, JSON path or None) with *stage* applied. No config
    and no stage gives ZeRO stage 2, as Lightning's ``"deepspeed"`` strategy does."""
    if config is None:
        stage = 2 if stage is None else stage
    elif not isinstance(config, (dict, str, os.PathLike)):
        raise ConfigError(f"ZeroCoreStrategy(config=...) must be a dict or a JSON file path, "
                          f"got {type(config).__name__}")
    config = read_config(config)
    if stage is not None:
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"ZeroCoreStrategy(stage={stage!r}): use 0, 1, 2 or 3")
        zo = config.setdefault("zero_optimization", {})
        if "stage" in zo and zo["stage"] != stage:
            raise ConfigError(f"ZeroCoreStrategy(stage={stage}) contradicts the config's "
                              f"zero_optimization.stage={zo['stage']}; keep one")
        zo["stage"] = stage
    return config


def config_stage(config: dict) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def _explicit(value) -> bool:
    """A config value the user really set (HF's "auto" and absent mean: fill it in)."""
    return value is not None and value != "auto"


def apply_precision(config: dict, precision: str) -> None:
    """Turn the engine's bf16/fp16 on as Lightning's *precision* says; a config that says
    otherwise is refused rather than silently overridden."""
    if precision not in PRECISIONS:
        raise ConfigError(f"Trainer(precision={precision!r}) is not supported by zero-core; "
                          f"use one of 32-true, bf16-mixed, bf16-true, 16-mixed, 16-true")
    want = PRECISIONS[precision]
    for kind, names in _SECTION_NAMES.items():
        for name in names:
            section = config.get(name)
            if not isinstance(section, dict) or not _explicit(section.get("enabled")):
                continue
            enabled = bool(section["enabled"])
            if enabled != (kind == want):
                raise ConfigError(
                    f"Trainer(precision={precision!r}) contradicts the config's "
                    f"{name}.enabled={section['enabled']!r}: set the precision that matches "
                    f"the config ({'32-true' if not enabled else kind + '-mixed'}) or drop "
                    f"{name}.enabled and let the Trainer's precision decide")
    if want is not None:
        name = next((n for n in _SECTION_NAMES[want] if isinstance(config.get(n), dict)), want)
        config.setdefault(name, {})["enabled"] = True


def apply_trainer_settings(config: dict, trainer) -> None:
    """Fold ``accumulate_grad_batches`` and ``gradient_clip_val`` into *config*; an explicit
    config value that differs is a ConfigError (the loop and the engine must agree on when
    a step happens, or Lightning's global_step and schedulers drift from the engine's)."""
    accumulate = int(trainer.accumulate_grad_batches)
    if _explicit(config.get("gradient_accumulation_steps")):
        if int(config["gradient_accumulation_steps"]) != accumulate:
            raise ConfigError(
                f"Trainer(accumulate_grad_batches={accumulate}) contradicts the config's "
                f"gradient_accumulation_steps={config['gradient_accumulation_steps']}: set "
                f"Trainer(accumulate_grad_batches=...) and drop the config key")
    config["gradient_accumulation_steps"] = accumulate
    if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        raise ConfigError("Trainer(gradient_clip_algorithm='value') is not supported by "
                          "zero-core: the engine clips by the global norm; use "
                          "gradient_clip_algorithm='norm'")
    clip = max(float(trainer.gradient_clip_val or 0.0), 0.0)  # Lightning: None/0 = no clipping
    explicit = _explicit(config.get("gradient_clipping"))
    if clip > 0 and explicit and float(config["gradient_clipping"]) != clip:
        raise ConfigError(f"Trainer(gradient_clip_val={clip}) contradicts the config's "
                          f"gradient_clipping={config['gradient_clipping']}: keep one of them")
    if clip > 0 or not explicit:  # as Lightning's DeepSpeedStrategy: 0.0, not the key's 1.0
        config["gradient_clipping"] = clip


def loader_batch_size(trainer) -> int | None:
    """The training dataloader's batch size (what a rank sees per micro-step), if known."""
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        return None
    loader = source.dataloader()
    sampler = getattr(loader, "batch_sampler", None)
    size = getattr(sampler, "batch_size", None) or getattr(loader, "batch_size", None)
    return int(size) if size else None


def plain_client_state(obj):
    """Lightning's checkpoint dict with dict subclasses (AttributeDict hyperparameters)
    turned into dicts, so that the engine's weights_only checkpoint can hold it."""
    if isinstance(obj, dict):
        return {k: plain_client_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain_client_state(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(plain_client_state(v) for v in obj)
    return obj


# ---- launch environment ---------------------------------------------------------------------------
class ZeroCoreEnvironment(ClusterEnvironment):
    """Lightning's view of a job whose launcher zero-core recognises but Lightning does not
    (torchrun-style ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` without ``TORCHELASTIC_RUN_ID``):
    the ranks come from ``zero_core.runtime.launch.discover``, the processes exist already."""

    def __init__(self, info=None):
        self._info = info or discover()

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return discover().launcher != "single"

    def world_size(self) -> int:
        return self._info.world_size

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the launcher

    def global_rank(self) -> int:
        return self._info.rank

    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the launcher

    def local_rank(self) -> int:
        return self._info.local_rank

    def node_rank(self) -> int:
        return self._info.rank // self._info.local_world_size


# ---- precision ----------------------------------------------------------------------------------
class ZeroCorePrecision(Precision):
    """Lightning's precision seen through the engine: the engine computes in bf16/fp16 and
    scales fp16 losses itself, so this plugin runs no autocast and no scaler; it casts
    floating inputs to the compute dtype, routes backward to ``engine.backward`` and the
    optimizer step to ``engine.step``, and leaves clipping to the engine."""

    def __init__(self, precision: str = "32-true"):
        if precision not in PRECISIONS:
            raise ConfigError(f"Trainer(precision={precision!r}) is not supported by zero-core; "
                              f"use one of 32-true, bf16-mixed, bf16-true, 16-mixed, 16-true")
        self.precision = precision
        self._dtype = _DTYPES.get(PRECISIONS[precision])

    def convert_input(self, data):
        if self._dtype is None:
            return data
        return _cast_floating(data, self._dtype)

    def backward(self, tensor, model, optimizer, *args, **kwargs):
        engine = _engine_of(model)
        # Lightning divided the loss by accumulate_grad_batches; the engine divides by
        # gradient_accumulation_steps itself, so hand it the micro-batch's own loss
        factor = model.trainer.accumulate_grad_batches if model.automatic_optimization else 1
        engine.backward(tensor * factor if factor != 1 else tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise ConfigError("training_step returned None (skip this batch) which zero-core "
                              "cannot do: the engine's gradient reduction is collective; "
                              "return a loss on every rank (e.g. loss * 0 to skip)")
        _engine_of(model).step()
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None):
        """The engine clips by global norm at each step (``gradient_clipping``)."""


def _cast_floating(data, dtype):
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return type(data)(_cast_floating(v, dtype) for v in data)
    if isinstance(data, dict):
        return type(data)((k, _cast_floating(v, dtype)) for k, v in data.items())
    return data


def _engine_of(model):
    engine = getattr(model.trainer.strategy, "engine", None)
    if engine is None:
        raise ZeroCoreError("no zero-core engine: backward/step ran outside Trainer.fit's setup")
    return engine


def _precision_name(plugin) -> str:
    """The Lightning precision string of any precision plugin the Trainer built."""
    name = getattr(plugin, "precision", None)
    if name is None and type(plugin) is Precision:
        name = "32-true"
    if name is None:
        raise ConfigError(f"precision plugin {type(plugin).__name__} is not supported by "
                          f"ZeroCoreStrategy; use Trainer(precision='32-true' | 'bf16-mixed' | "
                          f"'16-mixed' | 'bf16-true')")
    return str(name)


# ---- the strategy -------------------------------------------------------------------------------
class ZeroCoreStrategy(DDPStrategy):
    """Train a LightningModule with zero-core (ZeRO stages 0-3, offload, ZeRO++).

    ``config``: a DeepSpeed-style config dict or JSON path (everything ``zero_core.initialize``
    accepts); ``stage``: shortcut for ``zero_optimization.stage``. The Trainer fills
    ``train_micro_batch_size_per_gpu`` (from the dataloader), ``gradient_accumulation_steps``,
    ``gradient_clipping`` and bf16/fp16; contradicting explicit config values are refused.
    ``resumable_data``: a mid-epoch ``fit(ckpt_path=...)`` trains each sample once
    (lightning_data.py)."""

    strategy_name = "zero_core"

    def __init__(self, config=None, stage: int | None = None, accelerator=None,
                 parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None, timeout: timedelta | None = None,
                 resumable_data: bool = True):
        # before super().__init__: the precision setter below checks against the config
        self.config = load_config(config, stage)
        self.engine = None
        self._data = TrainingData(resumable_data)
        self._engine_trains = False
        self._scheduler_configs: list = []
        self._exported: dict[str, str] = {}
        self._cluster_environment = None
        self._default_precision = ZeroCorePrecision()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, timeout=timeout,
                         start_method="popen")

    @property
    def stage(self) -> int:
        return config_stage(self.config)

    # -- plugins Lightning hands over: precision and cluster environment ---------------------------
    @property
    def precision_plugin(self) -> Precision:
        # stays None until given (Lightning reads _precision_plugin to decide whether the
        # strategy brought one); until then the default answers
        return self._precision_plugin if self._precision_plugin is not None else self._default_precision

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if plugin is None:
            self._precision_plugin = None
            return
        if not isinstance(plugin, ZeroCorePrecision):
            # Lightning built its own (autocast / scaler) plugin for a strategy it does not
            # know: keep only its precision name, the engine does the rest
            plugin = ZeroCorePrecision(_precision_name(plugin))
        probe = copy.deepcopy(self.config)
        apply_precision(probe, plugin.precision)  # contradictions fail at Trainer(...)
        self._precision_plugin = plugin

    @property
    def cluster_environment(self):
        return self._cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, env) -> None:
        # Lightning falls back to LightningEnvironment for plain torchrun-style variables
        # (no TORCHELASTIC_RUN_ID), which then believes Trainer(devices=...) over RANK /
        # WORLD_SIZE; zero-core reads those variables, so let them decide
        if type(env) is LightningEnvironment and discover().launcher == "torchrun":
            env = ZeroCoreEnvironment()
        self._cluster_environment = env

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if self.local_rank < len(devices):
            return devices[self.local_rank]
        if devices[0].type == "cpu":  # an external launcher with Trainer(devices=1) on CPU
            return torch.device("cpu")
        raise ConfigError(f"this process is local rank {self.local_rank} but the Trainer has "
                          f"{len(devices)} device(s): pass Trainer(devices=<processes per node>)")

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- start-up -------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        trainer = self.lightning_module.trainer
        # refuse contradictions before any process group exists
        self._training_config(trainer, check_only=True)
        super().setup_environment()

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._export_launch_env()
        cfg = parse_config(self._runtime_config(), self.world_size)
        # the same arguments initialize() passes later: one runtime, torch.distributed
        # started once (by zero-core; Lightning's own init skips an initialised one)
        zero_core.init_distributed(cfg.accelerator, cfg.comm_backend, cfg.comm_timeout,
                                   cfg.topology.ranks_per_node)

    def _export_launch_env(self) -> None:
        """Make zero-core's launcher discovery say what Lightning's cluster environment says."""
        info = discover()
        want = (self.global_rank, self.world_size, self.local_rank)
        if info.launcher != "single" and (info.rank, info.world_size, info.local_rank) != want:
            raise ConfigError(
                f"Lightning's cluster environment ({type(self.cluster_environment).__name__}) "
                f"says rank {want[0]} of {want[1]} (local rank {want[2]}) but the {info.launcher} "
                f"launch variables say rank {info.rank} of {info.world_size} (local rank "
                f"{info.local_rank}): pass Trainer(devices=<processes per node>, num_nodes=...) "
                f"matching the launcher, or unset the stale variables")
        if info.launcher not in ("single", "torchrun"):
            return  # MPI / Slurm / PMIx: zero-core reads the launcher's own variables
        env = self.cluster_environment
        local_world = (info.local_world_size if info.launcher == "torchrun"
                       else max(1, self.num_processes))
        self._exported = {"RANK": str(want[0]), "WORLD_SIZE": str(want[1]),
                          "LOCAL_RANK": str(want[2]), "LOCAL_WORLD_SIZE": str(local_world)}
        if want[1] > 1:
            self._exported.update(MASTER_ADDR=env.main_address, MASTER_PORT=str(env.main_port))
        os.environ.update(self._exported)

    def _runtime_config(self) -> dict:
        """The config with stand-ins for what only the Trainer's setup knows (enough to
        start the runtime and build ``zero_core.Init``)."""
        cfg = copy.deepcopy(self.config)
        if "train_batch_size" not in cfg:
            cfg.setdefault("train_micro_batch_size_per_gpu", 1)
        apply_precision(cfg, self.precision_plugin.precision)
        return cfg

    def _training_config(self, trainer, check_only: bool = False) -> dict:
        cfg = copy.deepcopy(self.config)
        apply_precision(cfg, self.precision_plugin.precision)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            apply_trainer_settings(cfg, trainer)
            if not self.lightning_module.automatic_optimization and trainer.accumulate_grad_batches != 1:
                raise ConfigError("manual optimization with accumulate_grad_batches > 1: "
                                  "Lightning refuses it; set gradient_accumulation_steps in "
                                  "the zero-core config instead")
        if check_only:
            return cfg
        if "train_micro_batch_size_per_gpu" not in cfg and "train_batch_size" not in cfg:
            cfg["train_micro_batch_size_per_gpu"] = (loader_batch_size(trainer) if fitting else None) or 1
        return cfg

    # -- the engine -----------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.engine is not None and (self.engine.module is not module
                                        or (fitting and not self._engine_trains)):
            # another model, or fit after validate/test/predict: the engine built for those
            # holds no optimizer of the user's. Below stage 3 a new engine adopts the model
            # once the old one's hooks are gone; at stage 3 the old engine holds the model's
            # only values (its partitions) and hands them back as zero_core.Init leaves a
            # model (from its fp32 master), for the new engine to adopt
            if self.stage == 3 and self.engine.module is module:
                self.engine.hand_back_model()
                self.engine = None
            self.destroy_engine()
        if self.engine is None:
            self.engine = self._build_engine(trainer, module, fitting)
            self._engine_trains = fitting
        elif fitting:
            # a second fit on the same engine (Lightning cleared these at teardown)
            self.optimizers = [self.engine.optimizer]
            self.lr_scheduler_configs = list(self._scheduler_configs)
        self.model = self.engine
        if self.stage == 3:
            # Lightning's checkpoint dump asks for the full state dict, which the engine's
            # checkpoint does not need; gathering stage-3 partitions for it would cost a full
            # model copy on rank 0 at every save (the weights are in the engine's shards)
            connector = getattr(trainer, "_checkpoint_connector", None)
            if connector is not None:
                connector._get_lightning_module_state_dict = dict
        self.setup_precision_plugin()
        self.barrier()

    def _build_engine(self, trainer, module, fitting: bool):
        cfg = self._training_config(trainer)
        optimizer, schedulers = self._user_optimizer(module, cfg, fitting)
        # trainer.fit(torch.compile(module)): Lightning compiled the whole training_step,
        # which would trace the engine's gathers and hooks; compile the blocks instead
        compiled = getattr(module, "_compiler_ctx", None) is not None
        if compiled:
            from lightning.pytorch.utilities.compile import to_uncompiled
            to_uncompiled(module)
        engine, engine_optimizer, _, _ = zero_core.initialize(model=module, optimizer=optimizer,
                                                               config=cfg)
        if compiled:
            engine.compile()
        if fitting:
            self.optimizers = [engine_optimizer]
            # schedulers from configure_optimizers stay Lightning's (stepped per its interval);
            # they edit the param_groups the engine's optimizer shares with the user's.
            # torch warns when a scheduler steps an optimizer it never saw step: it did.
            if optimizer is not None:
                optimizer._opt_called = True
            self.lr_scheduler_configs = schedulers
            self._scheduler_configs = list(schedulers)
        return engine

    def _user_optimizer(self, module, cfg, fitting):
        """The torch optimizer and scheduler configs of configure_optimizers (or None, [] when
        the config has its own optimizer section; a stand-in outside fitting)."""
        if not fitting:
            if cfg.get("optimizer") is not None:
                return None, []
            # validate/test/predict need the engine (stage-3 gathering, checkpoint loading)
            # but no update: a zero-lr SGD keeps no optimizer state
            return torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.0), []
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        optimizers = [o for o in optimizers if not isinstance(o, _MockOptimizer)]
        if len(optimizers) > 1:
            raise ConfigError(f"configure_optimizers returned {len(optimizers)} optimizers; "
                              f"zero-core trains with one optimizer (use parameter groups)")
        if len(schedulers) > 1:
            raise ConfigError(f"configure_optimizers returned {len(schedulers)} schedulers; "
                              f"zero-core supports one")
        if cfg.get("optimizer") is not None:
            if optimizers:
                raise ConfigError("both the config's 'optimizer' section and configure_optimizers "
                                  "give an optimizer; keep one (configure_optimizers may return None)")
            if schedulers:
                raise ConfigError("a scheduler from configure_optimizers needs the optimizer from "
                                  "configure_optimizers; use the config's 'scheduler' section")
            return None, []
        if not optimizers:
            raise ConfigError("no optimizer: return one from configure_optimizers or add an "
                              "'optimizer' section to the zero-core config")
        if cfg.get("scheduler") is not None and schedulers:
            raise ConfigError("both the config's 'scheduler' section and configure_optimizers give "
                              "a scheduler; keep one")
        return optimizers[0], list(schedulers)

    @contextlib.contextmanager
    def model_sharded_context(self):
        """``configure_model`` builds its layers already partitioned at stage 3."""
        if self.stage != 3:
            yield
            return
        with zero_core.Init(config=self._runtime_config()):
            yield

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its shards

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restores its optimizer states itself

    def lightning_module_state_dict(self) -> dict:
        """The model's full state dict; at stage 3 gathered through the engine onto rank 0
        (other ranks get ``{}``); collective then, so call it on every rank."""
        if self.engine is not None and self.stage == 3:
            return self.engine.module_state_dict(rank0_only=True)
        return self.lightning_module.state_dict()

    def process_dataloader(self, dataloader):
        """The training loader, made resumable (lightning_data.py)."""
        return self._data.loader(dataloader, self.engine, self.lightning_module.trainer)

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Write the engine's sharded checkpoint directory at *filepath* (collective), with
        Lightning's loops/callbacks/scheduler state as its client state."""
        if storage_options is not None:
            raise ConfigError("save_checkpoint(storage_options=...) is not supported: zero-core "
                              "writes its own directory, not through Lightning's CheckpointIO")
        if self.engine is None:
            raise ZeroCoreError("save_checkpoint before the engine exists: call it during or "
                                "after Trainer.fit")
        filepath = self.broadcast(str(filepath))
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag="checkpoint",
                                    client_state=plain_client_state(client))

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        checkpoint_path = self.broadcast(str(checkpoint_path))
        if not os.path.isdir(checkpoint_path):
            raise ConfigError(f"{checkpoint_path!r} is not a zero-core checkpoint directory "
                              f"(ZeroCoreStrategy saves directories; single files are not read)")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        engine = self.engine
        _, client = engine.load_checkpoint(
            checkpoint_path, load_optimizer_states=fitting,
            load_lr_scheduler_states=fitting and engine.lr_scheduler is not None,
            load_module_only=not fitting)
        if fitting:
            self._data.resumed(checkpoint_path, client, engine, self.config)
        return client

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # the engine loaded the weights in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # and the optimizer states

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero and os.path.isdir(filepath):
            import shutil
            shutil.rmtree(filepath, ignore_errors=True)

    # -- the end ----------------------------------------------------------------------------------
    def teardown(self) -> None:
        # the engine stays (a later validate/test reuses it, its partitions are the model at
        # stage 3); only Lightning's side is undone, without Strategy's move to the CPU
        self.model = self.lightning_module
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        # LightningEnvironment.teardown drops WORLD_SIZE; the runtime lives on, so keep what
        # zero-core's discovery reads consistent with it
        os.environ.update(self._exported)
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def destroy_engine(self) -> None:
        """Remove the engine's hooks from the model (its values stay; at stage 3 they stay
        partitioned: read them with ``lightning_module_state_dict()`` first)."""
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        entries = (("zero_core", None, "zero-core (ZeRO stage 2 unless the config says)"),
                   ("zero_core_stage_2", 2, "zero-core ZeRO stage 2"),
                   ("zero_core_stage_3", 3, "zero-core ZeRO stage 3"))
        for name, stage, description in entries:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, stage=stage)


ZeroCoreStrategy.register_strategies(StrategyRegistry)
