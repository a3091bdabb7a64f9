"""DeepSpeed's four monitor sections — ``tensorboard``, ``csv_monitor``, ``wandb``, ``comet`` —
as frozen dataclasses with DeepSpeed's defaults, the keys each section accepts
(``MONITOR_SECTIONS``) and ``parse_monitors``, which validates them from the top-level config
dict into one :class:`MonitorConfig`.

They live apart from :mod:`zero_core.config.schema` / :mod:`zero_core.config.parser` because
the four sections form one feature (:mod:`zero_core.monitor` writes them); their keys are
checked like every other section's (an unknown key is a
:class:`~zero_core.errors.ConfigError` with a "did you mean", as DeepSpeed's pydantic models
refuse it; a section with ``"enabled": false`` is not read beyond its key names). Whether the
package a writer needs (tensorboard, wandb, comet_ml) is installed is checked when the monitor
is built, not here: parsing a config needs neither torch nor any of them.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zero_core.config.checks import (_as_bool, _as_int, _as_name, _fail, _optional, _Section,
                                     _suggest)
from zero_core.config.keys import SUPPORTED_KEYS
from zero_core.errors import ConfigError

__all__ = ["TensorBoardConfig", "CSVMonitorConfig", "WandbConfig", "CometConfig",
           "MonitorConfig", "MONITOR_SECTIONS", "COMET_MODES", "parse_monitors"]

#: section name -> the keys DeepSpeed accepts in it (its pydantic models forbid any other);
#: the table itself is SUPPORTED_KEYS in keys.py, the one list of accepted keys
MONITOR_SECTIONS: dict[str, tuple[str, ...]] = {
    name: SUPPORTED_KEYS[name] for name in ("tensorboard", "csv_monitor", "wandb", "comet")}

#: how comet_ml.start opens the experiment (the values DeepSpeed's documentation names)
COMET_MODES = ("get", "create", "get_or_create")


@dataclass(frozen=True)
class TensorBoardConfig:
    """``tensorboard``: event files in ``output_path/job_name`` ("" = the working directory)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class CSVMonitorConfig:
    """``csv_monitor``: one CSV file per event name in ``output_path/job_name``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class WandbConfig:
    """``wandb``: one Weights & Biases run (``team`` is wandb's entity)."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


@dataclass(frozen=True)
class CometConfig:
    """``comet``: one Comet experiment; a metric is sent again only after
    ``samples_log_interval`` more samples. Unset (None) values are left to comet_ml (its
    config file and COMET_* environment variables)."""

    enabled: bool = False
    samples_log_interval: int = 100
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = field(default=None, repr=False)   # a secret: kept out of reprs
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None


@dataclass(frozen=True)
class MonitorConfig:
    """The four monitor sections; ``enabled`` when any of them is."""

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    csv_monitor: CSVMonitorConfig = field(default_factory=CSVMonitorConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    comet: CometConfig = field(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        return any(getattr(self, name).enabled for name in MONITOR_SECTIONS)

    @property
    def enabled_sections(self) -> tuple[str, ...]:
        """Names of the enabled sections, in ``MONITOR_SECTIONS`` order."""
        return tuple(name for name in MONITOR_SECTIONS if getattr(self, name).enabled)


# ---------------------------------------------------------------------------------------------
# Checks.
# ---------------------------------------------------------------------------------------------

def _as_text(path: str, value: Any) -> str:
    """Any string, empty included, kept as written (a path or a directory name)."""
    if not isinstance(value, str):
        raise _fail(path, value, "expected a string")
    return value


def _comet_mode(path: str, value: Any) -> str:
    if value not in COMET_MODES:
        raise _fail(path, value, f"expected one of {', '.join(map(repr, COMET_MODES))}"
                                 f"{_suggest(str(value), COMET_MODES)}")
    return value


def _secret(path: str, value: Any) -> str:
    """A non-empty string whose value no message repeats (an API key)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"config key '{path}': expected a non-empty string (the value is not "
                          f"shown: it is a secret)")
    return value.strip()


_EXPERIMENT_KEY = re.compile(r"[A-Za-z0-9]{32,50}")


def _experiment_key(path: str, value: Any) -> str:
    if not isinstance(value, str) or not _EXPERIMENT_KEY.fullmatch(value):
        raise _fail(path, value, "expected an alphanumeric string of 32 to 50 characters "
                                 "(Comet's experiment key format)")
    return value


def _parse_output_dir(s: _Section, cls):
    return cls(enabled=s.get("enabled", False, _as_bool),
               output_path=s.get("output_path", "", _as_text),
               job_name=s.get("job_name", "DeepSpeedJobName", _as_text))


def parse_monitors(raw_top: Mapping) -> MonitorConfig:
    """The four monitor sections of the top-level config dict *raw_top* (absent = defaults)."""
    if not isinstance(raw_top, Mapping):
        raise _fail("", raw_top, "expected the config as a JSON object ({...})")
    tensorboard = _parse_output_dir(_Section(raw_top.get("tensorboard"), "tensorboard", "tensorboard"), TensorBoardConfig)
    csv_monitor = _parse_output_dir(_Section(raw_top.get("csv_monitor"), "csv_monitor", "csv_monitor"), CSVMonitorConfig)
    w = _Section(raw_top.get("wandb"), "wandb", "wandb")
    wandb = WandbConfig(enabled=w.get("enabled", False, _as_bool),
                        group=w.get("group", None, _optional(_as_name)),
                        team=w.get("team", None, _optional(_as_name)),
                        project=w.get("project", "deepspeed", _as_name))
    c = _Section(raw_top.get("comet"), "comet", "comet")
    comet = CometConfig(
        enabled=c.get("enabled", False, _as_bool),
        samples_log_interval=c.get("samples_log_interval", 100, _as_int, 0),
        project=c.get("project", None, _optional(_as_name)),
        workspace=c.get("workspace", None, _optional(_as_name)),
        api_key=c.get("api_key", None, _optional(_secret)),
        experiment_name=c.get("experiment_name", None, _optional(_as_name)),
        experiment_key=c.get("experiment_key", None, _optional(_experiment_key)),
        online=c.get("online", None, _optional(_as_bool)),
        mode=c.get("mode", None, _optional(_comet_mode)),
    )
    return MonitorConfig(tensorboard=tensorboard, csv_monitor=csv_monitor, wandb=wandb,
                         comet=comet)
