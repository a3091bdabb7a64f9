"""Exactly-once data for ``ZeroCoreStrategy`` (lightning.py): the training loader read
from a :class:`~zero_core.data.ResumableSampler`, and Lightning's batch counters put in step
with its position when a checkpoint is resumed.

Without it (Lightning 2.6): ``trainer.fit(ckpt_path=...)`` of a mid-epoch checkpoint
restores the fit loop's progress (epoch, batches done in the epoch, global step), but a
plain DataLoader is not resumable (Lightning restores only loaders with
``state_dict``/``load_state_dict``): the epoch is read again from its start while the loop
counts on from the restored batch, so the saved steps' samples are trained twice and as
many at the epoch's end not at all.

What the strategy does (``ZeroCoreStrategy(resumable_data=True)``, the default):

- :func:`remade_resumable`: the training DataLoader whose sampler is a torch
  ``DistributedSampler`` for this rank (the one Lightning injects, or the user's own) is
  re-made over a :class:`LoopSampler` with the same ``shuffle`` and ``seed``. Its order
  is the DistributedSampler's (one permutation seeded by ``seed + epoch``, rank r reading
  entries r, r+W, ...); only the tail of an epoch that does not fill one more micro-batch
  on every rank is left out, where the DistributedSampler would repeat samples to fill
  it. The engine saves its position with each checkpoint (``common.pt``); the loader also
  gets ``state_dict``/``load_state_dict``, so Lightning records it in its loop state and
  treats the loader as resumable.
- :func:`align_loops`: on resume, before Lightning restores its loops, the fit loop's
  count of the interrupted epoch's batches is set from the data position
  (``position / (world size x batch size)``): on another world size or batch size the
  loop then ends the epoch where the data ends. The checkpoint's global batch must be
  kept (``world x batch x accumulate_grad_batches``): Lightning builds the engine before
  it says which checkpoint it loads, so the accumulation cannot be chosen for it as
  ``checkpoint.resume`` does; another global batch is an error naming the
  ``accumulate_grad_batches`` that keeps it, unless the config says
  ``checkpoint.resume_batch: "keep_micro"``.

Not covered: other samplers (weighted, custom batch samplers, iterable datasets) are left
as they are (Lightning warns at a mid-epoch resume), and checkpoints written without the
position restart their epoch as before (with a warning).
"""
from __future__ import annotations

import warnings

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from zero_core.checkpoint import store
from zero_core.checkpoint.resume import accumulation_keeping, saved_global_batch
from zero_core.data import ResumableSampler
from zero_core.errors import ConfigError

_DATA_KEYS = ("epoch", "position", "dataset_size")


class LoopSampler(ResumableSampler):
    """A :class:`ResumableSampler` as Lightning's fit loop drives it: ``len`` is the
    whole epoch, also when resumed mid-epoch (the loop counts the batches done itself,
    :func:`align_loops`)."""

    def __len__(self) -> int:
        return self.epoch_length()


class TrainingData:
    """The strategy's side of this (``resumable``: its ``resumable_data``): the sampler of
    its current training loader and the engine it counts for (a reloaded loader goes on
    from it), and the checks of a resume."""

    def __init__(self, resumable: bool):
        self.resumable = bool(resumable)
        self.engine = self.sampler = None

    def loader(self, dataloader, engine, trainer):
        """*dataloader*, made resumable when it is the training loader and
        :func:`remade_resumable` can."""
        if not (self.resumable and engine is not None and trainer.training):
            return dataloader
        previous = self.sampler if self.engine is engine else None
        loader, sampler = remade_resumable(dataloader, engine, previous)
        if sampler is not None:
            self.engine, self.sampler = engine, sampler
        return loader

    def resumed(self, path: str, checkpoint: dict, engine, config: dict) -> None:
        """After the engine loaded *path* for fitting, before Lightning restores its loops
        from *checkpoint*: :func:`check_global_batch`, then :func:`align_loops`."""
        check_global_batch(path, engine, (config.get("checkpoint") or {}).get(
            "resume_batch", "keep_global"))
        if self.resumable:
            align_loops(checkpoint, engine)


def remade_resumable(dataloader, engine, previous: LoopSampler | None = None):
    """``(loader, sampler)``: *dataloader* re-made over a :class:`LoopSampler` (continuing
    *previous*, a sampler of the same engine whose loader this one replaces), or
    ``(dataloader, None)`` when its sampler is not a plain DistributedSampler of this
    rank (a near miss is warned about)."""
    if not isinstance(dataloader, DataLoader) or type(dataloader.sampler) is not DistributedSampler:
        return dataloader, None
    ds = dataloader.sampler
    micro = int(engine.config.train_micro_batch_size_per_gpu)
    why = None
    if (ds.num_replicas, ds.rank) != (engine.world_size, engine.global_rank):
        why = (f"its DistributedSampler is for rank {ds.rank} of {ds.num_replicas}, the engine "
               f"runs rank {engine.global_rank} of {engine.world_size}")
    elif type(dataloader.batch_sampler) is not BatchSampler or dataloader.batch_size != micro:
        why = (f"its batches (batch_size {dataloader.batch_size}) are not the engine's micro "
               f"batch ({micro})")
    if why is not None:
        warnings.warn(f"ZeroCoreStrategy: the training DataLoader is read as it is, not "
                      f"resumably ({why}): a mid-epoch resume will repeat and skip samples")
        return dataloader, None
    sampler = LoopSampler(dataloader.dataset, engine, shuffle=ds.shuffle, seed=ds.seed)
    if previous is not None:   # a reloaded loader continues where the last one was
        sampler.load_state_dict(previous.state_dict())
    loader = _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)
    # Lightning saves and restores loaders that have these (and then calls them resumable)
    loader.state_dict = sampler.state_dict
    loader.load_state_dict = sampler.load_state_dict
    return loader, sampler


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _data_state(fit_loop: dict) -> dict | None:
    for state in (fit_loop.get("state_dict") or {}).get("combined_loader") or []:
        if isinstance(state, dict) and all(k in state for k in _DATA_KEYS):
            return state
    return None


def check_global_batch(path: str, engine, resume_batch: str) -> None:
    """Refuse a checkpoint saved with another global batch unless *resume_batch* is
    "keep_micro" (see the module docstring)."""
    _, meta = store.read_metadata(path)
    saved = saved_global_batch(meta)
    now = int(engine.config.train_batch_size)
    if saved is None or saved == now or resume_batch == "keep_micro":
        return
    micro, world = int(engine.config.train_micro_batch_size_per_gpu), engine.world_size
    accumulation = accumulation_keeping(saved, micro, world)
    fix = (f"Trainer(accumulate_grad_batches={accumulation})"
           if accumulation is not None else
           f"a batch size and accumulate_grad_batches whose product with the {_ranks(world)} "
           f"is {saved}")
    raise ConfigError(
        f"resuming {path} (global batch {saved}, saved by {meta.get('world_size')} ranks) "
        f"with global batch {now} ({_ranks(world)} x batch size {micro} x "
        f"accumulate_grad_batches {engine.gradient_accumulation_steps}): use {fix} to keep "
        f"the saved global batch, or set the config's checkpoint.resume_batch to "
        f"\"keep_micro\" to train on with global batch {now}")


def align_loops(checkpoint: dict, engine) -> None:
    """Set the interrupted epoch's batch counters in *checkpoint*'s fit-loop state (before
    Lightning restores them) from the data position it carries, in this run's batches."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if not isinstance(fit, dict) or "epoch_loop.batch_progress" not in fit:
        return
    batches = fit["epoch_loop.batch_progress"]
    done = int(batches["current"]["ready"])
    data = _data_state(fit)
    if data is None:
        if done and not batches.get("is_last_batch"):
            warnings.warn(f"ZeroCoreStrategy: this checkpoint was saved after batch {done} of "
                          f"its epoch without a data position (its training loader was not "
                          f"resumable): the epoch is read again from its start")
        return
    if int(data["epoch"]) != int(fit["epoch_progress"]["current"]["processed"]):
        return   # saved at the end of an epoch: the next one starts at its beginning
    per_batch = engine.world_size * int(engine.config.train_micro_batch_size_per_gpu)
    position = int(data["position"])
    if position % per_batch:
        raise ConfigError(
            f"the checkpoint's data position ({position} samples into epoch {data['epoch']}) "
            f"is not a whole number of this run's batches ({_ranks(engine.world_size)} x "
            f"batch size {per_batch // engine.world_size}): resume with a world size and "
            f"batch size whose product divides {position}")
    now = position // per_batch
    accumulation = engine.gradient_accumulation_steps
    if (engine.micro_steps - now) % accumulation:
        raise ConfigError(
            f"the checkpoint's data position ({now} batches of {per_batch} samples into the "
            f"epoch) falls inside an accumulation window of {accumulation} batches: resume "
            f"it with a global batch that divides the samples trained in the epoch "
            f"({position})")
    shift = now - done
    if shift:
        for counts in (batches["current"], batches["total"]):
            for key in ("ready", "started", "processed", "completed"):
                counts[key] = int(counts[key]) + shift
