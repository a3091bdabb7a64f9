"""Consolidate a checkpoint into one safetensors state dict (``zero-core convert``).

The output has the model's own ``state_dict()`` keys (tied parameters under each of their
names, persistent buffers included), so plain PyTorch loads it::

    model.load_state_dict(safetensors.torch.load_file(OUT))

Memory stays bounded by about one tensor: the output header is computed from the
checkpoint's metadata alone, then each parameter is assembled from its fragments (read
with ``pread`` from whichever shards hold them), written, and dropped. Every shard is
verified against its recorded SHA-256 before its first read.

``--optimizer-states`` also writes ``<OUT stem>.optim.safetensors``: one full-shape fp32
tensor per parameter and state, named ``<state>/<parameter>`` (``exp_avg/l1.weight``),
with the optimizer kind, per-group hyperparameters, step counts and member parameters as
JSON in the header's ``__metadata__["optimizer"]``.

A DeepSpeed ZeRO checkpoint directory (``zero_pp_rank_*_optim_states.pt`` and
``*_model_states.pt``, stages 0-3) converts to what DeepSpeed's ``zero_to_fp32`` gives,
without DeepSpeed and one DeepSpeed file at a time (:func:`read_deepspeed`; the layout is
read by deepspeed_layout.py).
"""
from __future__ import annotations

import json
import os
import struct

import torch

from zero_core.checkpoint import store
from zero_core.checkpoint.store import CheckpointError, TensorEntry, dtype_from_name
from zero_core.checkpoint.deepspeed_layout import DeepSpeedCheckpoint, deepspeed_tag_dir
from zero_core.checkpoint.engine_state import MASTER, PARAM, fragment_index
from zero_core.progress import ProgressBar

OUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ShardSet:
    """Open, verified shard readers of one checkpoint (each file hashed once)."""

    def __init__(self, tag_dir: str, meta: dict):
        self.tag_dir, self.meta = tag_dir, meta
        self._readers: dict[str, store.SafetensorsReader] = {}

    def get(self, name: str) -> store.SafetensorsReader:
        if name not in self._readers:
            self._readers[name] = store.open_shard(self.tag_dir, name, self.meta)
        return self._readers[name]

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()


def assemble(shards: ShardSet, pieces: list, name: str, numel: int, keys, dtype=torch.float32,
             where: str = "") -> torch.Tensor:
    """Parameter *name*'s flat values of the first of *keys* each fragment holds, from its
    saved fragments *pieces* (``fragment_index`` entries); refuses gaps."""
    out = torch.empty(numel, dtype=dtype)
    covered = 0
    for file, start, end, fkeys in pieces:
        src = next((fkeys[k] for k in keys if k in fkeys), None)
        if src is None:
            raise CheckpointError(f"{where}: fragment [{start}, {end}) of {name!r} in {file} "
                                  f"has none of {list(keys)} (it holds {sorted(fkeys)})")
        col, off = src
        shards.get(file).read_into(col, int(off), out[start:end])
        covered += end - start
    if covered != numel or numel and (pieces[0][1] != 0 or pieces[-1][2] != numel):
        raise CheckpointError(f"{where}: the fragments of {name!r} cover {covered} of its "
                              f"{numel} elements: the index is damaged")
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def optim_path(out: str) -> str:
    """Where ``--optimizer-states`` writes, next to *out*."""
    stem = out[:-len(".safetensors")] if out.endswith(".safetensors") else out
    return stem + ".optim.safetensors"


def convert(checkpoint_dir: str, out: str, tag: str | None = None, dtype: str = "fp32",
            optimizer_states: bool = False, progress: bool = True) -> dict:
    """Write checkpoint *tag* (default: latest) of *checkpoint_dir* as one safetensors state
    dict at *out* (weights in *dtype*: "fp32" or "bf16"). Returns a summary dict (paths,
    tensor count, bytes)."""
    if dtype not in OUT_DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: use one of {sorted(OUT_DTYPES)}")
    if is_deepspeed_checkpoint(checkpoint_dir, tag):
        return read_deepspeed(checkpoint_dir, out, tag, dtype, optimizer_states, progress)
    tag_dir, meta = store.read_metadata(checkpoint_dir, tag)
    where = os.path.join(tag_dir, store.METADATA)
    if "model" not in meta:
        raise CheckpointError(f"{where} describes no model: not an engine checkpoint")
    model = meta["model"]
    index = fragment_index(meta)
    out_dtype = OUT_DTYPES[dtype]
    shards = ShardSet(tag_dir, meta)
    try:
        entries = []
        for key in model["state_dict_keys"]:
            target = model["aliases"].get(key, key)
            if target in model["params"]:
                spec = model["params"][target]
                saved = dtype_from_name(spec["dtype"])
                numel = _numel(spec["shape"])
                to = out_dtype if saved.is_floating_point else saved
                pieces = index.get(target, [])

                def produce(target=target, numel=numel, pieces=pieces, shape=spec["shape"], to=to):
                    flat = assemble(shards, pieces, target, numel, (MASTER, PARAM),
                                    torch.float32 if to.is_floating_point else to, where)
                    return [flat.to(to)]
                entries.append(TensorEntry(key, to, spec["shape"], produce))
            elif key in model["buffers"]:
                spec = model["buffers"][key]
                file = meta.get("buffers_in", store.shard_name(0))
                entries.append(TensorEntry(key, dtype_from_name(spec["dtype"]), spec["shape"],
                                           lambda key=key, file=file: [shards.get(file).read("buffer." + key)]))
            else:
                raise CheckpointError(f"{where}: state_dict key {key!r} is neither a parameter "
                                      f"nor a buffer of the saved model")
        summary = {"out": out, "tag": meta.get("tag"), "tensors": len(entries),
                   "bytes": _write(out, entries, {"format": "pt", "source": "zero-core",
                                                  "tag": str(meta.get("tag"))},
                                   "convert", progress)}
        if optimizer_states:
            summary["optimizer_out"] = optim_path(out)
            summary["optimizer_bytes"] = _write_optimizer(shards, meta, index, where,
                                                          summary["optimizer_out"], progress)
        return summary
    finally:
        shards.close()


def _write(out: str, entries: list, metadata: dict, label: str, progress: bool) -> int:
    bar = ProgressBar(sum(e.nbytes for e in entries), label, enabled=progress, show_count=False)
    done = {"bytes": 0, "tensors": 0}

    def advance(e):
        done["bytes"] += e.nbytes
        done["tensors"] += 1
        bar.update(done["bytes"], {"tensors": done["tensors"],
                                   "MiB": f"{done['bytes'] / 2 ** 20:,.1f}/{bar.total / 2 ** 20:,.1f}"})
    tmp = out + ".tmp"
    try:
        _, size = store.write_safetensors(tmp, entries, metadata,
                                          on_tensor=advance)
        os.replace(tmp, out)
    finally:
        bar.close()
        if os.path.exists(tmp):
            os.remove(tmp)
    return size


def _write_optimizer(shards: ShardSet, meta: dict, index: dict, where: str, out: str,
                     progress: bool) -> int:
    model = meta["model"]
    state_keys = meta.get("optimizer", {}).get("state_keys", [])
    entries = []
    for name, spec in model["params"].items():
        pieces = index.get(name, [])
        if not pieces or MASTER not in pieces[0][3]:
            continue  # not trained: no optimizer state
        numel = _numel(spec["shape"])
        for key in state_keys:
            def produce(name=name, key=key, numel=numel, pieces=pieces, shape=spec["shape"]):
                return [assemble(shards, pieces, name, numel, (key,), torch.float32, where)]
            entries.append(TensorEntry(f"{key}/{name}", torch.float32, spec["shape"], produce))
    common = store.load_plain(shards.tag_dir, meta.get("common", store.COMMON), meta)
    groups = []
    layout = meta.get("layout") or []
    for j, hyper in enumerate(meta.get("optimizer", {}).get("groups", [])):
        counts = common.get("optimizer", {}).get("step_counts", [])
        members = layout[j].get("params") if j < len(layout) and layout[j] else None
        groups.append({"hyperparameters": hyper, "step": counts[j] if j < len(counts) else None,
                       "params": members})
    info = {"kind": meta.get("optimizer", {}).get("kind"), "state_keys": state_keys,
            "param_groups": groups, "global_steps": common.get("global_steps")}
    return _write(out, entries, {"format": "zero-core-optimizer-states", "version": "1",
                                 "optimizer": json.dumps(info)}, "optimizer states", progress)


# ---- DeepSpeed ZeRO checkpoints ------------------------------------------------------------
def is_deepspeed_checkpoint(path: str, tag: str | None) -> bool:
    """Whether *path* (with *tag* or its ``latest``) holds DeepSpeed ZeRO files rather than
    a zero-core checkpoint."""
    return deepspeed_tag_dir(path, tag) is not None


def read_deepspeed(path, out, tag, dtype, optimizer_states, progress) -> dict:
    """Write DeepSpeed checkpoint *tag* of *path* as one safetensors state dict at *out*:
    what DeepSpeed's ``zero_to_fp32`` gives (fp32 master weights of the trained parameters,
    frozen parameters, buffers, shared parameters under each name), in the model's
    state-dict order, floating tensors in *dtype*.

    Streams one DeepSpeed file at a time: the output's header is computed from the
    model-states file, the data region allocated, then each rank file is read (restricted
    unpickler, memory-mapped) and its pieces written at their places (``os.pwrite``).
    Stage 0 files name no parameter of the optimizer's flat groups, so a stage-0
    checkpoint converts to the module's weights as saved (bf16 training: the bf16 values).
    """
    ck = DeepSpeedCheckpoint(path, tag)
    if optimizer_states:
        raise CheckpointError(f"{ck.where}: --optimizer-states is not supported for DeepSpeed "
                              f"checkpoints; convert the weights, or load the checkpoint into "
                              f"a zero-core engine and save_checkpoint() to keep the states")
    out_dtype = OUT_DTYPES[dtype]
    index = ck.fragment_index(states=())
    shapes = ck.param_shapes()
    module = ck.model["module"]
    keys = list(module) + [n for n in shapes if n not in module]
    entries, offset = [], 0  # (key, dtype, shape, byte offset, source)
    for key in keys:
        target = ck.shared.get(key, key)
        if key in ck.buffer_names:
            t = module[key]
            kind, shape, src_dtype = "buffer", tuple(t.shape), t.dtype
        elif target in index:
            kind, shape, src_dtype = "param", shapes[target], torch.float32
        else:
            raise CheckpointError(f"{ck.where}: state-dict key {key!r} is neither a buffer nor "
                                  f"a parameter the checkpoint holds")
        to = out_dtype if src_dtype.is_floating_point else src_dtype
        nbytes = _numel(shape) * torch.empty((), dtype=to).element_size()
        entries.append((key, to, shape, offset, kind, target))
        offset += nbytes
    header = {"__metadata__": {"format": "pt", "source": "deepspeed",
                               "deepspeed_version": str(ck.model.get("ds_version")),
                               "tag": os.path.basename(ck.tag_dir)}}
    for key, to, shape, off, _, _ in entries:
        n = _numel(shape) * torch.empty((), dtype=to).element_size()
        header[key] = {"dtype": store.DTYPE_CODES[to], "shape": list(shape),
                       "data_offsets": [off, off + n]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)
    by_target: dict = {}
    for e in entries:
        by_target.setdefault(e[5], []).append(e)
    files = sorted({p[0] for pieces in index.values() for p in pieces} | {ck.model_file})
    bar = ProgressBar(len(files), "convert", enabled=progress)
    tmp = out + ".tmp"
    covered: dict = {}
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
            os.ftruncate(fd, base + offset)
            values = data = None
            for i, file in enumerate(files):
                obj = ck.open(file)
                for name, pieces in index.items():
                    for f, start, end, fkeys in pieces:
                        if f != file:
                            continue
                        col, off = next(fkeys[k] for k in (MASTER, PARAM) if k in fkeys)
                        values = ck.column(obj, col).narrow(0, int(off), end - start)
                        for key, to, shape, eoff, _, _ in by_target.get(name, ()):
                            data = values.to(to).contiguous()
                            os.pwrite(fd, _bytes(data), base + eoff + start * data.element_size())
                        covered[name] = covered.get(name, 0) + end - start
                if file == ck.model_file:
                    for key, to, shape, eoff, kind, _ in entries:
                        if kind == "buffer":
                            os.pwrite(fd, _bytes(module[key].to(to).contiguous()), base + eoff)
                obj = values = data = None  # this file's tensors go before the next is read
                bar.update(i + 1)
            os.fsync(fd)
        finally:
            os.close(fd)
        for name in index:
            if covered.get(name, 0) != _numel(shapes[name]):
                raise CheckpointError(f"{ck.where}: the pieces of {name!r} cover "
                                      f"{covered.get(name, 0)} of its {_numel(shapes[name])} "
                                      f"elements: the files do not match")
        os.replace(tmp, out)
    finally:
        bar.close()
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"out": out, "tag": os.path.basename(ck.tag_dir), "tensors": len(entries),
            "bytes": base + offset, "source": "deepspeed", "stage": ck.stage,
            "world_size": ck.world_size}


def _bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()
