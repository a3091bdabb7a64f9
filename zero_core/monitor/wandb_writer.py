"""The ``wandb`` writer: on construction one ``wandb.init(project=, group=, entity=team)``,
then one ``wandb.log({name: value}, step=step)`` per event — DeepSpeed's calls, so the run
shows the same charts at the same steps (the global sample count).

The run is wandb's, per process: ``close`` does not finish it (wandb finishes it when the
process exits, as under DeepSpeed), so the user can go on logging to it after the engine.
"""
from __future__ import annotations

from zero_core.config.monitors import WandbConfig
from zero_core.monitor.events import Event, require

__all__ = ["WandbWriter"]


class WandbWriter:
    """Logs events to the Weights & Biases run it starts."""

    def __init__(self, config: WandbConfig):
        self._wandb = self.check_available()
        self._wandb.init(project=config.project, group=config.group, entity=config.team)

    @staticmethod
    def check_available():
        return require("wandb", "wandb", "wandb (then `wandb login`)",
                       "Weights & Biases logging")

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self._wandb.log({name: value}, step=step, commit=None)

    def close(self) -> None:
        """The run stays open (see the module docstring)."""
