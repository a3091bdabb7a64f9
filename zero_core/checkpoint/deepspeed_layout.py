"""DeepSpeed checkpoint directories: what they hold and where each parameter's values lie.

A DeepSpeed checkpoint is indexed here in the form of zero-core's own fragment index
(engine_state.py: ``name -> [(file, start, end, {key: [column, offset]})]``), so that
loading into an engine reuses :func:`~zero_core.checkpoint.engine_state.plan_reads` — any
world size, any stage — and conversion reuses the same pieces. A *column* names a flat
tensor inside one DeepSpeed file (:meth:`DeepSpeedCheckpoint.column`); files are read with
the restricted unpickler of deepspeed_pickle.py, one at a time.

Layout (facts from DeepSpeed's runtime/engine.py, zero/stage_1_and_2.py, zero/stage3.py,
fp16/fused_optimizer.py, utils/zero_to_fp32.py; data parallelism only, ``mp_rank_00``):

* ``<dir>/latest`` names the tag; ``<dir>/<tag>/`` holds the files.
* ``mp_rank_00_model_states.pt`` (stages 0-2), or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  per rank (stage 3): ``module`` (the state dict; empty placeholders at stage 3),
  ``buffer_names``, ``param_shapes`` (stages 1-3: per flat group, name -> shape, in flat
  order), ``frozen_param_shapes`` / ``frozen_param_fragments`` (stages 2-3; at stage 3 each
  rank's file holds its partition of each frozen parameter), ``shared_params`` (alias ->
  name), ``lr_scheduler``, ``global_steps``, ``skipped_steps``, ``global_samples``,
  ``dp_world_size``, ``ds_config``, ``ds_version``; the client state's keys at the top
  level; at stage 0 also ``optimizer`` (the wrapped optimizer's state dict).
* ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank (stages
  1-3): ``optimizer_state_dict`` with ``zero_stage``, ``partition_count``, ``loss_scaler``
  and:

  - stages 1-2: ``single_partition_of_fp32_groups[g]`` — rank r's slice of flat group g
    with the padding at the end trimmed (``group_paddings``); the flat group is the group's
    parameters in ``param_shapes[g]`` order, each followed by
    ``param_alignment_paddings[g][i]`` elements, padded to a multiple of 2 x world size and
    cut into equal partitions. ``base_optimizer_state``: the inner optimizer's state dict
    (one flat parameter per group; tensors untrimmed) or, for elastic checkpoints, a list
    per group of trimmed states plus ``base_optimizer_state_step``.
  - stage 3: ``fp32_flat_groups[s]`` per sub-group — rank r's partition of every parameter
    of the sub-group, concatenated: a parameter of n elements is cut into pieces of
    ceil(n / world) (the last one zero-padded), one per rank; ``optimizer_state_dict``: the
    inner optimizer's state, one flat tensor per sub-group.
* Stage 0 keeps everything in ``mp_rank_00_model_states.pt``: fp32 training has the
  parameters in ``module`` and a torch-style optimizer state dict (state indexed by the
  position of the parameter in the param groups); bf16/fp16 wrap it (``fp32_groups_flat``
  per group: the group's trainable parameters flattened, and ``optimizer_state_dict``).
  Stage-0 files name no parameter of the optimizer, so its states and bf16 master weights
  are matched by the engine's param groups (the same groups DeepSpeed was given).

Refused with the reason (:func:`refuse_unsupported`): tensor/model parallelism
(``mp_rank_01`` or higher), pipeline parallelism (``layer_*-model_states.pt``, pp degree >
1), mixture of experts (``expp_rank_*`` / ``*_expert_*`` files), universal checkpoints
(``zero/`` folder or ``universal_checkpoint_info``), and NVMe-offloaded optimizer states.
"""
from __future__ import annotations

import math
import os
import re

import torch

from zero_core.checkpoint.deepspeed_pickle import (StaticLossScalerState, ZeroStage,
                                                   load_deepspeed_file, to_plain)
from zero_core.checkpoint.engine_state import MASTER, PARAM
from zero_core.checkpoint.store import CheckpointError

OPTIM_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
#: keys DeepSpeed writes into the model-states file; the others are the user's client_state
DEEPSPEED_KEYS = frozenset([
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "sparse_tensor_module_names",
    "universal_checkpoint_info"])


def _has_deepspeed_files(d: str) -> bool:
    try:
        names = os.listdir(d)
    except OSError:
        return False
    return (any(n.endswith("_optim_states.pt") or n.endswith("_model_states.pt") for n in names)
            and "metadata.json" not in names)


def deepspeed_tag_dir(path: str, tag=None) -> str | None:
    """The directory of DeepSpeed checkpoint *tag* (default: what ``latest`` names; *path*
    itself if it holds the files), or None when *path* is not a DeepSpeed checkpoint."""
    candidates = []
    if tag is not None:
        candidates.append(os.path.join(path, str(tag)))
    else:
        latest = os.path.join(path, "latest")
        if os.path.isfile(latest):
            with open(latest) as fh:
                name = fh.read().strip()
            if name and "/" not in name and not name.startswith("."):
                candidates.append(os.path.join(path, name))
        candidates.append(path)
    for d in candidates:
        if os.path.isdir(d) and _has_deepspeed_files(d):
            return d
    return None


def refuse_unsupported(tag_dir: str, names: list) -> None:
    """Refuse the DeepSpeed layouts zero-core cannot read, saying why."""
    what = f"DeepSpeed checkpoint {tag_dir}"
    mp = sorted({int(m.group(3)) for n in names for m in [OPTIM_RE.match(n)] if m}
                | {int(m.group(2)) for n in names for m in [MODEL_RE.match(n)] if m})
    if any(r != 0 for r in mp):
        raise CheckpointError(
            f"{what} was saved with tensor (model) parallelism (files of mp ranks {mp}): not "
            f"supported — zero-core trains data-parallel only and cannot merge the tensor-"
            f"parallel slices of a layer. Merge them into one model with the framework that "
            f"made them (e.g. Megatron's checkpoint tools) and load that")
    if any(n.startswith("layer_") and n.endswith("-model_states.pt") for n in names):
        raise CheckpointError(
            f"{what} was saved by DeepSpeed's pipeline engine (layer_*-model_states.pt): not "
            f"supported — pipeline-parallel checkpoints store the model by pipeline layer, "
            f"not as one module. Convert it to a module state dict with DeepSpeed first")
    if any(n.startswith("expp_rank_") or "_expert_" in n for n in names):
        raise CheckpointError(
            f"{what} holds mixture-of-experts files (expp_rank_* / *_expert_*): not "
            f"supported — zero-core has no expert parallelism, so expert parameters "
            f"partitioned over expert groups cannot be placed")
    if os.path.isdir(os.path.join(tag_dir, "zero")):
        raise CheckpointError(
            f"{what} is a DeepSpeed universal checkpoint (its zero/ folder holds one file per "
            f"parameter): not supported — load the ZeRO checkpoint it was converted from")
    if os.path.isdir(os.path.join(tag_dir, "offloaded_tensors")):
        raise CheckpointError(
            f"{what} keeps its optimizer states in NVMe swap files (offloaded_tensors/): not "
            f"supported — zero-core reads only the states stored in the checkpoint files")


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def _step_of(value) -> int:
    return int(float(value)) if torch.is_tensor(value) else int(value)


class DeepSpeedCheckpoint:
    """One DeepSpeed ZeRO checkpoint (tag directory). The constructor reads the first
    model-states file (kept, memory-mapped: at stages 0-2 it holds the module's weights,
    whose pages are touched only where they are used — stage 0, frozen parameters,
    buffers) and the first optimizer-states file (for its sizes, steps and
    hyperparameters; handed out once by :meth:`open`); the rest is read per file,
    memory-mapped, by :meth:`open`."""

    def __init__(self, path: str, tag=None):
        tag_dir = deepspeed_tag_dir(path, tag)
        if tag_dir is None:
            raise CheckpointError(f"{path} (tag {tag!r}) holds no DeepSpeed checkpoint files "
                                  f"(*_model_states.pt / *_optim_states.pt)")
        self.tag_dir = tag_dir
        self.where = f"DeepSpeed ZeRO checkpoint {tag_dir}"
        names = sorted(os.listdir(tag_dir))
        refuse_unsupported(tag_dir, names)
        optim = {}
        for n in names:
            m = OPTIM_RE.match(n)
            if m:
                optim[int(m.group(2))] = n
        models = {int(m.group(1)): n for n in names for m in [MODEL_RE.match(n)]
                  if m and m.group(1) is not None}
        self.world_size = len(optim)
        if sorted(optim) != list(range(self.world_size)):
            raise CheckpointError(f"{self.where}: optimizer files of ranks {sorted(optim)} — "
                                  f"some are missing: the save did not finish on every rank")
        self.optim_files = [optim[r] for r in range(self.world_size)]
        first_model = models.get(0) or ("mp_rank_00_model_states.pt"
                                        if "mp_rank_00_model_states.pt" in names else None)
        if first_model is None:
            raise CheckpointError(f"{self.where} has no mp_rank_00_model_states.pt (nor "
                                  f"zero_pp_rank_0_mp_rank_00_model_states.pt): incomplete")
        self.model_file = first_model
        self.model = self.read(first_model)
        if not isinstance(self.model, dict) or "module" not in self.model:
            raise CheckpointError(f"{self.where}: {first_model} has no 'module': not a "
                                  f"DeepSpeed model-states file")
        dims = self.model.get("checkpoint_parallel_dimensions") or {}
        if int(dims.get("pp_degree", 1) or 1) > 1 or int(dims.get("tp_degree", 1) or 1) > 1 \
                or int(self.model.get("mp_world_size", 1) or 1) > 1:
            raise CheckpointError(f"{self.where} was saved with pipeline/tensor parallelism "
                                  f"({dims}): not supported — zero-core reads data-parallel "
                                  f"checkpoints only")
        if "num_experts" in self.model:
            raise CheckpointError(f"{self.where} was saved from a mixture-of-experts model "
                                  f"(num_experts): not supported — zero-core has no expert "
                                  f"parallelism")
        if self.model.get("universal_checkpoint_info"):
            raise CheckpointError(f"{self.where} carries universal-checkpoint (AutoTP) "
                                  f"information: not supported — its parameters are "
                                  f"tensor-parallel slices")
        if not optim and self.model.get("param_shapes") is not None:
            raise CheckpointError(f"{self.where} has no *_optim_states.pt files, but its "
                                  f"model-states file was written by ZeRO stage 1-3, whose "
                                  f"weights live in those files: the checkpoint is incomplete")
        self._kept: dict = {}  # a file read for its metadata, handed out once by open()
        osd0 = None
        if self.world_size:
            first = self.read(self.optim_files[0])
            self._kept[self.optim_files[0]] = first
            osd0 = self._optim_dict(first, self.optim_files[0])
            stage = osd0.get("zero_stage")
            if stage is None:
                raise CheckpointError(
                    f"{self.where}: {self.optim_files[0]} has no zero_stage: written by "
                    f"DeepSpeed's BF16_Optimizer (bf16 with fp32 gradient accumulation), "
                    f"whose layout zero-core does not read yet; not supported")
            self.stage = int(stage)
            counts = osd0.get("partition_count")
            counts = counts if isinstance(counts, list) else [counts]
            if len({int(c) for c in counts}) > 1:
                raise CheckpointError(f"{self.where}: param groups partitioned over "
                                      f"{counts} ranks (expert-parallel groups): not supported")
            if int(counts[0]) != self.world_size:
                expected = [OPTIM_RE.sub(lambda m: f"{m.group(1) or ''}zero_pp_rank_{r}_mp_rank_"
                                         f"{m.group(3)}_optim_states.pt", self.optim_files[0])
                            for r in range(int(counts[0]))]
                missing = [n for n in expected if n not in names]
                raise CheckpointError(
                    f"{self.where} was saved by {counts[0]} ranks but holds "
                    f"{self.world_size} optimizer-states files"
                    + (f" (missing: {', '.join(missing[:4])})" if missing else "")
                    + ": the save did not finish on every rank, or files of another save are "
                      "mixed in; use a complete checkpoint")
            self.model_files = ([models.get(r) for r in range(self.world_size)]
                                if self.stage == 3 else [self.model_file])
            if self.stage == 3 and None in self.model_files:
                raise CheckpointError(f"{self.where}: stage 3 needs one model-states file per "
                                      f"rank; some are missing")
        else:
            self.stage = 0
            self.model_files = [self.model_file]
        self.buffer_names = list(self.model.get("buffer_names") or [])
        self.shared = dict(self.model.get("shared_params") or {})
        dtypes = {t.dtype for n, t in self.model["module"].items()
                  if torch.is_tensor(t) and n not in self.buffer_names}
        #: "fp16", "bf16" or "fp32": the dtype the module's parameters were saved in
        self.precision = ("fp16" if torch.float16 in dtypes else
                          "bf16" if torch.bfloat16 in dtypes else "fp32")
        self._summarize(osd0)

    def _summarize(self, osd) -> None:
        """Keep what the index and the resume need of the first optimizer file (sizes,
        paddings, steps, hyperparameters, loss scale), not its tensors."""
        self.flat_numels = self.group_paddings = self.align_paddings = None
        if self.stage in (1, 2):
            parts = osd["single_partition_of_fp32_groups"]
            self.flat_numels = [int(t.numel()) for t in parts]
            self.group_paddings = [int(x) for x in osd.get("group_paddings") or [0] * len(parts)]
            align = osd.get("param_alignment_paddings")
            self.align_paddings = [[int(x) for x in g] for g in align] if align else None
        elif self.stage == 3:
            self.flat_numels = [int(t.numel()) for t in osd["fp32_flat_groups"]]
        self._steps = self._group_steps(osd)
        self._hyper = self._hyperparameters(osd)
        self._scaler = self._loss_scaler_state(osd)

    def open(self, name: str):
        """The object of file *name*: the model-states file read at the start, the first
        optimizer file read for its metadata (handed out once, then forgotten), else read
        now. Callers drop it before opening the next, so one file is held at a time."""
        if name == self.model_file:
            return self.model
        if name in self._kept:
            return self._kept.pop(name)
        return self.read(name)

    def forget(self) -> None:
        """Drop the optimizer file kept from the start if no one asked for it."""
        self._kept.clear()

    # ---- reading ---------------------------------------------------------------------------
    def read(self, name: str):
        """The object in file *name* of the tag directory (restricted unpickler)."""
        try:
            return load_deepspeed_file(os.path.join(self.tag_dir, name))
        except CheckpointError as exc:
            raise CheckpointError(f"{self.where}: {exc}. If the file is intact and comes from "
                                  f"a DeepSpeed version whose layout zero-core does not know, "
                                  f"convert it with DeepSpeed's zero_to_fp32.py") from None

    def _optim_dict(self, obj, name: str) -> dict:
        osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
        if not isinstance(osd, dict):
            raise CheckpointError(f"{self.where}: {name} has no optimizer_state_dict")
        return osd

    def column(self, obj, col) -> torch.Tensor:
        """The flat tensor *col* (a tuple from the index) of the object read from a file."""
        kind = col[0]
        try:
            if kind == "module":
                t = obj["module"][col[1]]
            elif kind == "frozen":
                t = obj["frozen_param_fragments"][col[1]]
            elif kind == "fp32":  # stages 1-3: this rank's fp32 partition of a (sub-)group
                osd = obj["optimizer_state_dict"]
                t = osd["fp32_flat_groups" if self.stage == 3
                        else "single_partition_of_fp32_groups"][col[1]]
            elif kind == "state":  # stages 1-3: an optimizer state of a (sub-)group
                t = self._state_tensor(obj["optimizer_state_dict"], col[1], col[2])
            elif kind == "stage0_flat":  # stage 0 bf16/fp16: fp32 master of a group
                t = obj["optimizer"]["fp32_groups_flat"][col[1]]
            elif kind == "stage0_state":  # stage 0: state of parameter/group index col[1]
                opt = obj["optimizer"]
                opt = opt.get("optimizer_state_dict", opt)
                t = opt["state"][col[1]][col[2]]
            else:
                raise KeyError(kind)
        except (KeyError, IndexError, TypeError) as exc:
            raise CheckpointError(f"{self.where}: {col} is not in its file ({exc!r}): the "
                                  f"file does not have the layout its siblings have") from None
        if not torch.is_tensor(t):
            raise CheckpointError(f"{self.where}: {col} is a {type(t).__name__}, not a tensor")
        return t.reshape(-1)

    def _state_tensor(self, osd: dict, g: int, key: str):
        inner = self._torch_optimizer_state(osd)
        if self.stage == 3:
            return inner["state"][g][key]
        if isinstance(inner, list):  # elastic: one trimmed dict per group
            return inner[g][key]
        return inner["state"][inner["param_groups"][g]["params"][0]][key]

    # ---- what the checkpoint says about the model ---------------------------------------
    def trained_groups(self) -> list[dict]:
        """``param_shapes``: per flat (sub-)group, name -> shape, in flat order (stages 1-3)."""
        shapes = self.model.get("param_shapes")
        if not isinstance(shapes, list):
            raise CheckpointError(f"{self.where}: {self.model_file} has no param_shapes list")
        return [dict(g) for g in shapes]

    def param_shapes(self) -> dict:
        """name -> shape of every parameter the checkpoint holds (trained and frozen;
        shared aliases excluded)."""
        out = {}
        if self.stage >= 1:
            for g in self.trained_groups():
                out.update({n: tuple(int(x) for x in s) for n, s in g.items()})
        frozen = self.model.get("frozen_param_shapes") or {}
        out.update({n: tuple(int(x) for x in s) for n, s in frozen.items()})
        if self.stage <= 2:  # the module holds every parameter in full
            for n, t in self.model["module"].items():
                if n not in self.buffer_names and n not in self.shared and n not in out:
                    out[n] = tuple(t.shape)
        return out

    def client_state(self) -> dict:
        """The keys of the model-states file DeepSpeed did not write itself."""
        return {k: to_plain(v) for k, v in self.model.items() if k not in DEEPSPEED_KEYS}

    # ---- the fragment index -------------------------------------------------------------------
    def fragment_index(self, stage0_groups: list | None = None, trainable=None,
                       states=ADAM_KEYS) -> dict:
        """``name -> [(file, start, end, {key: [column, offset]})]`` (engine_state.py's index
        form) for every parameter: ``"master"`` and the optimizer *states* for trained
        parameters, ``"param"`` for frozen ones. *stage0_groups*: the parameter names of
        each param group, in order, all of them, and *trainable* the set of names trained
        (needed for stage 0's optimizer states and bf16 master weights; None: stage 0 gives
        the module's weights only)."""
        index: dict = {}
        trained: set = set()
        if self.stage in (1, 2):
            self._index_stage12(index, trained, states)
        elif self.stage == 3:
            self._index_stage3(index, trained, states)
        else:
            self._index_stage0(index, trained, states, stage0_groups, trainable)
        self._index_frozen(index, trained)
        for pieces in index.values():
            pieces.sort(key=lambda x: x[1])
        return index

    def _index_stage12(self, index, trained, states) -> None:
        groups = self.trained_groups()
        parts, pads, align = self.flat_numels, self.group_paddings, self.align_paddings
        if len(parts) != len(groups):
            raise CheckpointError(f"{self.where}: {len(groups)} groups in param_shapes but "
                                  f"{len(parts)} fp32 partitions")
        world = self.world_size
        for g, shapes in enumerate(groups):
            size = parts[g] + pads[g]  # the partition, padding included
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = _numel(shape)
                for r in range(offset // size if size else 0, world):
                    lo, hi = max(offset, r * size), min(offset + n, (r + 1) * size)
                    if lo >= hi:
                        break
                    local = lo - r * size
                    keys = {MASTER: [("fp32", g), local]}
                    keys.update({k: [("state", g, k), local] for k in states})
                    index.setdefault(name, []).append(
                        (self.optim_files[r], lo - offset, hi - offset, keys))
                offset += n + (int(align[g][i]) if align else 0)
                trained.add(name)
            if offset > size * world:
                raise CheckpointError(f"{self.where}: group {g}'s parameters need {offset} "
                                      f"elements but the {world} partitions hold "
                                      f"{size * world}: param_shapes and the files disagree")

    def _index_stage3(self, index, trained, states) -> None:
        world = self.world_size
        bounds = [0]
        for n in self.flat_numels:
            bounds.append(bounds[-1] + n)
        offset = 0  # in the concatenation of this rank's sub-group partitions
        for shapes in self.trained_groups():
            for name, shape in shapes.items():
                n = _numel(shape)
                c = math.ceil(n / world)
                for r in range(world):
                    lo, hi = r * c, min((r + 1) * c, n)
                    if lo < hi:
                        for s, a, b, length in self._split(bounds, offset, offset + hi - lo):
                            keys = {MASTER: [("fp32", s), a]}
                            keys.update({k: [("state", s, k), a] for k in states})
                            index.setdefault(name, []).append(
                                (self.optim_files[r], lo + b, lo + b + length, keys))
                offset += c
                trained.add(name)
        if offset != bounds[-1]:
            raise CheckpointError(f"{self.where}: the parameters of param_shapes need {offset} "
                                  f"elements per rank but the fp32 partitions hold "
                                  f"{bounds[-1]}: the files do not match")

    def _split(self, bounds, lo, hi):
        """Pieces of the virtual range ``[lo, hi)`` of the concatenation of tensors with
        cumulative sizes *bounds*: ``(tensor index, offset in it, offset from lo, length)``."""
        pos = lo
        for s in range(len(bounds) - 1):
            a, b = max(pos, bounds[s]), min(hi, bounds[s + 1])
            if a < b:
                yield s, a - bounds[s], a - lo, b - a
                pos = b
        if pos < hi:
            raise CheckpointError(f"{self.where}: element {pos} lies past the fp32 partitions "
                                  f"({bounds[-1]} elements): the files do not match")

    def _index_stage0(self, index, trained, states, groups, trainable) -> None:
        opt = self.model.get("optimizer")
        module = self.model["module"]
        wrapped = isinstance(opt, dict) and "fp32_groups_flat" in opt
        if groups is None:
            return  # weights only: _index_frozen takes every parameter from the module
        inner = (opt.get("optimizer_state_dict", {}) if wrapped else opt) or {}
        saved_groups = inner.get("param_groups") or []
        state = inner.get("state") or {}
        if wrapped:
            flats = opt["fp32_groups_flat"]
            if len(flats) != len(groups):
                raise CheckpointError(f"{self.where}: {len(flats)} optimizer groups, the "
                                      f"engine has {len(groups)}: build it with the param "
                                      f"groups DeepSpeed was given")
            for g, names in enumerate(groups):
                names = [n for n in names if n in module and (trainable is None or n in trainable)]
                offset = 0
                for name in names:
                    n = module[name].numel()
                    keys = {MASTER: [("stage0_flat", g), offset]}
                    if g in state:
                        keys.update({k: [("stage0_state", g, k), offset] for k in states
                                     if k in state[g]})
                    index.setdefault(name, []).append((self.model_file, 0, n, keys))
                    trained.add(name)
                    offset += n
                if offset != flats[g].numel():
                    raise CheckpointError(
                        f"{self.where}: group {g} of the engine has {offset} trainable "
                        f"elements, the checkpoint's fp32 group {flats[g].numel()}: build the "
                        f"engine with the param groups DeepSpeed was given (and the same "
                        f"parameters frozen)")
            return
        ids = [i for sg in saved_groups for i in sg.get("params", [])]
        flat_names = [n for names in groups for n in names]
        if saved_groups and len(ids) != len(flat_names):
            raise CheckpointError(f"{self.where}: the optimizer has {len(ids)} parameters, the "
                                  f"engine's param groups {len(flat_names)}: build the engine "
                                  f"with the param groups DeepSpeed was given")
        for i, name in zip(ids, flat_names):
            if name not in module:
                continue
            n = module[name].numel()
            keys = {MASTER: [("module", name), 0]}
            st = state.get(i, {})
            for k in states:
                if k in st:
                    if tuple(st[k].shape) != tuple(module[name].shape):
                        raise CheckpointError(
                            f"{self.where}: optimizer state {i} ({k}, shape "
                            f"{tuple(st[k].shape)}) does not match parameter {name!r} "
                            f"{tuple(module[name].shape)}: build the engine with the param "
                            f"groups DeepSpeed was given, in the same order")
                    keys[k] = [("stage0_state", i, k), 0]
            index.setdefault(name, []).append((self.model_file, 0, n, keys))
            trained.add(name)

    def _index_frozen(self, index, trained) -> None:
        module = self.model["module"]
        if self.stage == 3:
            world = self.world_size
            for name, shape in (self.model.get("frozen_param_shapes") or {}).items():
                n = _numel(shape)
                c = math.ceil(n / world)
                for r in range(world):
                    lo, hi = r * c, min((r + 1) * c, n)
                    if lo < hi:
                        index.setdefault(name, []).append(
                            (self.model_files[r], lo, hi, {PARAM: [("frozen", name), 0]}))
            return
        for name, t in module.items():
            if name in trained or name in self.buffer_names or name in self.shared:
                continue
            index.setdefault(name, []).append(
                (self.model_file, 0, t.numel(), {PARAM: [("module", name), 0]}))

    # ---- the rest of the state -------------------------------------------------------------
    def group_steps(self) -> list[int]:
        """The optimizer's step count per param group (DeepSpeed's FusedAdam keeps it in
        the state of the group's last parameter; torch's Adam in every parameter's)."""
        return list(self._steps)

    def hyperparameters(self) -> list[dict]:
        """Each param group's saved hyperparameters (without ``params`` and ``step``)."""
        return [dict(h) for h in self._hyper]

    def loss_scaler_state(self) -> dict | None:
        """The loss scale as zero-core's scalers store it (optim/loss_scaler.py), or None
        (also for fp32/bf16 runs, whose saved scaler is DeepSpeed's placeholder of scale 1)."""
        if self._scaler is None or self.precision != "fp16":
            return None
        return dict(self._scaler)

    def _torch_optimizer_state(self, osd):
        """The wrapped torch optimizer's state dict in the saved optimizer state: stage 0
        keeps it in the model file, stage 3 as ``optimizer_state_dict``, stages 1-2 as
        ``base_optimizer_state`` — a dict, or (elastic checkpoints) one trimmed dict per group."""
        if self.stage == 0:
            opt = self.model.get("optimizer") or {}
            return opt.get("optimizer_state_dict", opt) if isinstance(opt, dict) else {}
        if self.stage == 3:
            return osd["optimizer_state_dict"]
        return osd["base_optimizer_state"]

    def _group_steps(self, osd) -> list[int]:
        inner = self._torch_optimizer_state(osd)
        if isinstance(inner, list):
            step = osd.get("base_optimizer_state_step")
            return [_step_of(step if step is not None else b.get("step", 0)) for b in inner]
        state = inner.get("state") or {}
        out = []
        for g in inner.get("param_groups") or []:
            steps = [_step_of(state[i]["step"]) for i in g.get("params", [])
                     if i in state and "step" in state[i]]
            out.append(max(steps) if steps else _step_of(g.get("step", 0)))
        return out

    def _hyperparameters(self, osd) -> list[dict]:
        inner = self._torch_optimizer_state(osd)
        if not isinstance(inner, dict):
            inner = {}
        return [{k: to_plain(v) for k, v in g.items() if k not in ("params", "step")}
                for g in inner.get("param_groups") or []]

    def _loss_scaler_state(self, osd) -> dict | None:
        if self.stage == 0:
            opt = self.model.get("optimizer") or {}
            if not isinstance(opt, dict) or "cur_scale" not in opt:
                return None
            if not opt.get("dynamic_loss_scale"):
                return {"type": "static", "scale": float(opt["cur_scale"])}
            cur, last = int(opt.get("cur_iter", 0)), int(opt.get("last_overflow_iter", -1))
            return {"type": "dynamic", "scale": float(opt["cur_scale"]), "steps": cur,
                    "good_steps": max(cur - last - 1, 0), "overflows": 0}
        s = osd.get("loss_scaler")
        if s is None:
            return None
        attrs = s.__dict__
        if isinstance(s, StaticLossScalerState) or not attrs.get("dynamic", False):
            return {"type": "static", "scale": float(attrs.get("cur_scale", 1.0))}
        cur, last = int(attrs.get("cur_iter", 0)), int(attrs.get("last_overflow_iter", -1))
        return {"type": "dynamic", "scale": float(attrs["cur_scale"]),
                "hysteresis_left": int(attrs.get("cur_hysteresis", 1)), "steps": cur,
                "good_steps": max(cur - last - 1, 0), "overflows": 0}


__all__ = ["DeepSpeedCheckpoint", "deepspeed_tag_dir", "refuse_unsupported", "ZeroStage"]
