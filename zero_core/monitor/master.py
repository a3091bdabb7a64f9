"""``build_monitor(monitor_config, rank)`` and the ``MonitorMaster`` it returns: the one object
an engine holds to report its scalar events to every enabled monitor.

At build time every rank imports the packages the enabled writers need, so a missing one is
the same :class:`~zero_core.errors.ConfigError` on every rank at ``initialize`` (under
DeepSpeed only rank 0 finds out, and the others wait for it at the next collective). Only
rank 0 creates folders, files or runs and writes (as DeepSpeed's monitors do): every rank gets
a ``MonitorMaster`` whose ``enabled`` is DeepSpeed's — any section enabled, the same on every
rank, so code that does collective work under ``if monitor.enabled`` stays in step — while
only rank 0's has writers (``writes``); elsewhere ``write_events`` checks the events and drops
them. With no section enabled, ``build_monitor`` returns None; ``MonitorMaster.off()`` is the
stand-in for an engine that keeps, like DeepSpeed, an ``engine.monitor`` that is never None
(user training loops call ``engine.monitor.write_events`` themselves).
"""
from __future__ import annotations

from collections.abc import Iterable

from zero_core.config.monitors import MonitorConfig
from zero_core.monitor.comet_writer import CometWriter
from zero_core.monitor.csv_writer import CsvWriter
from zero_core.monitor.events import Event, plain_events
from zero_core.monitor.tensorboard_writer import TensorBoardWriter
from zero_core.monitor.wandb_writer import WandbWriter

__all__ = ["MonitorMaster", "build_monitor", "WRITERS"]

#: config section -> writer class, in the order DeepSpeed builds and calls them
WRITERS = {"tensorboard": TensorBoardWriter, "wandb": WandbWriter, "csv_monitor": CsvWriter,
           "comet": CometWriter}


class MonitorMaster:
    """The monitor of one rank: ``writers`` maps section name -> writer (rank 0 only);
    ``enabled`` says whether any monitor section is enabled (the same on every rank)."""

    def __init__(self, writers: dict, enabled: bool = True):
        self.writers = dict(writers)
        self.enabled = enabled

    @classmethod
    def off(cls) -> "MonitorMaster":
        """A monitor with nothing enabled: ``enabled`` False, ``write_events`` drops."""
        return cls({}, enabled=False)

    @property
    def writes(self) -> bool:
        """Whether ``write_events`` writes anything here (rank 0 with a section enabled)."""
        return bool(self.writers)

    def write_events(self, events: Iterable[Event]) -> None:
        """Hand ``[(name, value, step), ...]`` to every writer; *value* a number or a one-element
        tensor, *step* the global sample count. Malformed events are an error on every rank."""
        events = plain_events(events)
        for writer in self.writers.values():
            writer.write_events(events)

    def close(self) -> None:
        """Flush and close what the writers hold open (TensorBoard's event file)."""
        for writer in self.writers.values():
            writer.close()


def build_monitor(monitor_config: MonitorConfig | None, rank: int) -> MonitorMaster | None:
    """The monitor of this rank; None when no monitor section is enabled. Raises a ConfigError
    on every rank when an enabled writer's package is missing; only on rank 0 are the writers
    built (folders made, runs started)."""
    if monitor_config is None or not monitor_config.enabled:
        return None
    enabled = [name for name in WRITERS if getattr(monitor_config, name).enabled]
    for name in enabled:
        WRITERS[name].check_available()
    if rank != 0:
        return MonitorMaster({})
    return MonitorMaster({name: WRITERS[name](getattr(monitor_config, name))
                          for name in enabled})
