"""Value checks for config parsing: the converters (``_as_int``, ``_as_float``, ``_as_bool``,
``_as_name``, ``_optional``) that each name the dotted key, the value and what would be valid in
the :class:`~zero_core.errors.ConfigError` they raise, and ``_Section``, which checks one JSON
object's keys against :mod:`zero_core.config.keys` (unknown keys with a "did you mean",
not-yet-implemented keys by name, neutral values dropped) before handing out validated values.
"""
from __future__ import annotations

import difflib
import fnmatch
import json
import math
import warnings
from collections.abc import Mapping
from typing import Any

from zero_core.config.keys import (_SWITCHABLE_SECTIONS, NEUTRAL_VALUES, NO_EFFECT_KEYS,
                                   NOT_YET_IMPLEMENTED, SUPPORTED_KEYS)
from zero_core.errors import ConfigError, ConfigWarning


def _fail(path: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"config key '{path}' = {value!r}: {expected}")


def _require_divisor(path: str, value: int, world_size: int, hint: str) -> None:
    """Raise unless *value* divides *world_size*, listing the divisors (and *hint*)."""
    if world_size % value:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise _fail(path, value, f"must divide the world size {world_size} (valid: "
                                 f"{', '.join(map(str, divisors))}{hint})")


def _refuse_auto(path: str, value: Any) -> None:
    if isinstance(value, str) and value.strip().lower() == "auto":
        raise _fail(path, value, "'auto' is a Hugging Face Trainer placeholder that the Trainer "
                                 "replaces before DeepSpeed reads the config; zero-core needs the "
                                 "concrete value here")


def _as_int(path: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    _refuse_auto(path, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, value, f"expected an integer{_range_text(lo, hi)}")
    if isinstance(value, float):
        # JSON writers and humans write sizes like 5e8; accept them when they are whole.
        if not math.isfinite(value) or not value.is_integer():
            raise _fail(path, value, f"expected an integer{_range_text(lo, hi)} "
                                     f"(a float is accepted only when it is whole, like 5e8)")
        value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _fail(path, value, f"out of range: expected an integer{_range_text(lo, hi)}")
    return value


def _as_float(path: str, value: Any, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False, hi_open: bool = False) -> float:
    _refuse_auto(path, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, value, f"expected a number{_range_text(lo, hi, lo_open, hi_open)}")
    number = float(value)
    if not math.isfinite(number):
        raise _fail(path, value, f"expected a finite number{_range_text(lo, hi, lo_open, hi_open)}")
    too_low = lo is not None and (number <= lo if lo_open else number < lo)
    too_high = hi is not None and (number >= hi if hi_open else number > hi)
    if too_low or too_high:
        raise _fail(path, value, f"out of range: expected a number"
                                 f"{_range_text(lo, hi, lo_open, hi_open)}")
    return number


def _as_bool(path: str, value: Any) -> bool:
    _refuse_auto(path, value)
    if not isinstance(value, bool):
        raise _fail(path, value, "expected true or false (a JSON boolean, not a string or number)")
    return value


def _as_name(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, value, "expected a non-empty string")
    return value.strip()


def _range_text(lo, hi, lo_open=False, hi_open=False) -> str:
    lo, hi = (None if v is None else f"{v:g}" for v in (lo, hi))
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi}"
    return ""


def _suggest(word: str, candidates) -> str:
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    if word.lower() in lowered:
        return f"; did you mean '{lowered[word.lower()]}'?"
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


_SWITCH_OFF = {"enabled": False, "deepcompile": False}


def _asks_for_nothing(section: Any) -> bool:
    """True when every switch inside *section* (at any depth) is off: ``enabled`` and
    ``deepcompile`` false, parallel sizes (``*_size``) at most 1 (absent switches are off,
    DeepSpeed's defaults)."""
    switches: list[bool] = []

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                if k in _SWITCH_OFF:
                    switches.append(v is _SWITCH_OFF[k])
                elif isinstance(k, str) and k.endswith("_size") and not isinstance(v, Mapping):
                    switches.append(isinstance(v, (int, float)) and not isinstance(v, bool)
                                    and v <= 1)
                else:
                    walk(v)

    if not isinstance(section, Mapping):
        return False
    walk(section)
    return all(switches)


def _pending_feature(table: str, key: str) -> str | None:
    for pattern, what in NOT_YET_IMPLEMENTED.get(table, {}).items():
        if fnmatch.fnmatchcase(key, pattern):
            return what
    return None


class _Section:
    """One JSON object of the config: checks its keys against the tables, then hands out
    validated values. ``table`` names the SUPPORTED_KEYS entry, ``path`` the dotted location."""

    def __init__(self, raw: Any, path: str, table: str):
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise _fail(path, raw, "expected a JSON object ({...})")
        self.raw = dict(raw)
        self.path = path
        self.table = table
        self._check_keys()

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _check_keys(self) -> None:
        supported = SUPPORTED_KEYS[self.table]
        for key in list(self.raw):
            if not isinstance(key, str):
                raise _fail(self.key_path(str(key)), key, "keys must be strings")
            if key in supported:
                continue
            path = self.key_path(key)
            value = self.raw[key]
            if self._table_path(key) in NO_EFFECT_KEYS:
                del self.raw[key]  # DeepSpeed documents it as not changing the result
                continue
            feature = _pending_feature(self.table, key)
            if (feature is not None and key not in NOT_YET_IMPLEMENTED.get(self.table, {})
                    and difflib.get_close_matches(key, supported, n=1, cutoff=0.9)):
                feature = None  # a wildcard caught a misspelt supported key: say so below
            if feature is not None:
                if self._is_neutral(key, value):
                    del self.raw[key]  # asks for what zero-core does anyway
                    continue
                if self._table_path(key) in NEUTRAL_VALUES:
                    neutral = json.dumps(NEUTRAL_VALUES[self._table_path(key)])
                    hint = f"; only {neutral} (the feature off) is accepted for now"
                elif key in _SWITCHABLE_SECTIONS and not self.path:
                    hint = "; remove the key (or set \"enabled\": false) to train without it"
                else:
                    hint = "; remove the key to train without it"
                raise ConfigError(f"config key '{path}' ({feature}) is not implemented yet in "
                                  f"zero-core{hint}")
            if not self.path:
                # DeepSpeed reads the top-level keys it knows and ignores the rest
                # (configs carry launcher or project settings there): name it, go on
                del self.raw[key]
                warnings.warn(f"config key '{key}' is not a DeepSpeed or zero-core key; "
                              f"ignored, as DeepSpeed ignores it{_suggest(key, supported)}",
                              ConfigWarning, stacklevel=5)
                continue
            where = f"in '{self.path}'"
            if ":" in self.table:
                where += f" for {self.table.split(':', 1)[1]}"
            raise ConfigError(
                f"unknown config key '{path}'{_suggest(key, supported)} "
                f"(valid keys {where}: {', '.join(supported)})")

    def _table_path(self, key: str) -> str:
        # NEUTRAL_VALUES use the table's name ("bf16.x" also for "bfloat16", no ":Type").
        section = self.table.split(":")[0]
        return f"{section}.{key}" if section else key

    def _is_neutral(self, key: str, value: Any) -> bool:
        if self._table_path(key) in NEUTRAL_VALUES:
            want = NEUTRAL_VALUES[self._table_path(key)]
            return type(value) is type(want) and value == want or (
                isinstance(want, float) and not isinstance(value, bool)
                and isinstance(value, (int, float)) and float(value) == want)
        if not self.path and key in _SWITCHABLE_SECTIONS:
            return _asks_for_nothing(value)
        return False

    def has(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any, convert, *args, **kwargs) -> Any:
        # Reading a key the tables do not list is a bug here, not a user error.
        assert key in SUPPORTED_KEYS[self.table], f"{key} not in SUPPORTED_KEYS[{self.table!r}]"
        if key not in self.raw:
            return default
        return convert(self.key_path(key), self.raw[key], *args, **kwargs)



def _optional(convert):
    def convert_or_none(path, value, *args, **kwargs):
        return None if value is None else convert(path, value, *args, **kwargs)
    return convert_or_none
