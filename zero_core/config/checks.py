"""Value checks for config parsing: the converters (``_as_int``, ``_as_float``, ``_as_bool``,
``_as_name``, ``_optional``) that each name the dotted key, the value and what would be valid in
the :class:`~zero_core.errors.ConfigError` they raise, and ``_Section``, which checks one JSON
object's keys against :mod:`zero_core.config.keys` (unknown keys as below, not-yet-implemented
keys by name, neutral values dropped) before handing out validated values.

Keys the tables do not list, inside a section:

* A **near-miss** is an error with a "did you mean", in every section: a key that differs from
  a key DeepSpeed or zero-core reads in that section (supported, no-effect or
  not-yet-implemented) only in letter case, or whose :class:`difflib.SequenceMatcher` ratio
  to one is at least ``NEAR_MISS_RATIO`` (0.6) — exactly the keys for which ``_suggest`` finds
  a suggestion. ``"loss_scale_windw"`` (0.97 to ``loss_scale_window``),
  ``"stage3_prefetch_bucket_sise"``, ``"enable"`` (0.92 to ``enabled``), ``"min_scale"``
  (0.78 to ``min_loss_scale``) are near-misses: ignoring them would train with the default of
  the key that was meant. GPT-NeoX's ``"fp16": {"fp16": true}`` (0.24 at best), trlx's
  ``"opt_level"`` (0.42) and ``"fp16_scale_tolerance"`` (0.51) are not.
* Any other unknown key is ignored with a :class:`~zero_core.errors.ConfigWarning` naming its
  dotted path where DeepSpeed reads the section key by key and ignores it too
  (``LENIENT_SECTIONS``; deepspeed_sections.py says where DeepSpeed reads each, and in which versions), and
  an error listing the valid keys where DeepSpeed validates the section as a whole and
  refuses it.

Unknown top-level keys are ignored with a warning (and the suggestion, if any), as DeepSpeed
ignores them. A section switched off with ``"enabled": false`` (``switched_off``) is not read:
its key names are checked as above, its values are not (``get`` hands out the defaults), and a
not-yet-implemented key in it is dropped whatever its value. A refused feature's section
(``_SWITCHABLE_SECTIONS``) has its first-level keys checked against DeepSpeed's
(``DEEPSPEED_SECTION_KEYS``; only near-misses of its switches where DeepSpeed has no flat key
list) and is accepted when every switch in it is off (``_asks_for_nothing``).
"""
from __future__ import annotations

import difflib
import fnmatch
import json
import math
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from zero_core.config.deepspeed_sections import DEEPSPEED_SECTION_KEYS, LENIENT_SECTIONS
from zero_core.config.keys import (_SWITCHABLE_SECTIONS, NEUTRAL_VALUES, NO_EFFECT_KEYS,
                                   NOT_YET_IMPLEMENTED, SUPPORTED_KEYS)
from zero_core.errors import ConfigError, ConfigWarning

NEAR_MISS_RATIO = 0.6  # difflib ratio from which an unknown key counts as a misspelling

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


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


def _near_miss(word: str, candidates) -> str | None:
    """The candidate *word* most likely misspells (the same letters in another case, else the
    closest with a difflib ratio >= NEAR_MISS_RATIO), or None."""
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    if word.lower() in lowered:
        return lowered[word.lower()]
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=NEAR_MISS_RATIO)
    return close[0] if close else None


def _suggest(word: str, candidates) -> str:
    meant = _near_miss(word, candidates)
    return f"; did you mean '{meant}'?" if meant is not None else ""


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside zero-core (called
    from the function that warns)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _known_keys(table: str) -> tuple[str, ...]:
    """Every key DeepSpeed or zero-core reads in *table*'s section: supported, no-effect and
    not-yet-implemented names (wildcard patterns left out)."""
    section = table.split(":")[0]
    known = list(SUPPORTED_KEYS.get(table, DEEPSPEED_SECTION_KEYS.get(table, ())))
    known += [path.rpartition(".")[2] for path in NO_EFFECT_KEYS
              if path.rpartition(".")[0] == section]
    known += [key for key in NOT_YET_IMPLEMENTED.get(table, {}) if not set(key) & set("*?[")]
    return tuple(dict.fromkeys(known))


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
    validated values. ``table`` names the SUPPORTED_KEYS entry (or, for a refused feature's
    section, the DEEPSPEED_SECTION_KEYS entry), ``path`` the dotted location."""

    def __init__(self, raw: Any, path: str, table: str):
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise _fail(path, raw, "expected a JSON object ({...})")
        self.raw = dict(raw)
        self.path = path
        self.table = table
        self.supported = SUPPORTED_KEYS[table] if table in SUPPORTED_KEYS else \
            DEEPSPEED_SECTION_KEYS[table]
        # "enabled": false (written, not defaulted) switches the section off: not read
        self.switched_off = "enabled" in self.supported and self.raw.get("enabled") is False
        self._check_keys()

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _check_keys(self) -> None:
        supported = self.supported
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
                if not self.path and key in _SWITCHABLE_SECTIONS:
                    value = self.raw[key] = _checked_refused_section(key, value)
                if self.switched_off or self._is_neutral(key, value):
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
            del self.raw[key]
            self._unknown(key)

    def _unknown(self, key: str) -> None:
        """An unknown *key* (already dropped from raw): a warning where DeepSpeed ignores it,
        else an error; a near-miss of a known key is always an error (module docstring)."""
        path = self.key_path(key)
        known = _known_keys(self.table)
        if not self.path:
            # DeepSpeed reads the top-level keys it knows and ignores the rest
            # (configs carry launcher or project settings there): name it, go on
            warnings.warn(f"config key '{key}' is not a DeepSpeed or zero-core key; "
                          f"ignored, as DeepSpeed ignores it{_suggest(key, known)}",
                          ConfigWarning, stacklevel=_user_stacklevel())
            return
        meant = _near_miss(key, known)
        section = self.table.split(":")[0]
        if meant is not None and section in LENIENT_SECTIONS:
            raise ConfigError(
                f"unknown config key '{path}'; did you mean '{meant}'? Ignoring it would leave "
                f"'{self.key_path(meant)}' at its default; correct the name, or remove the key")
        if section in LENIENT_SECTIONS:
            warnings.warn(f"config key '{path}' is not a key zero-core reads; ignored, "
                          f"{LENIENT_SECTIONS[section]}", ConfigWarning,
                          stacklevel=_user_stacklevel())
            return
        where = f"in '{self.path}'"
        if ":" in self.table:
            where += f" for {self.table.split(':', 1)[1]}"
        raise ConfigError(
            f"unknown config key '{path}'{_suggest(key, known)} "
            f"(valid keys {where}: {', '.join(self.supported)})")

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
        return key in self.raw and not (self.switched_off and key != "enabled")

    def get(self, key: str, default: Any, convert, *args, **kwargs) -> Any:
        # Reading a key the tables do not list is a bug here, not a user error.
        assert key in SUPPORTED_KEYS[self.table], f"{key} not in SUPPORTED_KEYS[{self.table!r}]"
        if not self.has(key):
            return default  # absent, or in a switched-off section (not read)
        return convert(self.key_path(key), self.raw[key], *args, **kwargs)


def _checked_refused_section(name: str, value: Any) -> Any:
    """A refused feature's top-level section with its first-level keys checked: against
    DeepSpeed's keys where DEEPSPEED_SECTION_KEYS has them (unknown ones dropped with a warning
    or refused, as for any section), else only for near-misses of the switch names."""
    if not isinstance(value, Mapping):
        return value
    if name in DEEPSPEED_SECTION_KEYS:
        return _Section(value, name, name).raw
    for key in value:
        meant = _near_miss(key, _SWITCH_OFF) if isinstance(key, str) else None
        if meant is not None and key != meant:
            raise ConfigError(f"unknown config key '{name}.{key}'; did you mean '{meant}'? "
                              f"DeepSpeed reads only '{meant}' as the switch of '{name}'")
    return value


def _optional(convert):
    def convert_or_none(path, value, *args, **kwargs):
        return None if value is None else convert(path, value, *args, **kwargs)
    return convert_or_none
