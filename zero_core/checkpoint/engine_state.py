"""An engine's state as checkpoint *fragments*: what each rank saves and which saved ranges it reads.

Format: independent of the partition layout
-------------------------------------------
Every rank saves, for each parameter it is responsible for, *fragments*: the element range
``[start, end)`` of the flattened parameter, with the values of that range for each kind
of state (its fp32 master weights and each optimizer-state tensor). Across ranks, every
element of every parameter is saved exactly once. ``metadata.json`` indexes which shard
holds which fragment (``ranks[r]["fragments"]``: ``[name, start, end, {key: [tensor,
offset]}]``: the key's values are elements ``[offset, offset + end - start)`` of the named
flat tensor in ``rank_<r>.safetensors``). Loading asks the engine which ranges it owns
*now* and reads only the saved fragments that overlap them, so a checkpoint saved with N
ranks at stage S loads on M ranks at stage S' with no conversion step.

Keys of a fragment: ``"master"`` — fp32 values of a parameter the optimizer trains (in
fp32 training, the parameter itself); the optimizer's state names (``"exp_avg"``,
``"exp_avg_sq"`` for Adam/AdamW, ``"momentum_buffer"`` for SGD with momentum);
``"param"`` — values of a parameter that is not trained, in its own dtype. A parameter
trained in one run and frozen in the other is loaded from whichever of master/param exists.

The shard's other contents (RNG states, buffers, ``common.pt``) and the save and load
procedures are in save_load.py.

What a stage provides
--------------------
The engine hands the checkpoint procedures a
:class:`~zero_core.interfaces.engine_parts.CheckpointSubject` whose ``fragments(purpose)``
are the stage's (``StageParts.checkpoint_fragments``, engine/contract.py): a list of
:class:`Fragment` whose ``tensors`` are *views* (1-D, ``end - start`` elements) into the
live state:

* ``purpose="save"``: the fragments this rank writes. Over all ranks they must cover every
  element of every parameter of the module exactly once (each parameter under its first
  name in ``module.named_parameters()``); trained parameters with ``"master"`` and every
  optimizer-state key, others with ``"param"``.
* ``purpose="load"``: the fragments this rank must fill to hold its share after loading
  (whatever its stage keeps on this rank; may overlap other ranks'). The loader copies the
  checkpoint's values into these views (converting dtypes).

``restored()`` — collective, called on every rank after the views were filled: rebuild
whatever is derived from them (low-precision parameters from the fp32 master, replicated
copies by all-gather, gathered/persistent stage-3 units, ...). ``layout()`` — a JSON-able
description of the partition layout, stored in the metadata for people and tools.

:func:`layout_fragments` builds fragments from a
:class:`~zero_core.partitioning.layout.GroupLayout` and flat buffers, which is all stages
0–3 need. The stages' implementations call :func:`bucket_fragments` /
:func:`restore_bucket_params` (stages 0–2: rank r saves slice r of every bucket, also at
stage 0; frozen parameters from rank 0) and :func:`unit_fragments` /
:func:`restore_unit_params` (stage 3: each rank's partition of every fetch unit). Optimizers
re-created from other torch.optim classes (rule kind "torch") are refused for now
(:func:`refuse_unsupported_optimizer`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zero_core.checkpoint.store import CheckpointError

MASTER, PARAM = "master", "param"
WEIGHT_KEYS = (MASTER, PARAM)


@dataclass
class Fragment:
    """Elements ``[start, end)`` of flattened parameter *name* (full shape *shape*) and a
    1-D view of ``end - start`` elements per state key (see the module docstring)."""

    name: str
    shape: tuple
    start: int
    end: int
    tensors: dict = field(default_factory=dict)


# ---- fragments from flat buffers (stages 0-3) -------------------------------------------------
def layout_fragments(layout, params, names: dict, sources: dict, rank: int, ranks) -> list[Fragment]:
    """Fragments of the parameters of one flat-buffer group.

    *layout*: the group's GroupLayout; *params*: its parameters in layout order; *names*:
    ``id(param) -> qualified name``; *sources*: ``key -> FlatBuffer`` (``"full"`` buffers,
    or ``"partition"`` buffers of this *rank*); *ranks*: whose slices of every bucket to
    describe (``[rank]`` for this rank's partition; all ranks for a full buffer).
    """
    by_bucket: dict[int, list] = {}
    for seg in layout.segments:
        by_bucket.setdefault(seg.bucket, []).append(seg)
    out = []
    for k in range(layout.num_buckets):
        for r in ranks:
            lo = layout.shard_start(k, r)
            hi = lo + layout.shard_size(k)
            for seg in by_bucket.get(k, ()):
                s_lo = layout.bucket_starts[k] + seg.bucket_lo
                a, b = max(lo, s_lo), min(hi, s_lo + seg.numel)
                if a >= b:
                    continue
                views = {}
                for key, fb in sources.items():
                    if fb.kind == "full":
                        views[key] = fb.data.narrow(0, a, b - a)
                    elif r != rank:
                        raise ValueError("a partition buffer only holds its own rank's slices")
                    else:
                        views[key] = fb.data.narrow(0, layout.partition_start(k) + a - lo, b - a)
                p = params[seg.param]
                start = seg.param_lo + (a - s_lo)
                out.append(Fragment(names[id(p)], tuple(p.shape), start, start + b - a, views))
    return out


def parameter_names(module: torch.nn.Module) -> dict:
    """``id(parameter) -> qualified name`` (the first name of a tied parameter)."""
    return {id(p): n for n, p in module.named_parameters()}


def bucket_fragments(purpose: str, module, buffers: list, flat_state: list, stage: int,
                     rank: int, world_size: int) -> list[Fragment]:
    """The fragments of stages 0-2 (stage0to2/parts.py): flat buffers per group.

    Saving: rank r writes slice r of every bucket (at stage 0 too, so the work is spread);
    loading: stage 0 fills whole buffers, stages 1-2 this rank's partition (fp32 training:
    its slice of the parameter buffer; :func:`restore_bucket_params` all-gathers the rest).
    Parameters outside the flat buffers (frozen) are replicated: written by rank 0.
    """
    names = parameter_names(module)
    everything = purpose == "load" and stage == 0
    out, trained = [], set()
    for j, gb in enumerate(buffers):
        if gb is None:
            continue
        trained.update(id(p) for p in gb.params)
        sources = {MASTER: gb.master if gb.master is not None else gb.param_buf}
        sources.update(flat_state[j])
        out += layout_fragments(gb.layout, gb.params, names, sources, rank,
                                range(world_size) if everything else [rank])
    if purpose == "load" or rank == 0:
        out += replicated_fragments(module, trained, names)
    return out


def replicated_fragments(module, exclude: set, names: dict) -> list[Fragment]:
    """Whole-parameter ``"param"`` fragments of the parameters not in *exclude* (ids)."""
    out = []
    for p in module.parameters():
        if id(p) in exclude:
            continue
        if not p.data.is_contiguous():
            raise CheckpointError(f"parameter {names[id(p)]!r} is not contiguous in memory; "
                                  f"call .contiguous() on it before training")
        out.append(Fragment(names[id(p)], tuple(p.shape), 0, p.numel(),
                            {PARAM: p.data.view(-1)}))
    return out


@torch.no_grad()
def restore_bucket_params(buffers: list, stage: int, comm) -> None:
    """After a stage 0-2 load: the low-precision parameters from the fp32 master (stage 0:
    whole buffer; stages 1-2: all-gather of every rank's slice). Collective."""
    for gb in buffers:
        if gb is None:
            continue
        if stage == 0:
            if gb.master is not None:
                gb.param_buf.data.copy_(gb.master.data)
            continue
        for k in range(gb.num_buckets):
            # the master may be in host memory (offload_optimizer): send from the device
            send = gb.master_bucket(k).to(gb.param_buf.data.device, gb.param_buf.dtype,
                                          copy=True)
            comm.all_gather_into(gb.param_buf.bucket(k), send)


def unit_fragments(module, buffers: list, frozen, flat_state: list,
                   rank: int) -> list[Fragment]:
    """The fragments of stage 3 (stage3/parts.py): this rank's partition of every fetch
    unit, for saving and loading alike — trained groups with master and optimizer states,
    the frozen units' partition (*frozen*, or None) with ``"param"``."""
    names = parameter_names(module)
    out = []
    for j, gb in enumerate(buffers):
        if gb is None:
            continue
        sources = {MASTER: gb.master if gb.master is not None else gb.param_buf}
        sources.update(flat_state[j])
        out += layout_fragments(gb.layout, gb.params, names, sources, rank, [rank])
    if frozen is not None:
        out += layout_fragments(frozen.layout, frozen.params, names, {PARAM: frozen.param_buf},
                                rank, [rank])
    return out


@torch.no_grad()
def restore_unit_params(buffers: list) -> None:
    """After a stage-3 load: the low-precision partitions from the fp32 master."""
    for gb in buffers:
        if gb is not None and gb.master is not None:
            gb.param_buf.data.copy_(gb.master.data)


def group_layouts(module, buffers: list, fetch_units: bool = False) -> list:
    """Each group's flat layout (None for a group without buffers), for the metadata."""
    names = parameter_names(module)
    return [None if gb is None else {
        "params": [names[id(p)] for p in gb.params], "numels": list(gb.layout.numels),
        "bucket_sizes": list(gb.layout.bucket_sizes), "alignment": gb.layout.alignment,
        "world_size": gb.layout.world_size, **({"fetch_units": True} if fetch_units else {})}
        for gb in buffers]


def refuse_unsupported_optimizer(rule) -> None:
    """Optimizers re-created from other torch.optim classes keep a state zero-core does not
    checkpoint yet: refused by name before anything is written or read."""
    if rule is not None and rule.kind == "torch":
        raise CheckpointError(
            f"checkpointing the state of a re-created torch.optim.{rule.torch_class.__name__} "
            f"is not supported yet; use an Adam, AdamW or SGD optimizer (config 'optimizer' "
            f"section or torch.optim.Adam/AdamW/SGD), whose state zero-core checkpoints")


def fragment_index(meta: dict) -> dict:
    """``name -> [(file, start, end, {key: [tensor, offset]})]`` from the metadata."""
    index: dict = {}
    for r, entry in enumerate(meta["ranks"]):
        try:
            file = entry["file"]
            for name, start, end, keys in entry["fragments"]:
                index.setdefault(name, []).append((file, int(start), int(end), keys))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"metadata.json: the fragment index of rank {r} is "
                                  f"malformed: the checkpoint is damaged") from None
    for pieces in index.values():
        pieces.sort(key=lambda x: x[1])
    return index


def plan_reads(wanted: list[Fragment], index: dict, keys_wanted, where: str) -> dict:
    """``file -> [(tensor, offset, count, destination view)]`` covering every wanted
    fragment's keys; refuses gaps and missing state keys."""
    plan: dict = {}
    for f in wanted:
        saved = index.get(f.name)
        if not saved:
            raise CheckpointError(f"{where}: no fragment of parameter {f.name!r} is indexed")
        for key, dst in f.tensors.items():
            if not keys_wanted(key):
                continue
            covered = 0
            for file, s, e, keys in saved:
                a, b = max(s, f.start), min(e, f.end)
                if a >= b:
                    continue
                src = _source_key(key, keys)
                if src is None:
                    raise CheckpointError(
                        f"{where}: the checkpoint has no '{key}' state for parameter "
                        f"{f.name!r} (it holds {sorted(keys)}); it was saved with another "
                        f"optimizer. Pass load_optimizer_states=False to load only the weights")
                col, off = src
                plan.setdefault(file, []).append(
                    (col, int(off) + a - s, b - a, dst.narrow(0, a - f.start, b - a)))
                covered += b - a
            if covered != f.end - f.start:
                raise CheckpointError(f"{where}: the saved fragments of {f.name!r} cover "
                                      f"{covered} of the {f.end - f.start} elements "
                                      f"[{f.start}, {f.end}) this rank needs: the index is "
                                      f"damaged")
    return plan


def _source_key(key: str, keys: dict):
    if key in keys:
        return keys[key]
    if key in WEIGHT_KEYS:  # trained in one run, frozen in the other
        other = PARAM if key == MASTER else MASTER
        return keys.get(other)
    return None
