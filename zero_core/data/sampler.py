"""Exactly-once data across restarts: a sampler whose position survives a checkpoint and a
change of world size.

Each epoch has one *global order* of the dataset's indices (a permutation seeded by
``seed + epoch``, as torch's DistributedSampler seeds it, or ``0..N-1`` unshuffled). The
ranks read it in interleaved strides: at position ``p`` with ``W`` ranks, rank ``r`` takes
``order[p + r], order[p + r + W], ...``, so one micro-step of every rank consumes the next
``W x micro_batch`` entries of the order, whatever ``W`` is. The state a checkpoint carries
is therefore world-size free: ``(epoch, position)`` — the entries of the epoch's order
consumed by completed micro-steps. After a restart on any number of ranks, reading goes on
from that position: within an epoch no sample is skipped or seen twice (the steps after
the last checkpoint are redone from its state, on the same samples). The tail of an epoch
that does not fill one more micro-step of every rank is not used in that epoch (with
shuffling, a different tail each epoch), as ``drop_last`` does.

Consumption is counted from the engine's micro-steps, not from what the DataLoader has
fetched (it reads ahead): one batch of this sampler's loader per ``engine.step()``.
"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler

from zero_core.checkpoint.store import CheckpointMismatchError


class ResumableSampler(Sampler):
    """This rank's indices of *dataset* for *engine* (see the module docstring). Use it as
    a DataLoader's ``sampler`` with ``batch_size=engine.config.train_micro_batch_size_per_gpu``;
    the engine saves its position with every checkpoint and restores it on load (also when
    the sampler is created after the load). For a resumed run, loop over epochs from
    :attr:`epoch`::

        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)   # optional: the next iteration starts the next epoch
            for batch in loader: ...
    """

    def __init__(self, dataset, engine, shuffle: bool = True, seed: int = 0):
        self.size = len(dataset)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.micro = int(engine.config.train_micro_batch_size_per_gpu)
        self.rank, self.world = engine.global_rank, engine.world_size
        self._micro_steps = lambda: engine.micro_steps
        self.epoch, self.position = 0, 0
        self._started = None  # (epoch, position, engine micro-step) of the running iteration
        self._fresh = True    # the next __iter__ starts at (epoch, position) as they are
        engine.track_data(self)

    # ---- the order ---------------------------------------------------------------------------
    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=g)

    def _end(self, position: int) -> int:
        """Where the usable part of an epoch started at *position* ends."""
        step = self.world * self.micro
        return position + (self.size - position) // step * step

    def __iter__(self):
        if not self._fresh:  # the previous iteration ran: this one is the next epoch
            self.epoch, self.position = self.epoch + 1, 0
        self._fresh = False
        epoch, start = self.epoch, self.position
        self._started = (epoch, start, self._micro_steps())
        order = self._order(epoch)
        return iter(order[start + self.rank:self._end(start):self.world].tolist())

    def __len__(self) -> int:
        """This rank's samples in the next iteration (the rest of the epoch)."""
        return (self._end(self.position) - self.position) // self.world

    def epoch_length(self) -> int:
        """This rank's samples in a whole epoch."""
        return self._end(0) // self.world

    def set_epoch(self, epoch: int) -> None:
        """Start epoch *epoch* at the next iteration (from the restored position if it is
        the epoch a checkpoint was saved in). For the epoch an iteration already started
        reading it does nothing (Lightning starts an epoch's iterator before it calls
        ``set_epoch``)."""
        if self._started is not None and self._started[0] == epoch == self.epoch:
            return
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0
        self._fresh, self._started = True, None

    # ---- the state a checkpoint carries --------------------------------------------------------
    def consumed(self) -> tuple[int, int]:
        """``(epoch, position)`` after the micro-steps the engine completed."""
        if self._started is None:
            return self.epoch, self.position
        epoch, start, micro0 = self._started
        done = (self._micro_steps() - micro0) * self.world * self.micro
        position = start + done
        if position >= self._end(start):
            return epoch + 1, 0
        return epoch, position

    def state_dict(self) -> dict:
        epoch, position = self.consumed()
        return {"epoch": epoch, "position": position, "dataset_size": self.size,
                "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        problems = []
        if int(state["dataset_size"]) != self.size:
            problems.append(f"it was saved for a dataset of {state['dataset_size']} samples, "
                            f"this one has {self.size}")
        if bool(state["shuffle"]) != self.shuffle:
            problems.append(f"shuffle was {state['shuffle']}, now {self.shuffle}")
        if self.shuffle and int(state["seed"]) != self.seed:
            problems.append(f"the shuffling seed was {state['seed']}, now {self.seed}")
        if problems:
            raise CheckpointMismatchError(
                "the checkpoint's data position does not match this data: "
                + "; ".join(problems) + ". Resuming would skip or repeat samples: use the "
                "same dataset and sampler settings as the saved run, or start this data in "
                "a new checkpoint.save_dir")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._fresh, self._started = True, None


def resumable_loader(dataset, engine, collate_fn=None, **kwargs) -> DataLoader:
    """DeepSpeed's ``training_data=``: a DataLoader of micro batches over a
    :class:`ResumableSampler` of *dataset*."""
    sampler = ResumableSampler(dataset, engine)
    # a generator of its own: DataLoader draws its workers' base seed at every iter(), and
    # drawn from torch's global generator that would shift the stream a resumed run
    # restored (dropout after a mid-epoch resume would differ from the uninterrupted run)
    kwargs.setdefault("generator", torch.Generator().manual_seed(0))
    return DataLoader(dataset, batch_size=sampler.micro, sampler=sampler,
                      collate_fn=collate_fn, **kwargs)
