"""The ``tensorboard`` writer: scalar summaries through torch's
``torch.utils.tensorboard.SummaryWriter`` into ``output_path/job_name`` (DeepSpeed's folder),
one ``add_scalar(name, value, step)`` per event and a flush after each batch of events, so a
TensorBoard watching the folder sees every step as it is written.

torch's writer needs the ``tensorboard`` package (not a dependency of zero-core), hence
``check_available``, run on every rank when the monitor is built.
"""
from __future__ import annotations

import os

from zero_core.config.monitors import TensorBoardConfig
from zero_core.monitor.events import Event, log_dir, require

__all__ = ["TensorBoardWriter"]


class TensorBoardWriter:
    """Writes events as TensorBoard scalars (one event file per writer, torch's naming)."""

    def __init__(self, config: TensorBoardConfig):
        summary = self.check_available()
        self.log_dir = log_dir(config.output_path, config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer = summary.SummaryWriter(log_dir=self.log_dir)

    @staticmethod
    def check_available():
        return require("tensorboard", "torch.utils.tensorboard", "tensorboard",
                       "TensorBoard logging")

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
