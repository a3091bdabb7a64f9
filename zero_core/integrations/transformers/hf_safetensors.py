"""Hugging Face's safetensors checkpoint layout: shard sizes, the shard plan, the index,
and reading a local checkpoint directory tensor by tensor.

The layout (what ``PreTrainedModel.save_pretrained`` writes and ``from_pretrained`` reads):

- one ``model.safetensors`` when everything fits in ``max_shard_size``; otherwise
  ``model-00001-of-0000N.safetensors`` … and ``model.safetensors.index.json`` =
  ``{"metadata": {"total_parameters": P, "total_size": bytes}, "weight_map": {name: file}}``;
- every file's header carries ``__metadata__ = {"format": "pt"}``.

Shards are planned from names and byte sizes alone (no tensor values), with the rule of
``huggingface_hub``'s splitter: walk the tensors in state-dict order; a tensor larger than
the limit gets a shard of its own; otherwise it joins the current shard unless that would
pass the limit, which closes the shard. Sizes are decimal (``"5GB"`` = 5·10⁹ bytes), as HF's.

The file format itself (the streaming writer and the ``pread`` reader) is the checkpoint
store's (``zero_core/checkpoint/store.py``): this module only adds HF's names around it.
"""
from __future__ import annotations

import json
import os
import re

from zero_core.checkpoint.store import CheckpointError, SafetensorsReader
from zero_core.errors import ConfigError, ZeroCoreError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
_UNITS = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}


class PretrainedError(ZeroCoreError):
    """A Hugging Face checkpoint directory is missing, damaged or does not fit the model."""


def parse_shard_size(size) -> int:
    """``max_shard_size`` in bytes: an int, or digits and a unit as HF spells them
    (``"500MB"``, ``"5GB"``, ``"1.5GB"``; KB/MB/GB/TB are powers of 10)."""
    if isinstance(size, bool):
        raise ConfigError(f"max_shard_size={size!r}: pass bytes (int) or a string like '5GB'")
    if isinstance(size, int):
        if size <= 0:
            raise ConfigError(f"max_shard_size={size}: must be a positive number of bytes")
        return size
    if isinstance(size, str):
        text = size.strip()
        unit = text[-2:].upper()
        if unit in _UNITS:
            try:
                value = float(text[:-2].strip())
            except ValueError:
                value = -1.0
            if value > 0:
                return int(value * _UNITS[unit])
    raise ConfigError(f"max_shard_size={size!r}: pass bytes (int) or digits followed by "
                      f"KB, MB, GB or TB, e.g. '500MB' or '5GB'")


def plan_shards(sizes: list[tuple[str, int]], limit: int) -> list[tuple[str, list[str]]]:
    """``[(file name, [tensor names])]`` for tensors *sizes* = ``[(name, bytes)]`` in order
    (see the module docstring for the rule)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, nbytes in sizes:
        if nbytes > limit:
            shards.append([name])   # alone, and the current shard stays open
            continue
        if current and current_bytes + nbytes > limit:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return [(SINGLE, shards[0])]
    n = len(shards)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", names) for i, names in enumerate(shards)]


def index_json(plan, total_size: int, total_parameters: int) -> bytes:
    """The bytes of ``model.safetensors.index.json`` for a sharded *plan* (HF's formatting:
    sorted keys, two-space indent, trailing newline)."""
    index = {"metadata": {"total_parameters": total_parameters, "total_size": total_size},
             "weight_map": {name: file for file, names in plan for name in names}}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def stale_files(directory: str, written: set[str]) -> list[str]:
    """Weight files in *directory* that a save writing *written* leaves behind and HF's
    loader could pick up instead of them: other ``model-XXXXX-of-YYYYY`` shards, and the
    single file or the index of the other layout."""
    out = []
    for name in os.listdir(directory):
        if name in written:
            continue
        if SHARD_RE.fullmatch(name) or name in (SINGLE, INDEX):
            out.append(os.path.join(directory, name))
    return out


# ---- reading a local checkpoint -------------------------------------------------------------
class CheckpointFiles:
    """The tensors of a local HF checkpoint directory: ``where[name]`` is the file holding
    tensor *name*; readers open lazily (``pread``: nothing is mapped or read whole).
    Close it (or use ``with``)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._readers: dict[str, SafetensorsReader] = {}
        single = os.path.join(directory, SINGLE)
        index = os.path.join(directory, INDEX)
        if not os.path.isdir(directory):
            raise PretrainedError(f"{directory} is not a directory: pass a local directory "
                                  f"holding {SINGLE} or {INDEX} (downloading from the Hub is "
                                  f"not done here; fetch the model first, e.g. with "
                                  f"`hf download <repo> --local-dir DIR`)")
        if os.path.exists(single):
            self.where = {name: SINGLE for name in self.reader(SINGLE).tensors}
        elif os.path.exists(index):
            self.where = self._read_index(index)
        else:
            found = sorted(f for f in os.listdir(directory) if f.endswith((".bin", ".safetensors")))
            raise PretrainedError(
                f"{directory} has neither {SINGLE} nor {INDEX}"
                + (f" (it has {found}: only safetensors checkpoints load here; convert .bin "
                   f"files with transformers' save_pretrained first)" if found else "")
                + ": pass the directory a Hugging Face save_pretrained wrote")

    def _read_index(self, path: str) -> dict[str, str]:
        try:
            with open(path) as fh:
                index = json.load(fh)
            weight_map = index["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PretrainedError(f"{path} is not a valid index ({type(exc).__name__}: {exc}): "
                                  f"it needs a 'weight_map' of tensor name -> file") from None
        if not isinstance(weight_map, dict):
            raise PretrainedError(f"{path}: 'weight_map' is not an object of tensor name -> file")
        for name, file in weight_map.items():
            if (not isinstance(file, str) or not file or "/" in file or os.sep in file
                    or file.startswith(".")):
                raise PretrainedError(f"{path}: tensor {name!r} maps to {file!r}, which is not "
                                      f"a plain file name in the checkpoint directory")
        for file in sorted(set(weight_map.values())):
            if not os.path.exists(os.path.join(self.directory, file)):
                raise PretrainedError(f"{path} maps tensors to {file}, which is missing from "
                                      f"{self.directory}: the download or copy is incomplete")
            missing = [n for n, f in weight_map.items() if f == file
                       and n not in self.reader(file).tensors]
            if missing:
                raise PretrainedError(f"{path} says {file} holds {missing[:3]}"
                                      f"{' …' if len(missing) > 3 else ''}, but that file does "
                                      f"not contain them: the index and the shards disagree")
        return dict(weight_map)

    def reader(self, file: str) -> SafetensorsReader:
        if file not in self._readers:
            path = os.path.join(self.directory, file)
            try:
                self._readers[file] = SafetensorsReader(path)
            except CheckpointError as exc:
                raise PretrainedError(str(exc)) from None
        return self._readers[file]

    def spec(self, name: str):
        """``(dtype, shape)`` of tensor *name* as stored."""
        return self.reader(self.where[name]).spec(name)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
