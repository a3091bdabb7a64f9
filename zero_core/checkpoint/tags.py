"""DeepSpeed's ``checkpoint.tag_validation``: do all ranks save under the same tag?

A checkpoint's ranks must write into one directory; a rank that names another tag (a tag
built from a per-rank value, such as a local timestamp) would split it. Two small
collectives compare the tag's digest across ranks (its max and min agree only if every
rank has the same one):

- ``"IGNORE"``: no check (DeepSpeed's switch for saving the collectives);
- ``"WARN"`` (DeepSpeed's default): a mismatch is reported with a warning, and — unlike
  DeepSpeed, which would save a split checkpoint — every rank saves under rank 0's tag;
- ``"FAIL"``: a mismatch raises CheckpointError on every rank, naming rank 0's tag.
"""
from __future__ import annotations

import hashlib
import warnings

import torch

from zero_core.checkpoint.store import CheckpointError


def _digest(tag: str) -> int:
    # 62 bits: an int64 that no sign issue can touch in any backend's max/min
    return int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "big") >> 2


def _rank0_tag(comm, tag: str) -> str:
    raw = torch.tensor(list(tag.encode()), dtype=torch.int64)
    length = torch.tensor([raw.numel()], dtype=torch.int64)
    comm.all_reduce(length, "max")
    buf = torch.zeros(int(length.item()), dtype=torch.int64)
    buf[:raw.numel()] = raw
    comm.broadcast(buf, src=0)
    return bytes(int(b) for b in buf.tolist()).rstrip(b"\0").decode()


def validate_tag(comm, tag: str, mode: str) -> str:
    """The tag every rank saves under (collective unless *mode* is "IGNORE")."""
    if mode == "IGNORE" or comm.world_size == 1:
        return tag
    digest = torch.tensor([_digest(tag), -_digest(tag)], dtype=torch.int64)
    comm.all_reduce(digest, "max")  # [max digest, -min digest]
    if int(digest[0]) == -int(digest[1]):
        return tag
    first = _rank0_tag(comm, tag)
    what = (f"checkpoint tags differ across ranks (rank {comm.rank} has {tag!r}, rank 0 "
            f"{first!r}); every rank must pass the same tag to save_checkpoint")
    if mode == "FAIL":
        raise CheckpointError(f"{what} (checkpoint.tag_validation is \"Fail\"); nothing was "
                              f"saved")
    warnings.warn(f"{what}; saving under rank 0's tag {first!r} (checkpoint.tag_validation "
                  f"\"Warn\"; \"Fail\" makes this an error)", stacklevel=3)
    return first
