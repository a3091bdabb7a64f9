"""``initialize``: DeepSpeed's entry point — parse the config, start the runtime, build the
engine with its stage's parts.

The only module that knows the stages (:data:`STAGE_PARTS`); the engine (engine/core.py)
and the stages never import it.
"""
from __future__ import annotations

import logging

from zero_core.checkpoint import resume
from zero_core.config import parse_config
from zero_core.data import resumable_loader
from zero_core.errors import ConfigError
from zero_core.runtime.agreement import check_ranks_agree
from zero_core.runtime.context import init_distributed
from zero_core.runtime.failures import install_failure_report
from zero_core.runtime.launch import discover, single_process_notice
from zero_core.engine.compile import unwrap_compiled
from zero_core.engine.core import ZeroEngine
from zero_core.stage0to2.parts import Stage0to2Parts
from zero_core.stage3.parts import Stage3Parts

log = logging.getLogger("zero_core.engine")

#: zero_optimization.stage -> what that stage contributes to the engine (engine/contract.py)
STAGE_PARTS = {0: Stage0to2Parts, 1: Stage0to2Parts, 2: Stage0to2Parts, 3: Stage3Parts}


def initialize(args=None, model=None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, config_params=None):
    """Build a :class:`ZeroEngine`; returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)`` like ``deepspeed.initialize`` (the loader, built from *training_data*,
    is a DataLoader over a :class:`~zero_core.data.ResumableSampler`; else None). With
    ``checkpoint.save_dir`` the newest checkpoint there is loaded (``checkpoint.resume``).
    *config*: dict, path to a JSON file, or Config. With no optimizer (neither optimizer=
    nor an 'optimizer' section) the engine is an inference engine, as DeepSpeed-Chat builds
    its frozen models: forward only, ``optimizer`` None."""
    install_failure_report()  # first: a config error below is printed once per job, too
    if model is None:
        raise ConfigError("initialize() needs model=<torch.nn.Module>")
    model, compiled_before = unwrap_compiled(model)
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "zero_config", None)
    if mpu is not None:
        raise ConfigError("mpu= (model parallelism) is not supported: zero-core is data "
                          "parallel only; pass mpu=None")
    cfg = parse_config(config, discover().world_size)
    runtime = init_distributed(cfg.accelerator, cfg.comm_backend, cfg.comm_timeout,
                               cfg.topology.ranks_per_node)
    single_process_notice(runtime.launch, enabled=cfg.safety.launcher_notice)
    # checkpoint.resume: the newest checkpoint is chosen, and the batch adapted to this world
    # size, before the engine exists (checkpoint/resume.py); it is loaded at the end
    plan = resume.find(cfg, runtime.comm)
    if plan is not None:
        cfg = resume.keep_global_batch(cfg, plan, runtime.world_size)
    if cfg.optimizer is not None and optimizer is not None:
        raise ConfigError("an 'optimizer' section in the config and optimizer= were both "
                          "given; keep one")
    if cfg.safety.check_ranks_agree:
        # before the engines' first collectives, which differ between stages: ranks that
        # disagree would otherwise hang in them until the communicator times out
        check_ranks_agree(runtime, cfg, model, optimizer)
    engine = ZeroEngine(model, cfg, runtime, STAGE_PARTS[cfg.zero_optimization.stage],
                        optimizer=optimizer, model_parameters=model_parameters,
                        lr_scheduler=lr_scheduler)
    if compiled_before:
        if engine.global_rank == 0:
            log.warning("zero-core: the model was torch.compile'd before initialize(): the "
                        "engine compiles its blocks instead (engine.compile(), backend "
                        "'inductor'); for another backend or options pass the plain model "
                        "and call engine.compile(backend=..., compile_kwargs=...)")
        engine.compile()
    loader = None
    if training_data is not None:  # DeepSpeed's deepspeed_io: a loader that resumes
        loader = resumable_loader(training_data, engine, collate_fn)
        if engine.optimizer is not None:  # ZenFlow selects columns per epoch
            engine.optimizer.set_steps_per_epoch(len(loader) // engine.gradient_accumulation_steps)
    if plan is not None:
        tag_dir, engine.resumed_client_state = resume.load(plan, engine.module,
                                                           engine.load_checkpoint)
        if engine.global_rank == 0:
            resume.announce(plan, tag_dir, engine.global_steps, engine.world_size)
    return engine, engine.optimizer, loader, engine.lr_scheduler
