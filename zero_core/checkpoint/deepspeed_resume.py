"""Resuming a zero-core engine from a DeepSpeed ZeRO checkpoint (``engine.load_checkpoint``
on a DeepSpeed directory; save_load.py hands it over).

Every rank indexes the checkpoint (deepspeed_layout.py: the rank-0 model-states and
optimizer-states files, memory-mapped), asks its engine which ranges it owns now
(``subject.fragments("load")``, as for zero-core's own checkpoints), plans the
reads with engine_state.py's :func:`plan_reads` and reads the DeepSpeed files that hold
them, one file at a time, through the restricted unpickler. So a checkpoint DeepSpeed
wrote with N ranks at stage S loads into zero-core on M ranks at stage S'.

Restored: the fp32 master weights (or, at stage 0 in fp32, the parameters), the
optimizer's ``exp_avg``/``exp_avg_sq`` and step count per group, the hyperparameters of
each param group, the LR scheduler, the loss scale, ``global_steps`` / ``skipped_steps``
(``micro_steps`` = global steps x gradient accumulation), the module's buffers and the
client state (the keys of the model-states file DeepSpeed did not write, with DeepSpeed's
objects turned into plain values). DeepSpeed saves no RNG states, so none are restored.
``load_optimizer_states=False`` loads weights and counters; ``load_module_only=True`` the
parameters and buffers only.
"""
from __future__ import annotations

import torch

from zero_core.checkpoint import store
from zero_core.checkpoint.deepspeed_layout import DeepSpeedCheckpoint
from zero_core.checkpoint.engine_state import WEIGHT_KEYS, parameter_names, plan_reads
from zero_core.checkpoint.store import CheckpointError

#: hyperparameters copied from the saved param groups when present on both sides
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "momentum",
              "dampening", "nesterov")


def check_model(module, ck: DeepSpeedCheckpoint) -> None:
    """Refuse a checkpoint of another model than *module*, naming the parameters that
    differ."""
    saved = ck.param_shapes()
    mine = {n: tuple(p.shape) for n, p in module.named_parameters()}
    tied = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    missing = [n for n in mine if n not in saved]
    extra = [n for n in saved if n not in tied]  # stage 0 lists tied names one by one
    problems = []
    if missing:
        problems.append(f"parameters of this model missing from the checkpoint: "
                        f"{', '.join(map(repr, missing[:5]))}"
                        + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    if extra:
        problems.append(f"parameters in the checkpoint that this model lacks: "
                        f"{', '.join(map(repr, extra[:5]))}"
                        + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else ""))
    for n, shape in mine.items():
        if n in saved and tuple(saved[n]) != shape:
            problems.append(f"parameter {n!r} has shape {list(saved[n])} in the checkpoint "
                            f"but {list(shape)} in this model")
    buffers = dict(module.named_buffers())
    saved_module = ck.model["module"]
    persistent = [k for k in module.state_dict(keep_vars=True) if k in buffers]
    for n in persistent:
        if n not in ck.buffer_names or n not in saved_module:
            problems.append(f"buffer {n!r} of this model is not in the checkpoint")
    for n in ck.buffer_names:
        if n in buffers and tuple(saved_module[n].shape) != tuple(buffers[n].shape):
            problems.append(f"buffer {n!r} has shape {list(saved_module[n].shape)} in the "
                            f"checkpoint but {list(buffers[n].shape)} in this model")
    if problems:
        raise CheckpointError(f"{ck.where} was saved from a different model: "
                              + "; ".join(problems[:6])
                              + (f" (and {len(problems) - 6} more)" if len(problems) > 6 else "")
                              + ". Build the same model (same parameter names and shapes) "
                              "before loading")


def _engine_groups(module, optimizer) -> tuple[list, set]:
    names = parameter_names(module)
    groups = [[names[id(p)] for p in g["params"] if id(p) in names]
              for g in optimizer.param_groups]
    trainable = {names[id(p)] for g in optimizer.param_groups for p in g["params"]
                 if id(p) in names and p.requires_grad}
    return groups, trainable


@torch.no_grad()
def load_deepspeed(subject, load_dir: str, tag=None, load_optimizer_states: bool = True,
                   load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Collective: load DeepSpeed checkpoint *tag* (default: ``latest``) of *load_dir* into
    the engine *subject* (a ``CheckpointSubject``) shows. Returns
    ``(checkpoint directory, client_state)`` like
    :func:`~zero_core.checkpoint.save_load.load_checkpoint`."""
    states = load_optimizer_states and not load_module_only
    error: Exception | None = None
    ck = None
    try:
        ck = DeepSpeedCheckpoint(load_dir, tag)
        check_model(subject.module, ck)
        groups, trainable = _engine_groups(subject.module, subject.optimizer)
        index = ck.fragment_index(groups, trainable)
        wanted = subject.fragments("load")
        plan = plan_reads(wanted, index, lambda k: k in WEIGHT_KEYS or states, ck.where)
        buffers = dict(subject.module.named_buffers())
        if ck.optim_files and ck.optim_files[0] not in plan:
            ck.forget()
        src = None
        for file in sorted(plan):
            obj = ck.open(file)
            for col, off, count, dst in plan[file]:
                src = ck.column(obj, col)
                if off + count > src.numel():
                    raise CheckpointError(f"{ck.where}: {file} holds {src.numel()} elements "
                                          f"in {col}, {off + count} are needed")
                dst.copy_(src.narrow(0, off, count))
            obj = src = None  # this file's tensors go before the next is read
        for n in ck.buffer_names:
            if n in buffers:
                buffers[n].copy_(ck.model["module"][n])
    except CheckpointError as exc:
        error = exc
    store.raise_unless_loaded_everywhere(subject.comm, error, f"DeepSpeed checkpoint {load_dir}")
    subject.restored()
    if not load_module_only:
        _restore_common(subject, ck, states, load_lr_scheduler_states)
    return ck.tag_dir, ck.client_state()


def _restore_common(subject, ck: DeepSpeedCheckpoint, states: bool, scheduler: bool) -> None:
    model = ck.model
    global_steps = int(model.get("global_steps", 0))
    subject.set_counters(global_steps, global_steps * subject.gradient_accumulation_steps,
                         int(model.get("skipped_steps", 0)))
    opt = subject.optimizer
    if states:
        steps = ck.group_steps()
        hyper = ck.hyperparameters()
        if len(steps) != len(opt.param_groups):
            raise CheckpointError(f"{ck.where} has {len(steps)} optimizer parameter groups, "
                                  f"this engine {len(opt.param_groups)}: build the optimizer "
                                  f"with the same groups, or pass load_optimizer_states=False")
        for mine, saved in zip(opt.param_groups, hyper):
            for k in HYPER_KEYS:
                if k in mine and k in saved:
                    mine[k] = tuple(saved[k]) if isinstance(mine[k], tuple) else saved[k]
        if hasattr(opt, "step_counts") and len(steps) == len(opt.step_counts):
            opt.step_counts[:] = steps
    sched = model.get("lr_scheduler")
    if scheduler and isinstance(sched, dict) and subject.lr_scheduler is not None:
        subject.lr_scheduler.load_state_dict(sched)
    scale = ck.loss_scaler_state()
    scaler = subject.loss_scaler
    if scale is not None and scaler is not None:
        current = scaler.state_dict()
        if current.get("type") == scale["type"]:
            scaler.load_state_dict({**current, **scale})
        else:
            scaler.load_state_dict(scale)  # refuses the mismatch with the reason
