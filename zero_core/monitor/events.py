"""What the monitor writers share: an event is ``(name, value, step)`` — a scalar named like
"Train/Samples/lr" at a step that is the global sample count — checked and made plain once by
``plain_events`` (a 0-d tensor or numpy number becomes a Python number, so every writer sees
the same value and the CSV text is the number, not a tensor's repr); ``log_dir`` is DeepSpeed's
``output_path/job_name`` folder; ``require`` turns a missing package into a ConfigError that says
what to install.
"""
from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from zero_core.errors import ConfigError, ZeroCoreError

__all__ = ["Event", "plain_events", "log_dir", "require"]

Event = tuple[str, float, int]


def _plain_number(name: str, value: Any) -> int | float:
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()      # a one-element tensor or a numpy scalar
        except (ValueError, RuntimeError) as exc:
            raise ZeroCoreError(f"monitor event {name!r}: the value must be a real number (or "
                                f"a one-element tensor): {exc}") from exc
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ZeroCoreError(f"monitor event {name!r}: the value must be a real number (or a "
                            f"one-element tensor), got {type(value).__name__} {value!r}")
    # numpy's float64 is a float subclass whose repr is not the number's
    return float(value) if isinstance(value, float) else int(value)


def plain_events(events: Iterable) -> list[Event]:
    """*events* as a list of ``(str, number, int)``; a malformed event is a ZeroCoreError."""
    out = []
    for event in events:
        if not isinstance(event, (tuple, list)) or len(event) != 3:
            raise ZeroCoreError(f"a monitor event is a (name, value, step) tuple, got {event!r}")
        name, value, step = event
        if not isinstance(name, str) or not name:
            raise ZeroCoreError(f"monitor event name must be a non-empty string, got {name!r}")
        if hasattr(step, "item") and not isinstance(step, int):
            step = step.item()
        if isinstance(step, bool) or not isinstance(step, int):
            raise ZeroCoreError(f"monitor event {name!r}: the step must be an integer (the "
                                f"global sample count), got {step!r}")
        out.append((name, _plain_number(name, value), int(step)))
    return out


def log_dir(output_path: str, job_name: str) -> str:
    """DeepSpeed's folder for a writer, ``output_path/job_name`` (output_path "" = the working
    directory), made absolute once so that a later ``os.chdir`` does not move the logs."""
    return os.path.abspath(os.path.join(output_path, job_name))


def _version(text: str) -> tuple[int, ...]:
    match = re.match(r"\d+(?:\.\d+)*", text or "")
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def require(section: str, module: str, install: str, what: str,
            min_version: tuple[int, ...] | None = None) -> ModuleType:
    """Import *module* for the enabled config section *section*, or raise a ConfigError saying
    to ``pip install`` *install* (or to switch the section off)."""
    fix = f"pip install {install}, or set \"{section}\": {{\"enabled\": false}}"
    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"config key '{section}.enabled' = true: {what} needs the Python "
                          f"module '{module}', which cannot be imported here ({exc}); {fix}"
                          ) from exc
    if min_version is not None:
        have = getattr(found, "__version__", "")
        if _version(have) < min_version:
            need = ".".join(map(str, min_version))
            raise ConfigError(f"config key '{section}.enabled' = true: {what} needs {module} >= "
                              f"{need}, found {have or 'an unknown version'}; {fix}")
    return found
