"""Per-rank swap directories and their removal.

Each rank swaps into its own directory ``<nvme_path>/zero_core_offload.<host>.rank<r>.pid<p>``
(one per process, shared by the optimizer and parameter stores). Swap files are useless
after the process ends, and at ZeRO-Infinity sizes they fill a disk, so they are removed:

* at interpreter exit (``atexit``: a normal end, ``sys.exit`` and an unhandled exception);
* on SIGTERM (what mpirun and torchrun send the other ranks when one fails), when no
  other handler is installed: the directories are removed, then the default action runs;
* by :func:`remove` (the engine's ``destroy``);
* after a SIGKILL nothing can run, so the next process that creates a directory under the
  same ``nvme_path`` removes those left by processes of this host that no longer exist.
"""
from __future__ import annotations

import atexit
import itertools
import errno
import os
import shutil
import signal
import socket
import threading

from zero_core.offload.errors import OffloadError, io_failure

PREFIX = "zero_core_offload."
_lock = threading.Lock()
_dirs: dict[str, str] = {}       # realpath(nvme_path) -> this process's directory
_installed = False
_instances = itertools.count()


def _host() -> str:
    return socket.gethostname().replace(".", "_") or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(base: str) -> list[str]:
    """Remove directories under *base* left by dead processes of this host."""
    removed = []
    mine = f"{PREFIX}{_host()}."
    try:
        entries = os.listdir(base)
    except OSError:
        return removed
    for name in entries:
        if not name.startswith(mine) or ".pid" not in name:
            continue
        try:
            pid = int(name.rsplit(".pid", 1)[1])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed.append(name)
    return removed


def check_nvme_path(nvme_path: str, key: str) -> str:
    """The absolute *nvme_path* after checking it is an existing directory; *key* is the
    config key that named it (for the message)."""
    if not nvme_path:
        raise OffloadError(f"{key} is empty: name a directory on a fast local disk")
    path = os.path.abspath(os.path.expanduser(nvme_path))
    if not os.path.exists(path):
        raise OffloadError(f"{key} = {nvme_path!r}: the directory {path} does not exist. "
                           f"Create it (mkdir -p {path}) on a fast local disk, or fix the "
                           f"path; zero-core does not create it, so that a typo cannot fill "
                           f"another disk")
    if not os.path.isdir(path):
        raise OffloadError(f"{key} = {nvme_path!r}: {path} is not a directory; name a "
                           f"directory on a fast local disk")
    return path


def rank_directory(nvme_path: str, rank: int, key: str) -> str:
    """This process's swap directory under *nvme_path* (created on first use, removed at
    exit). Raises OffloadError naming the path if it cannot be created."""
    base = check_nvme_path(nvme_path, key)
    real = os.path.realpath(base)
    with _lock:
        if real in _dirs and os.path.isdir(_dirs[real]):
            return _dirs[real]
        _remove_stale(base)
        path = os.path.join(base, f"{PREFIX}{_host()}.rank{rank}.pid{os.getpid()}")
        try:
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, ".probe")
            with open(probe, "wb") as fh:
                fh.write(b"x")
            os.unlink(probe)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise OffloadError(
                    f"{key} = {nvme_path!r}: cannot create swap files in {base} "
                    f"({exc.strerror}). Make the directory writable for this user, or point "
                    f"{key} at a writable directory on a fast local disk") from None
            raise io_failure(path, "creating the swap directory", exc) from None
        _dirs[real] = path
        _install()
        return path


def unique_prefix(kind: str) -> str:
    """A file-name prefix no other store of this process uses (several engines may share
    one directory), e.g. ``"optimizer3."``."""
    return f"{kind}{next(_instances)}."


def remove(path: str) -> None:
    """Remove one swap directory now (no-op if already gone)."""
    with _lock:
        for key, value in list(_dirs.items()):
            if value == path:
                del _dirs[key]
    shutil.rmtree(path, ignore_errors=True)


def remove_all() -> None:
    """Remove every swap directory of this process."""
    with _lock:
        paths = list(_dirs.values())
        _dirs.clear()
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def registered() -> list[str]:
    """The swap directories this process will remove at exit."""
    with _lock:
        return list(_dirs.values())


def _on_sigterm(signum, frame):
    remove_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(remove_all)
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):
            pass  # not allowed here (embedded interpreter): atexit still runs
