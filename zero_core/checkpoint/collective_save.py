"""The collective save of one checkpoint directory: its phases, and the agreement every
rank reaches after each (ARCHITECTURE §6).

:class:`SaveJob` runs a save as ``begin`` (rank 0 creates ``.<tag>.partial``; every rank
prepares), ``write`` (each rank's files; no collective, so an async save runs it on a
thread: background.py) and ``commit`` (rank 0 writes ``metadata.json``, renames the
directory into place, then replaces ``latest``). After each phase one all-reduce says
whether every rank succeeded; after a failure anywhere (a full disk, a read-only or
vanished directory, an exception in the caller's writer) the ranks exchange what failed,
rank 0 removes the partial files, and every rank raises the same CheckpointError naming
the failed ranks and the cause (:func:`failure_cause`, from the errno) — at once, not
after a timeout — and can go on training. Only a rank that dies mid-save leaves its
partial directory behind (the next save removes it).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
from typing import Callable

from zero_core.checkpoint import store
from zero_core.checkpoint.store import CheckpointError


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


class SaveJob:
    """One collective save: its paths, its phases, and the agreement all ranks reach after
    each phase (:meth:`agree`), which turns any rank's failure into the same error on every
    rank at once and removes what the save wrote."""

    def __init__(self, comm, save_dir: str, tag: str, save_latest: bool):
        self.comm, self.save_dir, self.tag, self.save_latest = comm, save_dir, tag, save_latest
        self.final = os.path.join(save_dir, tag)
        self.partial = os.path.join(save_dir, f".{tag}.partial")
        self.latest_tmp = os.path.join(save_dir, store.LATEST + ".tmp")
        self.moved = False  # rank 0: the finished directory is in place

    def run(self, prepare, write_files, index, metadata: dict) -> str:
        """The whole save on the calling thread: :meth:`begin`, :meth:`write`, :meth:`commit`."""
        self.begin(prepare)
        payload, failure = self.write(write_files, index)
        return self.commit(payload, failure, metadata)

    @contextlib.contextmanager
    def peers_failing_named(self):
        """Around the collective phases: a CheckpointError (the agreement's) passes; any
        other exception is a collective that failed — a peer died or timed out — and becomes
        a CheckpointError saying what that leaves on disk."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"saving checkpoint '{self.tag}' in {self.save_dir} failed on rank "
                f"{self.comm.rank}: a collective with the other ranks failed "
                f"({type(exc).__name__}: {exc}). Another rank probably died or stopped while "
                f"writing; the previous checkpoint and '{store.LATEST}' in {self.save_dir} "
                f"are unchanged (the unfinished .{self.tag}.partial is removed by the next "
                f"save)") from exc

    def begin(self, prepare: Callable[[], None] | None = None) -> None:
        """Collective: rank 0 creates the partial directory; every rank runs *prepare*
        (what must happen before the writes: an async save's snapshot); agreement."""
        failure = None
        if self.comm.rank == 0:
            try:
                os.makedirs(self.save_dir, exist_ok=True)
                store.remove_path(self.partial)  # left behind by a save that died
                os.makedirs(self.partial)
            except Exception as exc:
                failure = self._failure("creating the save directory", exc)
        if prepare is not None and failure is None:
            try:
                prepare()
            except Exception as exc:
                failure = self._failure("preparing its state", exc)
        self.agree(failure)

    def write(self, write_files, index) -> tuple[bytes, dict | None]:
        """This rank's files (no collective: an async save runs it on its writer thread);
        ``(payload for the metadata, failure or None)``."""
        try:
            files = {name: {"sha256": sha, "bytes": size}
                     for name, (sha, size) in write_files(self.partial).items()}
            return json.dumps({"files": files, "index": index}).encode(), None
        except Exception as exc:  # a full disk, a vanished directory, a bug: all reported
            return b"", self._failure("writing its files", exc)

    def commit(self, payload: bytes, failure: dict | None, metadata: dict) -> str:
        """Collective, after every rank's :meth:`write`: agree, rank 0 writes the metadata
        and moves the directory into place (then ``latest``), agree."""
        self.agree(failure)
        gathered = [json.loads(b) for b in store.all_gather_bytes(self.comm, payload)]
        if self.comm.rank == 0:
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
