"""The checkpoints of one save directory, newest first: what resuming picks from and what
``checkpoint.keep_last`` prunes.

A checkpoint is *complete* when its tag directory holds ``metadata.json`` (rank 0 writes it
last, inside ``.<tag>.partial``, before the rename: store.py). Ordered by the optimizer
step recorded in the metadata, then by the metadata's modification time; the tag ``latest``
names is the newest whatever its step (it is the last one committed: a run that went back
to an earlier checkpoint and saved again).
"""
from __future__ import annotations

import json
import os
import warnings

from zero_core.checkpoint import store


def complete_checkpoints(save_dir: str) -> list[str]:
    """Tags of the complete checkpoints in *save_dir*, newest first (``latest`` first)."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for tag in os.listdir(save_dir):
        meta = os.path.join(save_dir, tag, store.METADATA)
        if tag.startswith(".") or tag == store.LATEST or not os.path.isfile(meta):
            continue
        try:
            with open(meta) as fh:
                step = int(json.load(fh).get("counters", {}).get("global_steps", -1))
            found.append((step, os.path.getmtime(meta), tag))
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # unreadable: not a checkpoint to resume from (loading would say why)
    tags = [tag for _, _, tag in sorted(found, reverse=True)]
    latest = _latest(save_dir)
    if latest in tags:
        tags.remove(latest)
        tags.insert(0, latest)
    return tags


def _latest(save_dir: str) -> str | None:
    try:
        with open(os.path.join(save_dir, store.LATEST)) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def prune(save_dir: str, keep: int) -> list[str]:
    """Rank 0, after a commit: remove complete checkpoints beyond the newest *keep* (never
    the one ``latest`` names) and partial directories other saves left (only one save is in
    flight per job, and it was just committed). Returns the removed tags; a failure to
    remove is a warning (the checkpoint is complete; the disk just holds more)."""
    removed = []
    for tag in complete_checkpoints(save_dir)[keep:]:
        try:
            store.remove_path(os.path.join(save_dir, tag))
            removed.append(tag)
        except OSError as exc:
            warnings.warn(f"checkpoint.keep_last: could not remove the old checkpoint "
                          f"{os.path.join(save_dir, tag)} ({exc}); remove it by hand")
    remove_partials(save_dir)
    return removed


def remove_partials(save_dir: str) -> None:
    """Remove ``.<tag>.partial`` / ``.<tag>.old`` directories left by saves that died."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return
    for name in names:
        if name.startswith(".") and (name.endswith(".partial") or name.endswith(".old")):
            try:
                store.remove_path(os.path.join(save_dir, name))
            except OSError:
                pass  # the next prune tries again
