"""Multi-rank worker for tests/test_checkpoint_save_faults.py: checkpoint saves that fail.

Usage: ``python ckpt_save_faults.py <work dir> <tmpfs mount or "">`` on every rank (2 ranks).
One engine (stage 2) runs every scenario in sequence, because a launch costs seconds:

1. train, save tag ``good`` into ``<work>/ckpt``;
2. per scenario: train a step, make the save of tag ``bad`` fail on one rank (below),
   record what every rank saw (error text, seconds, the directory's entries, ``latest``,
   whether the injected fault fired here), load ``latest`` (must be ``good``, bit-equal), train
   a step and save into ``<work>/elsewhere/<scenario>`` (must succeed and verify);
3. at the end, load the last of those saves and compare with the state that was saved.

Injected faults (:class:`Faults`) fail the OS calls the checkpoint store makes for one file
(``os.write`` after some bytes, as a filling disk does: first a short write, then ENOSPC;
``os.open`` with EACCES; the partial directory removed just before ``os.open``, so the OS
itself answers ENOENT), on the one rank that writes that file. With a tmpfs mount (made by
the test), two more scenarios meet the real file system: a disk that fills (a filler file
leaves half of what a save needs; free bytes are measured before and after), and the same
disk remounted read-only.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ckpt_train import build, global_micro, params_of, rt, train_global  # noqa: E402

from zero_core.checkpoint import store  # noqa: E402
from zero_core.checkpoint.store import CheckpointError  # noqa: E402
from zero_core.testing.ranks import leave_rank, report  # noqa: E402

#: name -> (rank that fails, rule for Faults); the rule's "file" is a name in the save
SCENARIOS = {
    "enospc_shard_rank0": (0, {"call": "write", "file": "rank_00000.safetensors",
                               "error": "ENOSPC", "after": 512}),
    "enospc_shard_rank1": (1, {"call": "write", "file": "rank_00001.safetensors",
                               "error": "ENOSPC", "after": 512}),
    "enospc_common": (0, {"call": "write", "file": "common.pt", "error": "ENOSPC",
                          "after": 512}),
    "enospc_metadata": (0, {"call": "write", "file": "metadata.json.tmp", "error": "ENOSPC",
                            "after": 100}),
    "enospc_latest": (0, {"call": "write", "file": "latest.tmp", "error": "ENOSPC",
                          "after": 1}),
    "eacces_shard_rank1": (1, {"call": "open", "file": "rank_00001.safetensors",
                               "error": "EACCES"}),
    "missing_dir_rank1": (1, {"call": "open", "file": "rank_00001.safetensors",
                              "error": "rmtree"}),
    "bug_shard_rank1": (1, {"call": "write", "file": "rank_00001.safetensors",
                            "error": "RuntimeError", "after": 512}),
    # not a file system fault: rank 0's client_state cannot be stored (checked while writing)
    "client_state_rank0": (0, None),
}


class Faults:
    """Replaces ``os.write`` / ``os.open`` in this process with versions that fail for one
    file (matched by its name, under one directory) as the rule says; everything else goes
    to the real calls. ``fired`` counts the failures made since :meth:`arm`."""

    def __init__(self):
        self.rule, self.fired, self.written = None, 0, {}
        self._write, self._open = os.write, os.open
        os.write, os.open = self.write, self.open

    def arm(self, rule: dict | None, under: str) -> None:
        self.rule = dict(rule, under=under.rstrip("/") + "/") if rule else None
        self.fired, self.written = 0, {}

    def _matches(self, path: str, call: str) -> bool:
        r = self.rule
        return (r is not None and r["call"] == call and path.startswith(r["under"])
                and os.path.basename(path) == r["file"])

    def write(self, fd, data):
        if self.rule is None or self.rule["call"] != "write":
            return self._write(fd, data)
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return self._write(fd, data)
        if not self._matches(path, "write"):
            return self._write(fd, data)
        done = self.written.get(path, 0)
        room = self.rule["after"] - done
        if room <= 0:
            self.fired += 1
            if self.rule["error"] == "RuntimeError":
                raise RuntimeError("injected: a bug in the middle of writing a shard")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self._write(fd, memoryview(data).cast("B")[:room])  # a short write, as a full disk
        self.written[path] = done + n
        return n

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        if self._matches(os.fspath(path), "open"):
            self.fired += 1
            if self.rule["error"] == "EACCES":
                raise OSError(errno.EACCES, os.strerror(errno.EACCES), path)
            remove_dir(os.path.dirname(path))  # then the OS answers ENOENT itself
        return self._open(path, flags, mode, dir_fd=dir_fd)


def remove_dir(path: str, tries: int = 200) -> None:
    """rmtree *path*, again while another rank is creating its own file in it (rmtree
    then meets a directory that is not empty any more: ENOTEMPTY)."""
    for _ in range(tries):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
            time.sleep(0.01)
    raise RuntimeError(f"could not remove {path}: other ranks kept writing into it")


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def read_latest(directory: str) -> str | None:
    path = os.path.join(directory, store.LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return fh.read().strip()


def max_diff(a: dict, b: dict) -> float:
    return max(max((abs(x - y) for x, y in zip(a[n], b[n])), default=0.0) for n in a)


def verified(tag_dir: str) -> bool:
    """Every file of the checkpoint in *tag_dir* is present with its size and SHA-256."""
    tag_dir, meta = store.read_metadata(tag_dir)
    for name in meta["files"]:
        store.verify_file(tag_dir, name, meta)
    return sorted([*meta["files"], store.METADATA]) == sorted(os.listdir(tag_dir))


class Run:
    """The engine and the directories every scenario works with."""

    def __init__(self, work: str):
        self.work = work
        self.faults = Faults()
        _, self.engine = build(2, micro=global_micro())
        self.comm = rt().comm
        self.last_saved = None  # (directory, parameters) of the latest successful save

    def save_good(self, directory: str) -> dict:
        train_global(self.engine, 2)
        self.engine.save_checkpoint(directory, tag="good")
        return params_of(self.engine)

    def failing_save(self, name: str, directory: str, good: dict, fail_rank: int | None,
                     rule: dict | None, client_state=None, before=None) -> dict:
        """Train a step, save 'bad' into *directory* with the fault armed on *fail_rank*,
        then check the aftermath (see the module docstring); what this rank saw."""
        train_global(self.engine, 1)
        entries = sorted(os.listdir(directory))
        if before is not None:
            before()
        self.comm.barrier()
        free_before = free_bytes(directory)
        self.faults.arm(rule if self.comm.rank == fail_rank else None, directory)
        t0 = time.monotonic()
        try:
            self.engine.save_checkpoint(directory, tag="bad", client_state=client_state)
            out = {"error": None}
        except CheckpointError as exc:
            out = {"error": str(exc), "type": type(exc).__name__}
        out["seconds"] = time.monotonic() - t0
        out.update(fired=self.faults.fired, free_before=free_before,
                   free_after=free_bytes(directory))
        self.faults.arm(None, directory)
        out.update(entries_before=entries, entries_after=sorted(os.listdir(directory)),
                   latest=read_latest(directory))
        out.update(self.recover(name, directory, good))
        return out

    def recover(self, name: str, directory: str, good: dict) -> dict:
        """Load ``latest`` from *directory*, train a step, save elsewhere."""
        path, _ = self.engine.load_checkpoint(directory)
        out = {"loaded": path, "loaded_diff": max_diff(params_of(self.engine), good)}
        train_global(self.engine, 1)
        elsewhere = os.path.join(self.work, "elsewhere", name)
        saved = self.engine.save_checkpoint(elsewhere, tag="after")
        self.last_saved = (elsewhere, params_of(self.engine))
        out.update(saved_elsewhere=saved, verified=verified(saved),
                   latest_elsewhere=read_latest(elsewhere))
        return out

    def final_check(self) -> dict:
        """The last save made after a failure loads back bit-equal."""
        directory, params = self.last_saved
        train_global(self.engine, 1)  # move away from the saved state first
        path, _ = self.engine.load_checkpoint(directory)
        return {"path": path, "diff": max_diff(params_of(self.engine), params)}

    def real_disk(self, mount: str) -> dict:
        """A tmpfs that fills during a save, then the same tmpfs read-only."""
        directory = os.path.join(mount, "ckpt")
        free0 = free_bytes(mount)
        good = self.save_good(directory)
        needed = free0 - free_bytes(mount)  # what one save takes on this file system
        filler = os.path.join(mount, "filler")

        def fill():  # rank 0: leave half of what a save needs
            if self.comm.rank == 0:
                fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    os.posix_fallocate(fd, 0, free_bytes(mount) - needed // 2)
                finally:
                    os.close(fd)

        full = self.failing_save("tmpfs_full", directory, good, None, None, before=fill)
        full["save_bytes"] = needed
        self.comm.barrier()
        if self.comm.rank == 0:
            os.remove(filler)

        def remount_ro():
            if self.comm.rank == 0:
                subprocess.run(["mount", "-o", "remount,ro", mount], check=True,
                               capture_output=True, text=True)

        readonly = self.failing_save("tmpfs_readonly", directory, good, None, None,
                                     before=remount_ro)
        self.comm.barrier()
        if self.comm.rank == 0:
            subprocess.run(["mount", "-o", "remount,rw", mount], check=True)
        self.comm.barrier()
        return {"full": full, "readonly": readonly}


def main():
    work, mount = sys.argv[1], sys.argv[2]
    run = Run(work)
    directory = os.path.join(work, "ckpt")
    good = run.save_good(directory)
    results = {"scenarios": {}}
    for name, (fail_rank, rule) in SCENARIOS.items():
        client_state = {"object": object()} if rule is None else None
        results["scenarios"][name] = run.failing_save(name, directory, good, fail_rank, rule,
                                                      client_state=client_state)
    results["final"] = run.final_check()
    if mount:
        results["real_disk"] = run.real_disk(mount)
    report(results)
    run.engine.destroy()
    leave_rank()


if __name__ == "__main__":
    main()
