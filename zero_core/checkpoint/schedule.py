"""Saving by itself: ``checkpoint.save_interval_steps`` / ``save_interval_minutes`` into
``checkpoint.save_dir``, in the background with ``checkpoint.async_save``, keeping
``checkpoint.keep_last`` checkpoints.

The engine calls :meth:`Checkpointing.after_update` on every rank after each optimizer
step. It commits an async save whose writers are done (background.py), then saves when
one is due: every N optimizer steps (the step counter is the same on every rank), or when
T minutes have passed since the last save on rank 0's clock — ranks' clocks differ, so
rank 0's verdict is shared by one small all-reduce per step (only with minutes set).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from zero_core.checkpoint.background import BackgroundSaver
from zero_core.checkpoint.history import prune


class Checkpointing:
    """What an engine keeps for its checkpoints besides the training state: the periodic
    schedule, the async save in flight (:attr:`background`), and the data position a
    :class:`~zero_core.data.ResumableSampler` reports (saved in ``common.pt``)."""

    def __init__(self, config, comm, clock=time.monotonic):
        self.config, self.comm, self.clock = config, comm, clock
        self.background = BackgroundSaver(comm)
        self._last_save = clock()
        self._sampler = self._restored_data = None

    # ---- the data position ------------------------------------------------------------------
    def track_data(self, sampler) -> None:
        self._sampler = sampler
        if self._restored_data is not None:  # loaded before the sampler existed: once
            state, self._restored_data = self._restored_data, None
            sampler.load_state_dict(state)

    def data_state(self) -> dict | None:
        return None if self._sampler is None else self._sampler.state_dict()

    def restore_data(self, state: dict) -> None:
        if self._sampler is not None:
            self._sampler.load_state_dict(state)
        else:
            self._restored_data = state

    # ---- saving ---------------------------------------------------------------------------------
    def after_update(self, step: int, save: Callable[[str], object]) -> None:
        """Collective, on every rank after optimizer step *step*; *save(directory)* is the
        engine's save_checkpoint."""
        if self.background.poll() is not None:
            self._prune()
        if self._due(step):
            save(self.config.save_dir)

    def _due(self, step: int) -> bool:
        cfg = self.config
        if cfg.save_dir is None:
            return False
        due = bool(cfg.save_interval_steps) and step % cfg.save_interval_steps == 0
        if cfg.save_interval_minutes is not None:
            late = self.comm.rank == 0 and (
                self.clock() - self._last_save >= 60.0 * cfg.save_interval_minutes)
            flag = torch.tensor([1 if late else 0], dtype=torch.int32)
            if self.comm.world_size > 1:
                self.comm.all_reduce(flag, op="max")
            due = due or bool(int(flag))
        return due

    def saved(self, committed: bool) -> None:
        """A save was started (async) or committed (sync) by any route: restart the
        minutes clock; after a commit, prune."""
        self._last_save = self.clock()
        if committed:
            self._prune()

    def wait(self) -> str | None:
        """Collective: commit the save in flight (if any)."""
        final = self.background.wait()
        if final is not None:
            self._prune()
        return final

    def close(self) -> None:
        """Collective (the engine's destroy): commit the save in flight, then drop the host
        buffers async saves reuse."""
        self.wait()
        self.background.release()

    def _prune(self) -> None:
        cfg = self.config
        if cfg.keep_last is not None and cfg.save_dir is not None and self.comm.rank == 0:
            prune(cfg.save_dir, cfg.keep_last)
