"""Training text that every machine already has: the Python standard library's own sources.

No download, no data files in the repository: the ``.py`` files under ``sysconfig``'s stdlib
path are read in a fixed order, turned into byte-level tokens (vocabulary 256, one token per
byte), and split by *file* into train and validation text (so validation loss measures
generalisation to unseen modules, not memorised neighbours).

:class:`GlobalBatchSampler` decides, from a seed and the step number alone, which sequences
form each *global* batch, and hands every rank its own disjoint share. Any launcher
(mpirun, torchrun), ZeRO stage or peer engine therefore trains on exactly the same data.

The text depends on the Python version (3.11 here), so losses are comparable between runs
on the same interpreter, not across Python releases.
"""
from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass

import torch

VOCAB_SIZE = 256             # byte-level tokens
DEFAULT_MAX_BYTES = 16 << 20  # enough text for minutes of training; reads in well under a second
VALIDATION_EVERY = 10        # about one file in ten goes to validation
# Folders left out: the test suite (absent from many Python installations, so including it
# would make the corpus differ between machines), and installed third-party packages.
EXCLUDED_DIRS = frozenset({"test", "tests", "site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> str:
    """Directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_source_files(root: str | None = None) -> list[str]:
    """Relative paths of the stdlib's ``.py`` files, sorted so every machine agrees on order."""
    root = root or stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def is_validation_file(relpath: str) -> bool:
    """Stable split by file: a checksum of the path, not Python's salted hash()."""
    return zlib.crc32(relpath.replace(os.sep, "/").encode()) % VALIDATION_EVERY == 0


@dataclass
class TextSplits:
    """Byte tokens (uint8 tensors) of the training and validation text."""

    train: torch.Tensor
    val: torch.Tensor
    n_files: int

    def __repr__(self) -> str:
        return (f"TextSplits(train={self.train.numel():,} tokens, val={self.val.numel():,} "
                f"tokens, from {self.n_files} files)")


def load_stdlib_text(max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None) -> TextSplits:
    """Read up to *max_bytes* bytes of stdlib source and split it into train/validation.

    Files are separated by a NUL byte, which never appears in source text, so the model can
    learn where one file ends. Raises FileNotFoundError if the stdlib has no sources (e.g. a
    "compiled-only" Python build).
    """
    root = root or stdlib_root()
    train_parts, val_parts, total, n_files = [], [], 0, 0
    for rel in stdlib_source_files(root):
        with open(os.path.join(root, rel), "rb") as fh:
            data = fh.read()
        (val_parts if is_validation_file(rel) else train_parts).append(data + b"\0")
        total += len(data) + 1
        n_files += 1
        if total >= max_bytes:
            break
    if not train_parts or not val_parts:
        raise FileNotFoundError(f"found too little Python source under {root!r} to train on "
                                f"({n_files} files): this example needs an interpreter that "
                                f"ships its standard library as .py files")

    def to_tokens(parts):
        # bytearray -> uint8 tensor without a Python-level loop; the tensor owns a copy
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).clone()

    return TextSplits(to_tokens(train_parts), to_tokens(val_parts), n_files)


class GlobalBatchSampler:
    """Seeded random windows of *seq_len* + 1 tokens, the same for every launcher and engine.

    A global batch of step *s* has ``world_size * micro_batch * grad_accum`` sequences; its
    offsets come from a generator seeded with (seed, s) only. Rank *r* at micro-step *m* gets
    the consecutive slice of ``micro_batch`` sequences starting at
    ``(m * world_size + r) * micro_batch``; the union over ranks and micro-steps is the whole
    global batch, with no sequence seen twice.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, micro_batch: int, world_size: int,
                 grad_accum: int = 1, seed: int = 0):
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"text of {tokens.numel()} tokens is too short for sequences of "
                             f"{seq_len} tokens; load more text or shorten seq_len")
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.seed = seed

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step across all ranks."""
        return self.world_size * self.micro_batch * self.grad_accum

    def _offsets(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = self.tokens.numel() - self.seq_len - 1
        return torch.randint(0, high, (self.global_batch,), generator=gen)

    def _windows(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = offsets[:, None] + torch.arange(self.seq_len + 1)[None, :]
        win = self.tokens[idx].long()
        return win[:, :-1], win[:, 1:]

    def global_step_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All sequences of step *step*: inputs and next-token targets, (global_batch, seq_len)."""
        return self._windows(self._offsets(step))

    def rank_batch(self, step: int, rank: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets), each (micro_batch, seq_len) int64, for one micro-step."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size} ranks")
        if not 0 <= micro_step < self.grad_accum:
            raise ValueError(f"micro_step {micro_step} outside 0..{self.grad_accum - 1}")
        start = (micro_step * self.world_size + rank) * self.micro_batch
        return self._windows(self._offsets(step)[start:start + self.micro_batch])


def validation_batches(tokens: torch.Tensor, seq_len: int, n_sequences: int,
                       seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed set of *n_sequences* validation windows (inputs, targets), for comparable evals."""
    sampler = GlobalBatchSampler(tokens, seq_len, micro_batch=n_sequences, world_size=1, seed=seed)
    return sampler.global_step_batch(0)
