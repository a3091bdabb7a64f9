"""Resuming by itself: ``checkpoint.resume`` (with ``checkpoint.save_dir``) at initialize.

A job restarted by torchrun's elastic agent, Slurm's requeue or by hand runs the same
script again; :func:`find` picks the newest complete checkpoint of ``save_dir``
(history.py) before the engine is built, :func:`keep_global_batch` adapts the batch to the
world size the job has now, and :func:`load` loads it once the engine exists (resharding
onto the new world size; counters, LR schedule, loss scale and the data position follow;
RNG states when the world size is unchanged).

The global batch on another world size (``checkpoint.resume_batch``):

- ``"keep_global"`` (default): the saved ``train_batch_size`` is kept, the micro batch
  too, and the accumulation steps absorb the change (2 ranks x 4 x 1 -> 1 rank x 4 x 2):
  the optimizer sees the same batches as before, so training continues as it would have.
  When the saved batch is not a multiple of micro batch x world size, that is an error
  that names the choices.
- ``"keep_micro"``: the config's values apply as parsed (a smaller world size trains
  with a smaller global batch), stated in the resume line.

``checkpoint.resume``: ``"auto"`` starts fresh when ``save_dir`` has no complete
checkpoint (and says so), ``"require"`` makes that an error, ``"never"`` does not look.
A damaged newest checkpoint (a file that fails its checksum) falls back to the one
before it, with a warning naming the damage; a checkpoint of another model is an error
(a different model in the same directory is a mistake to point out, not to skip).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from typing import Callable

from zero_core.checkpoint import store
from zero_core.checkpoint.history import complete_checkpoints
from zero_core.checkpoint.store import CheckpointError, CheckpointMismatchError
from zero_core.errors import ConfigError


@dataclasses.dataclass
class ResumePlan:
    save_dir: str
    tags: list          # complete checkpoints, newest first
    meta: dict          # metadata.json of the newest
    note: str = ""      # what changed (batch), for the resume line


def find(config, comm) -> ResumePlan | None:
    """Collective: the checkpoints to resume from (rank 0 looks, every rank gets its
    answer), or None to start fresh. Raises when ``resume`` is "require" and there is none."""
    ck = config.checkpoint
    if ck.save_dir is None or ck.resume == "never":
        return None
    tags = complete_checkpoints(ck.save_dir) if comm.rank == 0 else []
    tags = json.loads(store.all_gather_bytes(comm, json.dumps(tags).encode())[0])
    if not tags:
        if ck.resume == "require":
            raise CheckpointError(_nothing_to_resume(ck.save_dir))
        if comm.rank == 0:
            print(f"zero-core: no checkpoint in {ck.save_dir} to resume from: starting at "
                  f"step 0 (checkpoint.resume \"auto\")", file=sys.stderr, flush=True)
        return None
    _, meta = store.read_metadata(ck.save_dir, tags[0])
    return ResumePlan(ck.save_dir, tags, meta)


def _nothing_to_resume(save_dir: str) -> str:
    if not os.path.isdir(save_dir):
        seen = "does not exist"
    else:
        names = sorted(os.listdir(save_dir))
        partial = [n for n in names if n.endswith(".partial")]
        seen = (f"holds no complete checkpoint (entries: {', '.join(names[:8]) or 'none'}"
                + (f"; {len(partial)} unfinished save(s) left by a job that died while "
                   f"saving" if partial else "") + ")")
    return (f"checkpoint.resume is \"require\" but {save_dir} {seen}: point "
            f"checkpoint.save_dir at the directory the job saved into, or use resume "
            f"\"auto\" to start from step 0 when there is nothing to resume")


def saved_global_batch(meta: dict) -> int | None:
    """The global batch (train_batch_size) a checkpoint's metadata records, or None
    (checkpoints of earlier releases)."""
    value = (meta.get("batch") or {}).get("train_batch_size")
    return None if value is None else int(value)


def accumulation_keeping(global_batch: int, micro: int, world_size: int) -> int | None:
    """The accumulation steps with which *micro* x *world_size* ranks train *global_batch*
    per step, or None when no whole number does. The engine's resume, ZeroCoreTrainer and
    ZeroCoreStrategy all keep the saved global batch with it."""
    per_micro_step = micro * world_size
    return None if global_batch % per_micro_step else global_batch // per_micro_step


def keep_global_batch(config, plan: ResumePlan, world_size: int):
    """*config* with the batch the resumed run trains with (see the module docstring)."""
    saved_global = saved_global_batch(plan.meta)
    now = config.train_batch_size
    if saved_global is None or saved_global == now:
        return config
    saved_world = plan.meta.get("world_size")
    if config.checkpoint.resume_batch == "keep_micro":
        plan.note = (f"global batch {saved_global} -> {now} (checkpoint.resume_batch "
                     f"\"keep_micro\")")
        return config
    micro = config.train_micro_batch_size_per_gpu
    accumulation = accumulation_keeping(saved_global, micro, world_size)
    if accumulation is None:
        raise ConfigError(
            f"resuming {plan.save_dir}/{plan.tags[0]} (global batch {saved_global} on "
            f"{saved_world} ranks) on {world_size} ranks: keeping the global batch needs "
            f"micro batch x world size = {micro} x {world_size} to divide {saved_global}. "
            f"Set train_micro_batch_size_per_gpu to a divisor of "
            f"{saved_global // world_size if saved_global % world_size == 0 else '(none fits)'}"
            f", or checkpoint.resume_batch \"keep_micro\" to train with global batch {now}")
    plan.note = (f"global batch {saved_global} kept: accumulation "
                 f"{config.gradient_accumulation_steps} -> {accumulation}")
    return dataclasses.replace(config, train_batch_size=saved_global,
                               gradient_accumulation_steps=accumulation)


def load(plan: ResumePlan, module, load_checkpoint: Callable[[str, str], tuple]) -> tuple:
    """Collective: load the newest loadable checkpoint of *plan* with *load_checkpoint(dir,
    tag)* (the engine's); ``(tag directory, client_state)``."""
    from zero_core.checkpoint.save_load import check_model, describe_model
    where = os.path.join(plan.save_dir, plan.tags[0], store.METADATA)
    try:
        check_model(describe_model(module), plan.meta, where)
    except CheckpointError as exc:
        raise CheckpointMismatchError(f"checkpoint.resume: {exc}. Resume with the model that "
                                      f"was saved, or give this model its own "
                                      f"checkpoint.save_dir") from None
    failures = []
    for tag in plan.tags:
        try:
            return load_checkpoint(plan.save_dir, tag)
        except CheckpointMismatchError:
            raise  # another run's checkpoint: the older ones would not match either
        except CheckpointError as exc:
            failures.append(f"{tag}: {exc}")
            warnings.warn(f"checkpoint.resume: {tag} in {plan.save_dir} could not be loaded "
                          f"({exc}); trying the one before it")
    raise CheckpointError(f"checkpoint.resume: no checkpoint in {plan.save_dir} could be "
                          f"loaded: " + "; ".join(failures))


def announce(plan: ResumePlan, tag_dir: str, step: int, world_size: int) -> None:
    """Rank 0's one line about the resume."""
    world = plan.meta.get("world_size")
    print(f"zero-core: resumed from {tag_dir} at step {step} (saved by {world} "
          f"rank{'s' if world != 1 else ''}, now {world_size}"
          + (f"; {plan.note}" if plan.note else "") + ")", file=sys.stderr, flush=True)
