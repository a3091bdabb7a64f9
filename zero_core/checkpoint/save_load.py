"""Saving and loading a whole engine: the collective procedures behind
``engine.save_checkpoint`` / ``engine.load_checkpoint``.

Saving: each rank writes its fragments (engine_state.py) and RNG states into its shard
through the atomic store (store.py); rank 0 also writes the buffers and ``common.pt``; the
directory becomes visible only when complete. The phases and the agreement of every rank
after each are collective_save.py's; :class:`RankState` is what one rank writes, taken at
the call (and copied to host memory for an async save: background.py).

Loading: every rank reads the manifest, plans which saved fragments overlap what it owns
now, copies them in, then lets the stage rebuild what is derived (``subject.restored()``).
The procedures see the engine only through its
:class:`~zero_core.interfaces.engine_parts.CheckpointSubject` (``engine.checkpoint_subject()``).
DeepSpeed ZeRO checkpoints are recognized and handed to deepspeed_resume.py.

Per rank, the shard also holds the rank's RNG states (torch CPU generator, the
accelerator's, Python's ``random``, numpy's global generator) and the optimizer's per-rank
tensors (``optim.*``: ``rank_checkpoint_tensors``, the 1-bit optimizers' error feedback —
kept with their rank so that no file grows with the world size); rank 0's shard holds the
module's buffers; rank 0 writes ``common.pt`` (step counters, optimizer hyperparameters and
step counts, LR scheduler, loss scaler, client_state). RNG states are restored only when
the world size is unchanged (a different number of ranks cannot continue the same streams),
and so are the optimizer's per-rank tensors (on another world size it is given None).
"""
from __future__ import annotations

import io
import json
import os
import random

import torch

from zero_core.checkpoint import store
from zero_core.checkpoint.collective_save import SaveJob
from zero_core.checkpoint.deepspeed_layout import deepspeed_tag_dir
from zero_core.checkpoint.deepspeed_resume import load_deepspeed
from zero_core.checkpoint.engine_state import (WEIGHT_KEYS, fragment_index, parameter_names,
                                               plan_reads)
from zero_core.checkpoint.store import (CheckpointError, CheckpointMismatchError, TensorEntry,
                                        dtype_name)


# ---- RNG ----------------------------------------------------------------------------------------
def _device_rng_module(device: torch.device):
    if device.type == "cpu":
        return None  # the CPU generator is saved as torch_cpu
    module = torch.get_device_module(device.type)
    return module if hasattr(module, "get_rng_state") else None


def capture_rng(device: torch.device) -> tuple[dict, dict]:
    """This process's RNG states as ``(tensors, plain values)`` for a safetensors shard."""
    import numpy as np
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"rng.torch_cpu": torch.get_rng_state(),
               "rng.python": torch.tensor(mt, dtype=torch.int64),
               "rng.numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64))}
    mod = _device_rng_module(device)
    if mod is not None:
        tensors["rng.accelerator"] = mod.get_rng_state(device.index or 0).cpu()
    plain = {"python_version": version, "python_gauss": gauss, "numpy_kind": kind,
             "numpy_pos": int(pos), "numpy_has_gauss": int(has_gauss),
             "numpy_cached_gaussian": float(cached), "device": str(device)}
    return tensors, plain


def restore_rng(reader: store.SafetensorsReader, device: torch.device) -> None:
    """Restore the RNG states saved by :func:`capture_rng` from a shard."""
    import numpy as np
    try:
        plain = json.loads(reader.metadata["rng"])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{reader.path} has no readable RNG state ({exc})") from None
    torch.set_rng_state(reader.read_tensor("rng.torch_cpu"))
    mt = tuple(int(x) for x in reader.read_tensor("rng.python").tolist())
    random.setstate((plain["python_version"], mt, plain["python_gauss"]))
    keys = reader.read_tensor("rng.numpy").numpy().astype(np.uint32)
    np.random.set_state((plain["numpy_kind"], keys, plain["numpy_pos"],
                         plain["numpy_has_gauss"], plain["numpy_cached_gaussian"]))
    mod = _device_rng_module(device)
    if mod is not None and "rng.accelerator" in reader.tensors:
        mod.set_rng_state(reader.read_tensor("rng.accelerator"), device.index or 0)


# ---- plain data (weights_only-loadable) --------------------------------------------------------
#: the prefix of the optimizer's per-rank tensors in a rank's shard (rank_checkpoint_tensors)
RANK_PREFIX = "optim."
_PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)


def check_plain(obj, where: str) -> None:
    """Refuse what ``torch.load(weights_only=True)`` would not read back (before writing)."""
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            check_plain(k, f"{where} key {k!r}")
            check_plain(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, "
                          f"which a checkpoint cannot hold: checkpoints are loaded without "
                          f"running code (weights_only), so store plain data (dict, list, str, "
                          f"numbers, tensors) — e.g. its state_dict()")


# ---- model description ---------------------------------------------------------------------------
def describe_model(module: torch.nn.Module) -> dict:
    """Parameter shapes/dtypes, tied aliases, persistent buffers and state_dict key order."""
    params = {n: {"shape": list(p.shape), "dtype": dtype_name(p.dtype)}
              for n, p in module.named_parameters()}
    first = parameter_names(module)
    aliases = {n: first[id(p)] for n, p in module.named_parameters(remove_duplicate=False)
               if first[id(p)] != n}
    buffers = {}
    keys = list(module.state_dict(keep_vars=True).keys())
    named_buffers = dict(module.named_buffers())
    for k in keys:
        if k in named_buffers:
            b = named_buffers[k]
            buffers[k] = {"shape": list(b.shape), "dtype": dtype_name(b.dtype)}
    return {"params": params, "aliases": aliases, "buffers": buffers, "state_dict_keys": keys}


def check_model(described: dict, meta: dict, where: str) -> None:
    """Refuse a checkpoint of another model (parameter names or shapes differ)."""
    saved = meta["model"]
    problems = []
    mine, theirs = described["params"], saved["params"]
    missing = [n for n in mine if n not in theirs]
    extra = [n for n in theirs if n not in mine]
    if missing:
        problems.append(f"parameters of this model not in the checkpoint: {_few(missing)}")
    if extra:
        problems.append(f"parameters in the checkpoint not in this model: {_few(extra)}")
    for n in mine:
        if n in theirs and list(mine[n]["shape"]) != list(theirs[n]["shape"]):
            problems.append(f"parameter {n!r} has shape {list(theirs[n]['shape'])} in the "
                            f"checkpoint but {list(mine[n]['shape'])} in this model")
    for n, b in described["buffers"].items():
        if n not in saved["buffers"]:
            problems.append(f"buffer {n!r} of this model is not in the checkpoint")
        elif list(saved["buffers"][n]["shape"]) != list(b["shape"]):
            problems.append(f"buffer {n!r} has shape {saved['buffers'][n]['shape']} in the "
                            f"checkpoint but {b['shape']} in this model")
    if problems:
        raise CheckpointMismatchError(f"{where} was saved from a different model: "
                              + "; ".join(problems[:6])
                              + (f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""))


def _few(names: list, n: int = 5) -> str:
    return ", ".join(repr(x) for x in names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


# ---- save ----------------------------------------------------------------------------------------
class RankState:
    """What one rank writes into a checkpoint, taken at the call: its fragments as one flat
    column per (state key, dtype) — views of the live state, or host copies after
    :meth:`snapshot` (an async save) — its RNG states, and on rank 0 the module's buffers,
    ``common.pt`` (serialized at once) and the metadata."""

    def __init__(self, subject, client_state):
        self.subject, self.client_state, self.rank = subject, client_state, subject.rank
        fragments = subject.fragments("save")
        self.fragments = fragments
        # one flat tensor per (key, dtype): fragments are streamed into it, never concatenated
        self.columns: dict[str, list] = {}
        records = []
        for f in fragments:
            keys = {}
            for key, view in f.tensors.items():
                col = f"{key}.{dtype_name(view.dtype)}"
                pieces = self.columns.setdefault(col, [])
                offset = sum(v.numel() for v in pieces)
                pieces.append(view)
                keys[key] = [col, offset]
            prev = records[-1] if records else None
            if (prev is not None and prev[0] == f.name and prev[2] == f.start
                    and prev[3].keys() == keys.keys()
                    and all(prev[3][k][0] == c and prev[3][k][1] + prev[2] - prev[1] == o
                            for k, (c, o) in keys.items())):
                prev[2] = f.end  # a parameter crossing a bucket border: one record
            else:
                records.append([f.name, f.start, f.end, keys])
        self.index = {"file": store.shard_name(self.rank), "fragments": records}
        self.rng_tensors, self.rng_plain = capture_rng(subject.device)
        # the optimizer's per-rank state (1-bit error feedback), host copies taken now
        opt = subject.optimizer
        self.rank_tensors = {RANK_PREFIX + k: t.detach().to("cpu", copy=True)
                             for k, t in (opt.rank_checkpoint_tensors().items()
                                          if hasattr(opt, "rank_checkpoint_tensors") else ())}
        self.buffers: dict[str, torch.Tensor] = {}
        self.common = b""
        self.metadata: dict = {}
        self.ready = None  # an async save's device event: the snapshot's copies are done

    def prepare(self) -> None:
        """Rank 0: describe the model, serialize ``common.pt``, fill the metadata (in the
        save's first phase, so that a failure — client_state that cannot be stored — is
        agreed by every rank)."""
        if self.rank != 0:
            return
        described = describe_model(self.subject.module)
        named = dict(self.subject.module.named_buffers())
        self.buffers = {n: named[n].detach() for n in described["buffers"]}
        buf = io.BytesIO()
        torch.save(common_state(self.subject, self.client_state), buf)
        self.common = buf.getvalue()
        # filled in place: SaveJob.run holds this dict from before the save's first phase
        self.metadata.update(engine_metadata(self.subject, described, self.fragments))

    def snapshot(self, cache: dict) -> None:
        """Replace the views by host copies (an async save), reusing *cache*'s buffers
        (name -> tensor) between saves. Device copies are non-blocking into pinned memory;
        :attr:`ready` is the event the writer waits for. Refuses (CheckpointError) a
        snapshot larger than the host memory available."""
        device = self.subject.device
        pin = device.type != "cpu"
        wanted = {col: (sum(v.numel() for v in views), views[0].dtype)
                  for col, views in self.columns.items()}
        wanted.update({"buffer." + n: (t.numel(), t.dtype) for n, t in self.buffers.items()})
        need = sum(n * torch.empty((), dtype=d).element_size() for name, (n, d) in wanted.items()
                   if not _reusable(cache.get(name), n, d))
        _check_host_memory(need, self.subject.rank)
        host = {}
        for col, views in self.columns.items():
            n, dtype = wanted[col]
            buf = _cached(cache, col, n, dtype, pin)
            at = 0
            for v in views:
                buf[at:at + v.numel()].copy_(v.reshape(-1), non_blocking=pin)
                at += v.numel()
            host[col] = [buf]
        self.columns = host
        for name, t in list(self.buffers.items()):
            buf = _cached(cache, "buffer." + name, t.numel(), t.dtype, pin)
            buf.copy_(t.reshape(-1), non_blocking=pin)
            self.buffers[name] = buf.view(t.shape)
        if pin:
            try:
                self.ready = torch.Event(device=device)
                self.ready.record()
            except (RuntimeError, TypeError, AttributeError):
                torch.get_device_module(device.type).synchronize()
                self.ready = None

    def write_files(self, directory: str) -> dict:
        """Write this rank's files into *directory*; ``{file name: (sha256, bytes)}``."""
        if self.ready is not None:
            self.ready.synchronize()  # on the writer thread: training goes on meanwhile
        entries = [TensorEntry(col, views[0].dtype, (sum(v.numel() for v in views),),
                               lambda views=views: iter(views))
                   for col, views in self.columns.items()]
        entries += [TensorEntry(name, t.dtype, tuple(t.shape), lambda t=t: [t])
                    for name, t in {**self.rng_tensors, **self.rank_tensors}.items()]
        entries += [TensorEntry("buffer." + n, t.dtype, tuple(t.shape), lambda t=t: [t])
                    for n, t in self.buffers.items()]
        name = store.shard_name(self.rank)
        out = {name: store.write_safetensors(
            os.path.join(directory, name), entries,
            {"format": "zero-core-shard", "rank": str(self.rank),
             "rng": json.dumps(self.rng_plain)})}
        if self.rank == 0:
            out[store.COMMON] = store.write_file(os.path.join(directory, store.COMMON),
                                                 self.common)
        return out


def _reusable(buf, numel: int, dtype: torch.dtype) -> bool:
    return buf is not None and buf.numel() == numel and buf.dtype == dtype


def _cached(cache: dict, name: str, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    buf = cache.get(name)
    if not _reusable(buf, numel, dtype):
        buf = cache[name] = torch.empty(numel, dtype=dtype, pin_memory=pin)
    return buf


def _check_host_memory(need: int, rank: int) -> None:
    """Refuse an async snapshot that would not fit the host's available memory (Linux's
    MemAvailable; unknown elsewhere: allowed)."""
    try:
        with open("/proc/meminfo") as fh:
            info = dict(line.split(":", 1) for line in fh)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    if need > 0.9 * available:
        raise CheckpointError(
            f"an async save needs a host copy of rank {rank}'s state, {need / 2**30:.2f} GiB "
            f"more host memory, and {available / 2**30:.2f} GiB are available: save with "
            f"async_save=False (checkpoint.async_save false), which writes straight from the "
            f"training state")


def save_checkpoint(subject, save_dir: str, tag=None, client_state=None,
                    save_latest: bool = True, background=None) -> str:
    """Collective: save the engine that *subject* (a ``CheckpointSubject``) shows as
    checkpoint *tag* (default ``global_step<N>``) in *save_dir*; returns the checkpoint's
    directory. See the module docstring.

    *client_state* (plain data: dict, list, str, numbers, tensors) is rank 0's, as in
    DeepSpeed; :func:`load_checkpoint` returns it on every rank. Per-rank streams belong
    in the RNGs, which are saved per rank.

    *background* (a :class:`~zero_core.checkpoint.background.BackgroundSaver`): an async
    save — the state is copied to host memory here, written by a thread while training
    goes on, and committed (metadata, rename, ``latest``) at a later collective point
    (``background.poll()``/``wait()``); until then the directory is ``.<tag>.partial``.
    """
    tag = f"global_step{subject.counters['global_steps']}" if tag is None else str(tag)
    state = RankState(subject, client_state)
    job = SaveJob(subject.comm, save_dir, store.check_tag(tag), save_latest)
    with job.peers_failing_named():
        if background is None:
            return job.run(state.prepare, state.write_files, state.index, state.metadata)

        def prepare():
            state.prepare()
            state.snapshot(background.buffers)
        job.begin(prepare)
    background.start(job, state)
    return job.final


def common_state(subject, client_state) -> dict:
    """What rank 0 stores in ``common.pt`` (checked to be weights_only-loadable)."""
    opt = subject.optimizer
    common = {
        **{k: int(v) for k, v in subject.counters.items()},
        "optimizer": {"groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in opt.param_groups],
                      "step_counts": [int(s) for s in getattr(opt, "step_counts", [])],
                      # an optimizer's own counters (ZenFlow's window: offload/zenflow.py)
                      "extra": (opt.checkpoint_extra() if hasattr(opt, "checkpoint_extra")
                                else None)},
        "lr_scheduler": (subject.lr_scheduler.state_dict()
                         if subject.lr_scheduler is not None else None),
        "loss_scaler": (subject.loss_scaler.state_dict()
                        if subject.loss_scaler is not None else None),
        "client_state": client_state if client_state is not None else {},
        "data": subject.data_state() if subject.data_state is not None else None,
    }
    check_plain(common["client_state"], "client_state")
    check_plain(common, "the engine's state")
    return common


def engine_metadata(subject, described: dict, fragments) -> dict:
    """What rank 0 puts in metadata.json besides the store's own keys."""
    from zero_core.version import __version__
    state_keys = sorted({k for f in fragments for k in f.tensors if k not in WEIGHT_KEYS})
    layout = subject.layout()
    rule = subject.rule
    return {
        "format": "zero-core-checkpoint", "zero_core_version": __version__,
        "engine": subject.engine_name, "stage": int(subject.stage),
        "compute_dtype": dtype_name(subject.compute_dtype),
        "model": described,
        "optimizer": {"kind": rule.kind if rule is not None else None,
                      "state_keys": state_keys,
                      "groups": json.loads(json.dumps(
                          [{k: v for k, v in g.items() if k != "params"}
                           for g in subject.optimizer.param_groups], default=str))},
        # informational (loading reads each column's own dtype): bf16 with
        # bf16_master_weights_and_grads / bf16_optimizer_states
        "dtypes": {"master": dtype_name(subject.master_dtype),
                   "optimizer_states": dtype_name(subject.state_dtype),
                   "param": dtype_name(subject.compute_dtype)},
        "layout": layout,
        "counters": {k: int(v) for k, v in subject.counters.items()},
        "batch": subject.batch,
        "common": store.COMMON, "buffers_in": store.shard_name(0),
    }


# ---- load ----------------------------------------------------------------------------------------
@torch.no_grad()
def load_checkpoint(subject, load_dir: str, tag=None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Collective: load checkpoint *tag* (default: ``latest``) from *load_dir* into
    the engine *subject* shows, whatever world size and stage it was saved with. Returns
    ``(checkpoint directory, client_state)``.

    ``load_module_only``: only parameters and buffers (not master-derived optimizer state,
    counters, scheduler, scaler or RNG). ``load_optimizer_states=False``: weights and
    counters but no optimizer states (they keep their current values).

    A DeepSpeed ZeRO checkpoint directory (``*_model_states.pt`` / ``*_optim_states.pt``,
    no ``metadata.json``) is loaded by deepspeed_resume.py, with the same arguments.
    """
    if deepspeed_tag_dir(load_dir, tag) is not None:
        return load_deepspeed(subject, load_dir, tag, load_optimizer_states,
                              load_lr_scheduler_states, load_module_only)
    tag_dir, meta = store.read_metadata(load_dir, tag)
    where = os.path.join(tag_dir, store.METADATA)
    for key in ("model", "stage"):
        if key not in meta:
            raise CheckpointError(f"{where} has no '{key}': not an engine checkpoint")
    check_model(describe_model(subject.module), meta, where)
    states = load_optimizer_states and not load_module_only
    same_world = int(meta["world_size"]) == subject.world_size
    error: Exception | None = None
    common = rank_tensors = None   # rank_tensors: read only from this rank's own shard
    try:
        wanted = subject.fragments("load")
        plan = plan_reads(wanted, fragment_index(meta), lambda k: k in WEIGHT_KEYS or states, where)
        rng_file = store.shard_name(subject.rank) if same_world and not load_module_only else None
        buffer_file = meta.get("buffers_in", store.shard_name(0))
        files = sorted(set(plan) | {buffer_file} | ({rng_file} if rng_file else set()))
        named_buffers = dict(subject.module.named_buffers())
        for file in files:
            with store.open_shard(tag_dir, file, meta) as reader:
                for col, off, count, dst in plan.get(file, ()):
                    reader.read_into(col, off, dst)
                if file == buffer_file:
                    for n in meta["model"]["buffers"]:
                        if n in named_buffers:
                            reader.read_into("buffer." + n, 0, named_buffers[n])
                if file == rng_file:
                    rng_reader_path = reader.path  # restored last, after the collectives
                    rank_tensors = {n[len(RANK_PREFIX):]: reader.read_tensor(n)
                                    for n in reader.tensors if n.startswith(RANK_PREFIX)}
        common = store.load_plain(tag_dir, meta.get("common", store.COMMON), meta)
        if not isinstance(common, dict):
            raise CheckpointError(f"{os.path.join(tag_dir, store.COMMON)} is not a dict")
    except CheckpointError as exc:
        error = exc
    store.raise_unless_loaded_everywhere(subject.comm, error, f"checkpoint {tag_dir}")
    subject.restored()
    if not load_module_only:
        _restore_common(subject, common, states, load_lr_scheduler_states, tag_dir,
                        rank_tensors,
                        (meta.get("batch") or {}).get("gradient_accumulation_steps"))
        if rng_file:
            with store.SafetensorsReader(rng_reader_path) as reader:
                restore_rng(reader, subject.device)
    return tag_dir, common.get("client_state", {})


def _restore_common(subject, common: dict, states: bool, scheduler: bool, tag_dir: str,
                    rank_tensors: dict | None,
                    saved_accumulation: int | None = None) -> None:
    micro_steps = int(common["micro_steps"])
    if saved_accumulation not in (None, subject.gradient_accumulation_steps):
        # saved with other accumulation steps (a resume on another world size keeping the
        # global batch): the next micro-step starts a window of the new length
        micro_steps = int(common["global_steps"]) * subject.gradient_accumulation_steps
    subject.set_counters(int(common["global_steps"]), micro_steps, int(common["skipped_steps"]))
    opt = subject.optimizer
    if states:
        groups = common["optimizer"]["groups"]
        if len(groups) != len(opt.param_groups):
            raise CheckpointError(f"{tag_dir} has {len(groups)} optimizer parameter groups, "
                                  f"this engine {len(opt.param_groups)}: build the optimizer "
                                  f"with the same groups, or pass load_optimizer_states=False")
        for mine, saved in zip(opt.param_groups, groups):
            mine.update(saved)
        counts = common["optimizer"]["step_counts"]
        if hasattr(opt, "step_counts") and len(counts) == len(opt.step_counts):
            opt.step_counts[:] = counts
        if hasattr(opt, "load_checkpoint_extra"):  # after the fragments were read
            opt.load_checkpoint_extra(common["optimizer"].get("extra"))
        if hasattr(opt, "load_rank_checkpoint_tensors"):  # None: saved on another world size
            opt.load_rank_checkpoint_tensors(rank_tensors)
    if scheduler and common.get("lr_scheduler") is not None and subject.lr_scheduler is not None:
        subject.lr_scheduler.load_state_dict(common["lr_scheduler"])
    if common.get("loss_scaler") is not None and subject.loss_scaler is not None:
        subject.loss_scaler.load_state_dict(common["loss_scaler"])
    if common.get("data") is not None and subject.restore_data is not None:
        subject.restore_data(common["data"])
