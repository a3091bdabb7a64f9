"""The failure report: a multi-rank job prints an uncaught error once, not once per rank.

Without it, an error every rank raises (a config error, the ranks' agreement check, a
failed checkpoint save) is printed by every rank with its full traceback, followed by the
launcher's banner, and the one useful line is buried. :func:`install_failure_report`
(called first thing by ``zero_core.initialize`` and by ``init_distributed``) replaces
``sys.excepthook`` in a process that a launcher started with world size > 1, chaining to
the hook it found. For an uncaught exception on rank r:

* **A peer's failure seen from here** (a ``CommTimeoutError``; gloo's "Connection closed /
  reset by peer"; MPI's process-failure errors) is a consequence, not a cause: one line,
  ``zero-core: rank r stopped: a peer rank failed (<short reason>)``.
* **Anything else** is keyed by its type and message text. The first rank on this node to
  claim the key prints it in full: ``zero-core: rank r failed: <Type>: <message>`` and then,
  for a :class:`~zero_core.errors.ZeroCoreError` (a message written for users), only where
  the user's code called in (``raised from train.py:42 in main``) and its causes; for any
  other exception (a bug, or the user's own error) the full traceback. Every other rank
  with the same key prints one line pointing at that rank.

The claim is a marker file per (job, key) in ``<tempdir>/zero-core-failures-<uid>/<job
id>/``, made atomically with ``os.link`` (which, like ``O_CREAT|O_EXCL``, fails if the file
exists, and publishes the writer's rank and time complete). Markers are a few bytes, made
only when a job fails, and directories older than a day are pruned when a new one is made.
Each node has its own temporary directory, so a multi-node job prints an error once per
node. The job id comes from the launcher (:func:`job_id`); a marker older than
:data:`FRESH_S` is from an earlier job that had the same id and is taken over.

``ZERO_CORE_DEBUG=1`` leaves Python's behaviour: every rank prints its traceback. The hook
never raises: whatever goes wrong inside it, the previous hook prints the exception. The
exit status stays Python's (1).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
import traceback

from zero_core.errors import CommTimeoutError, ConfigError, ZeroCoreError
from zero_core.runtime.launch import LaunchInfo, discover, env_flag

__all__ = ["install_failure_report", "FailureReport", "job_id", "failure_key",
           "peer_failure_reason", "user_location", "marker_root", "DEBUG_ENV", "FRESH_S"]

DEBUG_ENV = "ZERO_CORE_DEBUG"
#: seconds within which ranks of one job raise the same error (they raise it together:
#: agreed in a collective, or at start-up); an older marker is an earlier job's
FRESH_S = 60.0
_PRUNE_AFTER_S = 86400.0
_REASON_CHARS = 500  # a peer failure's reason is one line; backends' messages can be long

# what backends say when the rank at the other end is gone: gloo's TCP pairs, MPI (ULFM)
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                        r"MPI_ERR_PROC_FAILED|MPI_ERR_REVOKED|PROC_FAILED")

_hook: "FailureReport | None" = None


def install_failure_report() -> None:
    """Report uncaught errors once per job (see the module docstring). Idempotent; does
    nothing without a launcher, for a world size of 1, or with ``ZERO_CORE_DEBUG=1``."""
    global _hook
    if _hook is not None or env_flag(DEBUG_ENV):
        return
    try:
        launch = discover()
    except ConfigError:
        # inconsistent launch variables: initialize() raises this error itself next, and
        # with no trustworthy rank there is nothing to report it under
        return
    if launch.launcher == "single" or launch.world_size <= 1:
        return
    _hook = FailureReport(launch, job_id(launch), sys.excepthook)
    sys.excepthook = _hook


def job_id(launch: LaunchInfo, env: dict | None = None) -> str | None:
    """A name for the job that every rank on this node shares and a later job does not:
    what the launcher exports (Open MPI 5 / PMIx: ``PMIX_NAMESPACE``, which holds mpirun's
    pid; Open MPI 4: ``OMPI_MCA_ess_base_jobid``; torchrun: the run id with the agent's pid,
    the workers' parent, and the restart count; Slurm: job and step), else the parent
    process with its start time (MPICH's hydra proxy starts every rank on the node).
    None when nothing identifies the job: then every rank prints its error in full."""
    env = os.environ if env is None else env
    name = None
    if launch.launcher == "torchrun":
        if "TORCHELASTIC_RUN_ID" in env:
            # the run id is "none" unless --rdzv-id/--standalone set it, hence the agent's pid
            name = (f"torchrun-{env['TORCHELASTIC_RUN_ID']}-{os.getppid()}-"
                    f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        elif env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
            name = f"torch-{env['MASTER_ADDR']}-{env['MASTER_PORT']}"
    elif launch.launcher in ("openmpi", "pmix") and (env.get("OMPI_MCA_ess_base_jobid")
                                                      or env.get("PMIX_NAMESPACE")):
        name = f"mpi-{env.get('OMPI_MCA_ess_base_jobid') or env['PMIX_NAMESPACE']}"
    elif env.get("SLURM_JOB_ID"):
        name = f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '0')}"
    if name is None:
        started = _process_start(os.getppid())
        if started is None:
            return None
        name = f"{launch.launcher}-parent-{os.getppid()}-{started}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:120]


def _process_start(pid: int) -> str | None:
    """The start time of process *pid* in clock ticks since boot (Linux), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # "pid (comm) state ..."; comm may hold spaces, the start time is field 22
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def failure_key(exc: BaseException) -> str:
    """Errors with the same type and text are the same error, whichever rank raised them."""
    text = f"{type(exc).__module__}.{type(exc).__qualname__}\n{exc}"
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:32]


def peer_failure_reason(exc: BaseException) -> str | None:
    """The short reason when *exc* only says that a peer rank died or stopped, else None."""
    seen = set()
    link = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, CommTimeoutError) or _PEER_GONE.search(str(link)):
            return _one_line(exc)
        link = link.__cause__ or link.__context__
    return None


def _type_name(exc: BaseException) -> str:
    return type(exc).__qualname__


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > _REASON_CHARS:
        text = text[:_REASON_CHARS - 3] + "..."
    return f"{_type_name(exc)}: {text}" if text else _type_name(exc)


def _headline(exc: BaseException) -> str:
    text = str(exc)
    return f"{_type_name(exc)}: {text}" if text else _type_name(exc)


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get("stdlib"), paths.get("platstdlib")}
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


def _is_library_frame(module: str, filename: str, stdlib: tuple[str, ...]) -> bool:
    if module.split(".")[0] in ("zero_core", "torch") or filename.startswith("<"):
        return True
    return os.path.realpath(filename).startswith(stdlib)


def user_location(tb) -> str | None:
    """``file:line in function`` of the innermost frame of *tb* in the user's code: not
    zero-core, torch or the standard library, and preferably not an installed package
    (a framework calling zero-core for the user); None when there is none."""
    frames = []
    while tb is not None:
        frame = tb.tb_frame
        frames.append((frame.f_globals.get("__name__") or "", frame.f_code.co_filename,
                       tb.tb_lineno, frame.f_code.co_name))
        tb = tb.tb_next
    stdlib = _library_dirs()
    candidates = [f for f in reversed(frames) if not _is_library_frame(f[0], f[1], stdlib)]
    own = [f for f in candidates if not re.search(r"[/\\](site|dist)-packages[/\\]", f[1])]
    if not (own or candidates):
        return None
    _, filename, lineno, function = (own or candidates)[0]
    shown = os.path.relpath(filename) if os.path.isabs(filename) else filename
    if shown.startswith(".."):
        shown = filename
    return f"{shown}:{lineno} in {function}"


def marker_root() -> str:
    """Where the marker directories live: ``<tempdir>/zero-core-failures-<uid>`` (per user,
    so that users sharing a node cannot block or spoof each other's markers)."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"zero-core-failures-{uid}")


class FailureReport:
    """The ``sys.excepthook`` of one rank (installed by :func:`install_failure_report`)."""

    def __init__(self, launch: LaunchInfo, job: str | None, previous):
        self.rank = launch.rank
        self.job = job
        self.previous = previous

    def __call__(self, exc_type, exc, tb) -> None:
        try:
            if env_flag(DEBUG_ENV, strict=False):
                self.previous(exc_type, exc, tb)
                return
            text = self.render(exc_type, exc, tb)
        except BaseException:  # never fail inside the hook: Python's own report instead
            self.previous(exc_type, exc, tb)
            return
        sys.stderr.write(text)  # one write: ranks sharing a terminal interleave less
        sys.stderr.flush()

    def render(self, exc_type, exc, tb) -> str:
        """What this rank prints for *exc* (claiming the job's marker if it is first)."""
        if exc is None:
            exc = exc_type()
        reason = peer_failure_reason(exc)
        if reason is not None:
            return f"zero-core: rank {self.rank} stopped: a peer rank failed ({reason})\n"
        printed_by = self.claim(failure_key(exc))
        if printed_by is not None:
            return (f"zero-core: rank {self.rank}: same error as rank {printed_by} (printed "
                    f"by that rank; {DEBUG_ENV}=1 prints every rank's traceback)\n")
        lines = [f"zero-core: rank {self.rank} failed: {_headline(exc)}\n"]
        if isinstance(exc, ZeroCoreError):
            where = user_location(tb)
            if where is not None:
                lines.append(f"  raised from {where}\n")
            cause, depth = exc.__cause__, 0
            while cause is not None and depth < 5:
                lines.append(f"  caused by {_headline(cause)}\n")
                cause, depth = cause.__cause__, depth + 1
        else:
            lines.extend(traceback.format_exception(exc_type, exc, tb))
        return "".join(lines)

    def claim(self, key: str) -> int | None:
        """None when this rank is the first on the node with error *key* (it now owns the
        marker and prints the error); else the rank that printed it. Also None when no
        marker can be made: printing an error twice is better than not at all."""
        job_dir = self._job_dir()
        if job_dir is None:
            return None
        marker = os.path.join(job_dir, key)
        draft = os.path.join(job_dir, f".{key}.{os.getpid()}")
        try:
            with open(draft, "w") as fh:
                fh.write(f"{self.rank} {time.time():.3f}\n")
            try:
                os.link(draft, marker)  # atomic, fails if it exists; content already whole
                return None
            except FileExistsError:
                pass
            owner = _read_marker(marker)
            if owner is not None:
                return owner
            os.replace(draft, marker)  # an earlier job's (or unreadable): ours from now on
            return None
        except OSError:
            return None
        finally:
            try:
                os.unlink(draft)
            except OSError:
                pass

    def _job_dir(self) -> str | None:
        if self.job is None:
            return None
        root = marker_root()
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
            if hasattr(os, "getuid") and os.stat(root).st_uid != os.getuid():
                return None  # someone else's directory: do not trust its markers
            job_dir = os.path.join(root, self.job)
            try:
                os.mkdir(job_dir)
            except FileExistsError:
                return job_dir
            _prune(root, keep=self.job)
            return job_dir
        except OSError:
            return None


def _read_marker(path: str) -> int | None:
    """The rank in a marker written within :data:`FRESH_S`; None if it is older or garbled."""
    try:
        with open(path) as fh:
            rank, stamp = fh.read().split()
        if time.time() - float(stamp) <= FRESH_S:
            return int(rank)
    except (OSError, ValueError):
        pass
    return None


def _prune(root: str, keep: str) -> None:
    """Remove job directories of failures more than a day old (best effort)."""
    cutoff = time.time() - _PRUNE_AFTER_S
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.name != keep and entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            pass
