"""Saving and loading a whole engine: the collective procedures behind
``engine.save_checkpoint`` / ``engine.load_checkpoint``.

Saving: each rank writes its fragments (engine_state.py) and RNG states into its shard
through the atomic store (store.py); rank 0 also writes the buffers and ``common.pt``; the
directory becomes visible only when complete. :func:`save_files` runs the phases of a
collective save (create ``.<tag>.partial``, every rank writes, rank 0 finishes) with an
agreement after each that every rank reaches whatever happened: one all-reduce when all
went well; after a failure anywhere (a full disk, a read-only or vanished directory, an
exception in the caller's writer) the ranks exchange what failed, rank 0 removes the
partial files, and every rank raises the same CheckpointError naming the failed ranks and
the cause (:func:`failure_cause`, from the errno) — at once, not after a timeout — and can
go on training. Only a rank that dies mid-save leaves its partial directory behind.

Loading: every rank reads the manifest, plans which saved fragments overlap what it owns
now, copies them in, then lets the stage rebuild what is derived (``subject.restored()``).
The procedures see the engine only through its
:class:`~zero_core.interfaces.engine_parts.CheckpointSubject` (``engine.checkpoint_subject()``).
DeepSpeed ZeRO checkpoints are recognized and handed to deepspeed_resume.py.

Per rank, the shard also holds the rank's RNG states (torch CPU generator, the
accelerator's, Python's ``random``, numpy's global generator); rank 0's shard holds the
module's buffers; rank 0 writes ``common.pt`` (step counters, optimizer hyperparameters and
step counts, LR scheduler, loss scaler, client_state). RNG states are restored only when
the world size is unchanged (a different number of ranks cannot continue the same streams).
"""
from __future__ import annotations

import errno
import json
import os
import random
from typing import Callable

import torch

from zero_core.checkpoint import store
from zero_core.checkpoint.deepspeed_layout import deepspeed_tag_dir
from zero_core.checkpoint.deepspeed_resume import load_deepspeed
from zero_core.checkpoint.engine_state import (WEIGHT_KEYS, fragment_index, parameter_names,
                                               plan_reads)
from zero_core.checkpoint.store import CheckpointError, TensorEntry, dtype_name


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
        raise CheckpointError(f"{where} was saved from a different model: "
                              + "; ".join(problems[:6])
                              + (f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""))


def _few(names: list, n: int = 5) -> str:
    return ", ".join(repr(x) for x in names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


# ---- the collective save of a directory ------------------------------------------------------
#: errno name -> (the cause in words, what to do about it)
_CAUSES = {
    **dict.fromkeys(("ENOSPC", "EDQUOT"), (
        "disk full", "free space on that file system (or raise the quota), or save to "
        "another directory")),
    **dict.fromkeys(("EACCES", "EPERM", "EROFS"), (
        "permission denied / read-only file system", "make the directory writable for the "
        "user running the job, or save to another directory")),
    **dict.fromkeys(("ENOENT", "ENOTDIR"), (
        "directory missing", "something removed or renamed the directory during the save (a "
        "cleanup job? another run saving there?), or save_dir is not one directory that every "
        "rank sees; make sure it exists for all ranks")),
}


def failure_cause(exc: BaseException) -> tuple[str, str, str]:
    """``(cause, detail, what to do)`` for a failed write, in words. The first ``OSError``
    with an errno in *exc*'s chain (``__cause__``/``__context__``) decides: ``("disk full
    (ENOSPC)", "No space left on device: <path>", ...)``; anything else is named by its type
    and message (detail ``""``)."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            name = errno.errorcode.get(e.errno, f"errno {e.errno}")
            words, fix = _CAUSES.get(name, (e.strerror or "I/O error",
                                            "fix that file system error"))
            where = f": {os.fsdecode(e.filename)}" if e.filename is not None else ""
            return f"{words} ({name})", f"{e.strerror or e}{where}", fix
        e = e.__cause__ or e.__context__
    return (f"{type(exc).__name__}: {exc}", "",
            "that error is not the file system's: fix what it names, or report it as a bug")


class _Save:
    """One collective save: its paths, its phases, and the agreement all ranks reach after
    each phase (:meth:`agree`), which turns any rank's failure into the same error on every
    rank at once and removes what the save wrote."""

    def __init__(self, comm, save_dir: str, tag: str, save_latest: bool):
        self.comm, self.save_dir, self.tag, self.save_latest = comm, save_dir, tag, save_latest
        self.final = os.path.join(save_dir, tag)
        self.partial = os.path.join(save_dir, f".{tag}.partial")
        self.latest_tmp = os.path.join(save_dir, store.LATEST + ".tmp")
        self.moved = False  # rank 0: the finished directory is in place

    def run(self, write_files, index, metadata: dict) -> str:
        rank, failure = self.comm.rank, None
        if rank == 0:
            try:
                os.makedirs(self.save_dir, exist_ok=True)
                store.remove_path(self.partial)  # left behind by a save that died
                os.makedirs(self.partial)
            except Exception as exc:
                failure = self._failure("creating the save directory", exc)
        self.agree(failure)
        payload = b""
        try:
            files = {name: {"sha256": sha, "bytes": size}
                     for name, (sha, size) in write_files(self.partial).items()}
            payload = json.dumps({"files": files, "index": index}).encode()
        except Exception as exc:  # a full disk, a vanished directory, a bug: all reported
            failure = self._failure("writing its files", exc)
        self.agree(failure)
        gathered = [json.loads(b) for b in store.all_gather_bytes(self.comm, payload)]
        if rank == 0:
            try:
                self._finish(gathered, metadata)
            except Exception as exc:
                failure = self._failure("finishing the save", exc)
        self.agree(failure)
        return self.final

    def _finish(self, gathered: list, metadata: dict) -> None:
        meta = dict(metadata)
        meta.update(format_version=store.FORMAT_VERSION, tag=self.tag,
                    world_size=self.comm.world_size,
                    files={name: info for g in gathered for name, info in g["files"].items()},
                    ranks=[g["index"] for g in gathered])
        store.write_file_atomic(os.path.join(self.partial, store.METADATA),
                                json.dumps(meta, indent=1, sort_keys=True).encode())
        store.fsync_dir(self.partial)
        if self.save_latest:  # before the move: a full disk stops the save before any change
            store.write_file(self.latest_tmp, self.tag.encode())
        store.move_into_place(self.save_dir, self.tag, self.partial, self.final)
        self.moved = True
        if self.save_latest:
            os.replace(self.latest_tmp, os.path.join(self.save_dir, store.LATEST))
        store.fsync_dir(self.save_dir)

    def _failure(self, phase: str, exc: BaseException) -> dict:
        cause, detail, fix = failure_cause(exc)
        return {"rank": self.comm.rank, "phase": phase, "cause": cause, "detail": detail,
                "fix": fix}

    def agree(self, failure: dict | None) -> None:
        """Collective, on every rank after every phase, failed or not: return if no rank
        failed; else exchange the failures, let rank 0 remove the partial files (every rank
        is here, so nobody still writes into them) and raise the same CheckpointError on
        every rank. One all-reduce when all went well."""
        if store.all_ranks_ok(self.comm, failure is None):
            return
        failures = [f for f in (json.loads(b) for b in store.all_gather_bytes(
            self.comm, json.dumps(failure).encode())) if f]
        cleanup = json.dumps(self._clean_up()).encode() if self.comm.rank == 0 else b""
        raise CheckpointError(self._message(failures, json.loads(
            store.all_gather_bytes(self.comm, cleanup)[0])))

    def _clean_up(self) -> dict:
        try:
            if not self.moved:
                store.remove_path(self.partial)
            store.remove_path(self.latest_tmp)
            store.fsync_dir(self.save_dir)
            error = ""
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        return {"moved": self.moved, "error": error}

    def _message(self, failures: list, cleanup: dict) -> str:
        ranks = [f["rank"] for f in failures]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        what = "; ".join(f"rank {f['rank']}, {f['phase']}: {f['cause']}"
                         + (f", {f['detail']}" if f["detail"] else "") for f in failures)
        fixes = list(dict.fromkeys(f["fix"] for f in failures))
        if cleanup["moved"]:
            state = (f"Checkpoint '{self.tag}' itself is complete in {self.final}, but "
                     f"'{store.LATEST}' could not be updated and still names the previous one: "
                     f"load this one with tag='{self.tag}'")
        else:
            gone = ("are gone" if not cleanup["error"] else
                    f"could not all be removed ({cleanup['error']}): remove them by hand")
            state = (f"The save's partial files ({self.partial}) {gone}; the previous "
                     f"checkpoint and '{store.LATEST}' in {self.save_dir} are unchanged")
        return (f"saving checkpoint '{self.tag}' in {self.save_dir} failed on {who}: {what}. "
                f"{state}. Every rank can go on training and save again; to fix: "
                f"{'; '.join(fixes)}")


def save_files(comm, save_dir: str, tag: str, write_files: Callable[[str], dict], index,
               metadata: dict, save_latest: bool = True) -> str:
    """Collective: write checkpoint *tag* into *save_dir*; returns its final directory.

    *write_files(directory)* writes this rank's files into *directory* and returns
    ``{file name: (sha256, bytes)}``. *index* (JSON-able) is this rank's contribution to
    the metadata: the list of every rank's is stored as ``metadata["ranks"]``. *metadata*
    is read on rank 0 after every rank's *write_files* returned (so it may fill it).

    Any failure on any rank (an exception in *write_files* included) raises the same
    :class:`CheckpointError` on every rank as soon as all reach the phase's agreement,
    naming the ranks, the cause (disk full, permission, directory missing: from the errno)
    and the file; the partial files are removed and the previous checkpoint and ``latest``
    are unchanged, and the ranks can go on. A rank that dies makes the others fail in a
    collective (within the communicator's timeout); its partial directory stays until the
    next save of the tag.
    """
    job = _Save(comm, save_dir, store.check_tag(tag), save_latest)
    try:
        return job.run(write_files, index, metadata)
    except CheckpointError:
        raise
    except Exception as exc:  # a collective failed: a peer died or timed out
        raise CheckpointError(
            f"saving checkpoint '{job.tag}' in {save_dir} failed on rank {comm.rank}: a "
            f"collective with the other ranks failed ({type(exc).__name__}: {exc}). Another "
            f"rank probably died or stopped while writing; the previous checkpoint and "
            f"'{store.LATEST}' in {save_dir} are unchanged (the unfinished .{job.tag}.partial "
            f"is removed by the next save of this tag)") from exc


# ---- save ----------------------------------------------------------------------------------------
def save_checkpoint(subject, save_dir: str, tag=None, client_state=None,
                    save_latest: bool = True) -> str:
    """Collective: save the engine that *subject* (a ``CheckpointSubject``) shows as
    checkpoint *tag* (default ``global_step<N>``) in *save_dir*; returns the checkpoint's
    directory. See the module docstring.

    *client_state* (plain data: dict, list, str, numbers, tensors) is rank 0's, as in
    DeepSpeed; :func:`load_checkpoint` returns it on every rank. Per-rank streams belong
    in the RNGs, which are saved per rank.
    """
    tag = f"global_step{subject.counters['global_steps']}" if tag is None else str(tag)
    rank = subject.rank
    fragments = subject.fragments("save")
    # one flat tensor per (key, dtype): fragments are streamed into it, never concatenated
    columns: dict[str, list] = {}
    records = []
    for f in fragments:
        keys = {}
        for key, view in f.tensors.items():
            col = f"{key}.{dtype_name(view.dtype)}"
            pieces = columns.setdefault(col, [])
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
    rng_tensors, rng_plain = capture_rng(subject.device)
    module = subject.module
    metadata: dict = {}  # rank 0's, filled while writing: save_files reads it afterwards

    def write_files(directory: str) -> dict:
        # rank 0's own work is done in here, so that its failure reaches the agreement
        described = describe_model(module) if rank == 0 else None
        entries = [TensorEntry(col, views[0].dtype, (sum(v.numel() for v in views),),
                               lambda views=views: iter(views))
                   for col, views in columns.items()]
        entries += [TensorEntry(name, t.dtype, tuple(t.shape), lambda t=t: [t])
                    for name, t in rng_tensors.items()]
        if rank == 0:
            named = dict(module.named_buffers())
            entries += [TensorEntry("buffer." + n, named[n].dtype, tuple(named[n].shape),
                                    lambda n=n: [named[n].detach()])
                        for n in described["buffers"]]
        out = {store.shard_name(rank): store.write_safetensors(
            os.path.join(directory, store.shard_name(rank)), entries,
            {"format": "zero-core-shard", "rank": str(rank), "rng": json.dumps(rng_plain)})}
        if rank == 0:
            common = common_state(subject, client_state)
            out[store.COMMON] = store.save_plain(os.path.join(directory, store.COMMON), common)
            metadata.update(engine_metadata(subject, described, fragments))
        return out

    index = {"file": store.shard_name(rank), "fragments": records}
    return save_files(subject.comm, save_dir, tag, write_files, index, metadata, save_latest)


def common_state(subject, client_state) -> dict:
    """What rank 0 stores in ``common.pt`` (checked to be weights_only-loadable)."""
    opt = subject.optimizer
    common = {
        **{k: int(v) for k, v in subject.counters.items()},
        "optimizer": {"groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in opt.param_groups],
                      "step_counts": [int(s) for s in getattr(opt, "step_counts", [])]},
        "lr_scheduler": (subject.lr_scheduler.state_dict()
                         if subject.lr_scheduler is not None else None),
        "loss_scaler": (subject.loss_scaler.state_dict()
                        if subject.loss_scaler is not None else None),
        "client_state": client_state if client_state is not None else {},
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
    common = None
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
        common = store.load_plain(tag_dir, meta.get("common", store.COMMON), meta)
        if not isinstance(common, dict):
            raise CheckpointError(f"{os.path.join(tag_dir, store.COMMON)} is not a dict")
    except CheckpointError as exc:
        error = exc
    store.raise_unless_loaded_everywhere(subject.comm, error, f"checkpoint {tag_dir}")
    subject.restored()
    if not load_module_only:
        _restore_common(subject, common, states, load_lr_scheduler_states, tag_dir)
        if rng_file:
            with store.SafetensorsReader(rng_reader_path) as reader:
                restore_rng(reader, subject.device)
    return tag_dir, common.get("client_state", {})


def _restore_common(subject, common: dict, states: bool, scheduler: bool, tag_dir: str) -> None:
    subject.set_counters(int(common["global_steps"]), int(common["micro_steps"]),
                         int(common["skipped_steps"]))
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
    if scheduler and common.get("lr_scheduler") is not None and subject.lr_scheduler is not None:
        subject.lr_scheduler.load_state_dict(common["lr_scheduler"])
    if common.get("loss_scaler") is not None and subject.loss_scaler is not None:
        subject.loss_scaler.load_state_dict(common["loss_scaler"])
