"""The ``comet`` writer: on construction one ``comet_ml.start(api_key=, project=, workspace=,
experiment_key=, mode=, online=)`` (unset values are left to comet_ml's own config file and
COMET_* variables) and ``set_name(experiment_name)`` when one is given; then each event is
logged as a metric at its step — the first time a name is seen, and again only once
``samples_log_interval`` more samples have passed since that name was last logged (DeepSpeed's
rule: Comet is a network service, the interval keeps the traffic down).

comet_ml >= 3.41.0 is needed (``comet_ml.start`` is that recent). Metrics go through the
experiment's ``__internal_api__log_metric__`` where comet_ml has it — the entry point it gives
integrations, which DeepSpeed uses — else the public ``log_metric``.
"""
from __future__ import annotations

from zero_core.config.monitors import CometConfig
from zero_core.monitor.events import Event, require

__all__ = ["CometWriter", "COMET_MIN_VERSION"]

COMET_MIN_VERSION = (3, 41, 0)


class CometWriter:
    """Logs events as metrics of the Comet experiment it starts."""

    def __init__(self, config: CometConfig):
        comet_ml = self.check_available()
        self.samples_log_interval = config.samples_log_interval
        self.experiment = comet_ml.start(
            api_key=config.api_key, project=config.project, workspace=config.workspace,
            experiment_key=config.experiment_key, mode=config.mode, online=config.online)
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self._log = (getattr(self.experiment, "__internal_api__log_metric__", None)
                     or self.experiment.log_metric)
        self._last_logged: dict[str, int] = {}     # event name -> step it was last logged at

    @staticmethod
    def check_available():
        return require("comet", "comet_ml", '"comet_ml>=3.41.0"', "Comet logging",
                       min_version=COMET_MIN_VERSION)

    def due(self, name: str, step: int) -> bool:
        """Whether *name* at *step* is logged (and, if so, remember it was)."""
        last = self._last_logged.get(name)
        if last is not None and step - last < self.samples_log_interval:
            return False
        self._last_logged[name] = step
        return True

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            if self.due(name, step):
                self._log(name=name, value=value, step=step)

    def close(self) -> None:
        """The experiment stays open; comet_ml ends it when the process exits."""
