"""Hugging Face pretrained weights in and out of the engine: :func:`save_pretrained` writes
HF's safetensors layout from an engine (any stage) gathering one fetch unit at a time, and
:func:`from_pretrained` loads a local safetensors checkpoint straight into stage-3
partitions (pretrained_load.py does the reading; this module owns the public API and the saving).

save_pretrained
---------------
Collective. Writes what ``PreTrainedModel.save_pretrained`` of transformers 5 writes:
``config.json`` (with ``dtype`` and ``architectures`` set as HF sets them, on a copy of
the model's config), ``generation_config.json`` when the model can generate, and the
weights as ``model.safetensors`` or shards plus ``model.safetensors.index.json``
(hf_safetensors.py). The tensor names are the model's state-dict keys after HF's own
rules: ``_keys_to_ignore_on_save`` dropped and tied weights written once, keeping the name
HF keeps (``transformers.modeling_utils.remove_tied_weights_from_state_dict`` is applied to
shape-only stand-ins, so the choice is HF's, e.g. GPT-2's ``lm_head.weight`` is dropped).

Values are written in the dtype the engine computes in (bf16/fp16 under mixed precision,
fp32 in fp32 training, where these *are* the master weights): what a model trained in
bf16 runs with, and what HF's Trainer saves from DeepSpeed ZeRO-3. The fp32 master of a
mixed-precision run is in the engine's checkpoints (``zero-core convert`` writes it).

Memory: rank 0 streams each file with the checkpoint store's writer — header first from
names, shapes and dtypes, then each tensor's bytes straight from the gathered fetch unit
(one unit gathered at a time, on every rank, since the all-gather is collective), so no
rank ever holds more than one unit plus a dtype-converted copy of one tensor. Files are
written under a temporary directory in *save_directory*, moved into place with
``os.replace`` once all are written, and stale weight files of an earlier save (other
shards, the other layout's single file or index) are removed; a barrier ends it.
"""
from __future__ import annotations

import copy
import logging
import math
import os
import shutil

import torch

from zero_core.checkpoint.collective_save import failure_cause
from zero_core.checkpoint.store import TensorEntry, all_ranks_ok, write_safetensors
from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.interfaces.communicator import all_gather_bytes
from zero_core.integrations.transformers import hf_safetensors as hfs
from zero_core.stage3 import partitioned_params as pp

log = logging.getLogger("zero_core.integrations.transformers")

_TMP = ".zero_core_save.tmp"


# ---- which tensors, under which names ------------------------------------------------------
def _unwrap(engine):
    """``(model, comm or None, rank, gatherer or None)`` for an engine or a bare model."""
    module = getattr(engine, "module", None)
    if isinstance(module, torch.nn.Module) and hasattr(engine, "comm"):
        return module, engine.comm, engine.comm.rank, getattr(engine.parts, "gatherer", None)
    # a bare model: plain, built under Init, or an engine's module (partitioned parameters)
    if isinstance(engine, torch.nn.Module):
        if any(pp.is_partitioned(p) for p in engine.parameters()):
            from zero_core.runtime.context import get_runtime
            comm = get_runtime().comm
            return engine, comm, comm.rank, None
        return engine, None, 0, None
    raise ConfigError(f"save_pretrained(engine=...): got {type(engine).__name__}; pass the "
                      f"engine zero_core.initialize returned (or a transformers model)")


def save_names(model) -> list[tuple[str, torch.Tensor]]:
    """``[(name in the file, parameter or buffer)]`` in state-dict order, after HF's
    ignore and tied-weight rules (see the module docstring)."""
    entries = list(model.state_dict(keep_vars=True).items())
    ignore = getattr(model, "_keys_to_ignore_on_save", None) or ()
    entries = [(k, t) for k, t in entries if k not in ignore]
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    # meta stand-ins: HF then groups names by the identity of the model's own tensor
    stand_ins = {k: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for k, t in entries}
    by_stand_in = {id(v): k for k, v in stand_ins.items()}
    try:
        kept = remove_tied_weights_from_state_dict(dict(stand_ins), model)
    except RuntimeError as exc:
        raise ZeroCoreError(f"save_pretrained: {exc}") from None
    kept = _revert_conversions(model, kept)
    tensors = dict(entries)
    return [(name, tensors[by_stand_in[id(v)]]) for name, v in kept.items()]


def _revert_conversions(model, state: dict) -> dict:
    """HF renames some checkpoint keys on load and back on save, and orders the keys of a
    model that ``from_pretrained`` loaded by their natural sort (core_model_loading.py's
    ``revert_weight_conversion``); apply it to the stand-ins. Conversions that compute new
    tensors (fused experts) would need whole tensors and are refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (PrefixChange, WeightConverter,
                                                 revert_weight_conversion)
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    if any(isinstance(c, WeightConverter) for c in conversions):
        raise ZeroCoreError(
            f"save_pretrained: {type(model).__name__} converts weights between its checkpoint "
            f"format and its modules (transformers' conversion mapping, e.g. fused experts), "
            f"which cannot be streamed one tensor at a time; gather the model and use "
            f"transformers' own save_pretrained")
    out = revert_weight_conversion(model, state)
    ids = {id(v) for v in state.values()}
    if len(out) != len(state) or any(id(v) not in ids for v in out.values()):
        raise ZeroCoreError(f"save_pretrained: reverting {type(model).__name__}'s key renames "
                            f"changed the set of tensors; cannot map them back")
    return out


# ---- where the values come from ---------------------------------------------------------------
class _Values:
    """Full values of one parameter or buffer at a time. A stage-3 parameter's fetch unit
    is gathered (collective: every rank fetches the same names in the same order) and
    kept until a parameter of another unit is asked for, so that a unit's parameters cost
    one all-gather; a unit this gathered is released again."""

    def __init__(self, comm, gatherer):
        self.comm, self.gatherer = comm, gatherer
        self._gatherer = gatherer
        self._unit = None
        self._release = False
        self.fetched = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.fetched += 1
        if not pp.is_partitioned(t):
            return t.detach()
        meta = pp.meta_of(t)
        if meta.unit is None:   # built under Init, not adopted by an engine yet
            from zero_core.stage3.init_context import gather_own
            return gather_own(t).narrow(0, 0, meta.numel).view(meta.shape)
        u = meta.unit
        if u is not self._unit:
            self.done()
            # engine.module passed instead of the engine: the unit's coordinator gathers
            self._gatherer = self.gatherer or u.owner.gatherer
            self._unit, self._release = u, u.released
            self._gatherer.wait(u)
        return u.full.narrow(0, meta.offset, meta.numel).view(meta.shape)

    def done(self) -> None:
        if self._unit is not None and self._release and not self._unit.in_use:
            self._gatherer.release(self._unit)
        self._unit = None


def _dtype_of(t: torch.Tensor) -> torch.dtype:
    return pp.meta_of(t).dtype if pp.is_partitioned(t) else t.dtype


# ---- save_pretrained ----------------------------------------------------------------------------
def save_pretrained(engine, save_directory, *, max_shard_size="5GB",
                    safe_serialization: bool = True) -> list[str]:
    """Write *engine*'s model in Hugging Face's layout to *save_directory* (collective:
    every rank calls it; rank 0 writes). Returns the paths written (on every rank).
    See the module docstring."""
    if not safe_serialization:
        raise ConfigError("save_pretrained(safe_serialization=False): only safetensors is "
                          "written (transformers 5 writes only safetensors too); drop the argument")
    limit = hfs.parse_shard_size(max_shard_size)
    model, comm, rank, gatherer = _unwrap(engine)
    if not hasattr(getattr(model, "config", None), "save_pretrained"):
        raise ConfigError(f"save_pretrained: {type(model).__name__} has no transformers config "
                          f"(model.config); it writes Hugging Face models only (other models: "
                          f"engine.save_checkpoint, or save_16bit_model)")
    save_directory = os.fspath(save_directory)
    names = save_names(model)
    tensors = dict(names)
    entries = {}
    sizes = []
    for name, t in names:
        dtype = _dtype_of(t)
        nbytes = math.prod(t.shape) * torch.empty((), dtype=dtype).element_size()
        sizes.append((name, nbytes))
        entries[name] = (dtype, tuple(t.shape))
    plan = hfs.plan_shards(sizes, limit)
    order = [name for _, file_names in plan for name in file_names]
    values = _Values(comm, gatherer)
    tmp = os.path.join(save_directory, _TMP)
    error = ""
    written: list[str] = []
    if rank == 0:
        try:
            written = _write_all(model, save_directory, tmp, plan, entries, tensors, values,
                                 sum(n for _, n in sizes))
        except Exception as exc:  # any failure must reach the gathers and the agreement below
            cause, detail, fix = failure_cause(exc)
            error = f"{cause}{(' — ' + detail) if detail else ''}; {fix}"
            shutil.rmtree(tmp, ignore_errors=True)
    # the other ranks take part in the same gathers, in the same order (rank 0 finishes
    # the remaining ones if its writing failed midway, so nobody waits forever)
    collective = gatherer is not None or _any_partitioned(names)
    if comm is not None and comm.world_size > 1 and collective:
        for name in order[values.fetched:]:
            values(tensors[name])
    values.done()
    if not all_ranks_ok(comm, not error):
        if comm is not None and comm.world_size > 1:  # the same words on every rank
            error = all_gather_bytes(comm, error.encode())[0].decode()
        raise ZeroCoreError(f"save_pretrained to {save_directory} failed on rank 0: "
                            f"{error}. Files are moved into place "
                            f"only once all are written, so an earlier save there is intact "
                            f"unless the failure came while moving them; fix the cause (disk "
                            f"space, permissions) and save again")
    finals = [os.path.join(save_directory, f) for f in _file_names(model, plan)]
    if comm is not None and comm.world_size > 1:
        comm.barrier()
    return written if rank == 0 else finals


def _any_partitioned(names) -> bool:
    return any(pp.is_partitioned(t) for _, t in names)


def _file_names(model, plan) -> list[str]:
    out = ["config.json"]
    if _generation_config(model) is not None:
        out.append("generation_config.json")
    out += [file for file, _ in plan]
    if len(plan) > 1:
        out.append(hfs.INDEX)
    return out


def _generation_config(model):
    can = getattr(model, "can_generate", None)
    if callable(can) and can():
        return getattr(model, "generation_config", None)
    return None


def _write_all(model, save_directory, tmp, plan, entries, tensors, values, total_size) -> list[str]:
    os.makedirs(save_directory, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config = copy.deepcopy(model.config)
    floating = [_dtype_of(p) for p in model.parameters() if _dtype_of(p).is_floating_point]
    if floating:
        config.dtype = str(floating[0]).split(".")[1]   # as HF records the model's dtype
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp)
    gen = _generation_config(model)
    if gen is not None:
        gen.save_pretrained(tmp)
    for file, file_names in plan:
        batch = [TensorEntry(name, entries[name][0], entries[name][1],
                             lambda name=name: [values(tensors[name])]) for name in file_names]
        write_safetensors(os.path.join(tmp, file), batch, {"format": "pt"})
    if len(plan) > 1:
        with open(os.path.join(tmp, hfs.INDEX), "wb") as fh:
            fh.write(hfs.index_json(plan, total_size, _num_parameters(model)))
            fh.flush()
            os.fsync(fh.fileno())
    names = _file_names(model, plan)
    # weights first, the index after its shards, the config last
    for name in _move_order(names):
        os.replace(os.path.join(tmp, name), os.path.join(save_directory, name))
    for stale in hfs.stale_files(save_directory, set(names)):
        os.remove(stale)
    shutil.rmtree(tmp, ignore_errors=True)
    return [os.path.join(save_directory, n) for n in names]


def _move_order(names: list[str]) -> list[str]:
    weights = [n for n in names if n.endswith(".safetensors")]
    return weights + [n for n in names if n == hfs.INDEX] + [
        n for n in names if n not in weights and n != hfs.INDEX]


def _num_parameters(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def from_pretrained(cls_or_name_or_path, config=None, **model_kwargs):
    """Build a transformers model for zero-core and load a local safetensors checkpoint
    into it (stage 3: straight into each rank's partitions). See pretrained_load.py."""
    from zero_core.integrations.transformers.pretrained_load import from_pretrained as load
    return load(cls_or_name_or_path, config=config, **model_kwargs)
