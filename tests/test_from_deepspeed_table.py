"""The README's "Moving from DeepSpeed" table names every top-level key DeepSpeed reads, once,
with the status zero-core's key tables give it.

The list of DeepSpeed's keys is ``tests/fixtures/deepspeed_top_level_keys.json``, written by
``ci/tools/make_deepspeed_top_keys.py`` from DeepSpeed 0.19.8's own config class. A key that
DeepSpeed adds, or a status that changes in ``zero_core/config/keys.py`` without the README
following, fails here.
"""
from __future__ import annotations

import json
import pathlib
import re

from zero_core.config.keys import (_SWITCHABLE_SECTIONS, NO_EFFECT_KEYS, NOT_YET_IMPLEMENTED,
                                   OPTIMIZER_TYPES, SCHEDULER_TYPES, SUPPORTED_KEYS)

ROOT = pathlib.Path(__file__).resolve().parents[1]
ZERO_CORE_OWN = {"accelerator", "comm_backend", "comm_timeout", "generation", "safety",
                 "topology"}


def _rows() -> list[tuple[list[str], str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Moving from DeepSpeed", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and "`" in cells[0]:
            rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[1], cells[2]))
    return rows


def _status(key: str) -> str:
    if key in SUPPORTED_KEYS[""]:
        return "runs"
    if key in NO_EFFECT_KEYS:
        return "no effect"
    if key in NOT_YET_IMPLEMENTED[""] or key in _SWITCHABLE_SECTIONS:
        return "refused"
    raise AssertionError(f"{key!r} is in no key table of zero_core/config/keys.py")


def test_every_deepspeed_key_has_one_row_with_its_status():
    fixture = json.loads((ROOT / "tests/fixtures/deepspeed_top_level_keys.json").read_text())
    ours = (set(SUPPORTED_KEYS[""]) | set(NOT_YET_IMPLEMENTED[""]) | set(_SWITCHABLE_SECTIONS)
            | {k for k in NO_EFFECT_KEYS if "." not in k}) - ZERO_CORE_OWN
    named: dict[str, str] = {}
    for keys, status, _ in _rows():
        for key in keys:
            assert key not in named, f"{key} has two rows"
            named[key] = status
    missing = (set(fixture["keys"]) | ours) - set(named)
    assert not missing, f"DeepSpeed keys without a row in the README's table: {sorted(missing)}"
    wrong = {k: (s, _status(k)) for k, s in named.items() if s != _status(k)}
    assert not wrong, f"README status vs key tables (README, tables): {wrong}"


def test_the_optimizer_and_scheduler_rows_name_every_type_that_runs():
    notes = {keys[0]: note for keys, _, note in _rows()}
    for name in OPTIMIZER_TYPES:
        assert name in notes["optimizer"], name
    for name in SCHEDULER_TYPES:
        assert name in notes["scheduler"], name
