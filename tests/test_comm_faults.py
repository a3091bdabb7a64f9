"""Faults: dead ranks, hung ranks, missing mpi4py, dtypes a backend cannot carry.

The collective timeout is 5 s here (ZERO_CORE_COMM_TIMEOUT); a rank that dies or stops
must never make the job hang.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "comm_faults.py")
TIMEOUT_ENV = {"ZERO_CORE_COMM_TIMEOUT": "5"}


def _run(backend, mode, nprocs, launcher):
    start = time.monotonic()
    results = run_ranks(WORKER, nprocs, launcher=launcher, args=[backend, mode],
                        env=TIMEOUT_ENV, timeout=120, check=False)
    return results, time.monotonic() - start


@pytest.mark.multirank
@pytest.mark.parametrize("nprocs", [2, 4])
def test_gloo_dead_rank_stops_the_others_with_a_named_error(nprocs):
    results, _ = _run("gloo", "die", nprocs, "torchrun")
    assert results[-1].returncode == -9  # the rank that killed itself
    for r in results[:-1]:
        rep = r.report
        assert r.returncode == 0 and rep is not None, r.log[-3000:]
        assert rep["error"] and "all_reduce" in rep["error"]
        assert f"group 'world' (ranks {list(range(nprocs))})" in rep["error"]
        assert rep["seconds"] < 5 + 2  # within the timeout (a reset peer is seen at once)


@pytest.mark.multirank
def test_gloo_hung_rank_times_out_with_a_named_error():
    results, _ = _run("gloo", "hang", 2, "torchrun")
    rep = results[0].report
    assert rep is not None, results[0].log[-3000:]
    assert rep["type"] == "CommTimeoutError"
    assert "all_reduce on group 'world' (ranks [0, 1]) did not finish within 5 s" in rep["error"]
    assert "ZERO_CORE_COMM_TIMEOUT" in rep["error"]  # says how to raise it
    assert 4.5 < rep["seconds"] < 10


@pytest.mark.multirank
def test_mpi_dead_rank_ends_the_job_with_mpiruns_message():
    """Open MPI's launcher notices a rank killed by a signal and terminates the job."""
    results, elapsed = _run("mpi", "die", 2, "mpirun")
    log = results[0].log
    assert results[0].returncode not in (0, None), log[-3000:]
    assert "process rank 1" in log and "signal 9" in log
    assert elapsed < 60


@pytest.mark.multirank
def test_mpi_hung_rank_raises_a_timeout_and_the_job_ends():
    """The waiting rank raises CommTimeoutError naming the collective and the group; the
    uncaught error must end the job (MPI_Abort from the exit hook), not hang it."""
    results, elapsed = _run("mpi", "hang", 2, "mpirun")
    log = results[0].log
    assert results[0].returncode not in (0, None), log[-3000:]
    assert ("CommTimeoutError: all_reduce on group 'world' (ranks [0, 1]) did not finish "
            "within 5 s") in log
    assert "calling MPI_Abort" in log
    assert elapsed < 60


@pytest.mark.multirank
@pytest.mark.parametrize("backend, launcher", [("gloo", "torchrun"), ("mpi", "mpirun")])
def test_a_timed_out_wait_can_be_retried_when_the_peer_is_only_late(backend, launcher):
    """gloo's Work.wait(timeout) raises "Operation timed out!" but keeps the work; MPI's
    worker keeps running the call: the handle reports CommTimeoutError, and a second wait
    completes with the right result."""
    results, _ = _run(backend, "late", 2, launcher)
    reps = [r.report for r in results]
    assert all(rep is not None for rep in reps), results[0].log[-3000:]
    assert reps[0]["first"]["type"] == "CommTimeoutError"
    assert "all_reduce on group 'world'" in reps[0]["first"]["error"]
    assert reps[0]["ok"] and reps[1]["ok"]


@pytest.mark.multirank
@pytest.mark.parametrize("backend, launcher", [("gloo", "torchrun"), ("mpi", "mpirun")])
def test_uncarriable_dtypes_fail_before_anything_is_sent(backend, launcher):
    results, _ = _run(backend, "dtype", 2, launcher)
    reps = [r.report for r in results]
    assert all(rep is not None for rep in reps), results[0].log[-3000:]
    refused = dict(reps[0]["refused"])
    assert set(refused) == {"all_reduce bool", "all_reduce complex", "all_reduce int avg",
                            "reduce_scatter int8 avg", "all_gather bool"}
    for label, message in refused.items():
        assert message, f"{label} was not refused"
    assert "cannot carry dtype torch.bool" in refused["all_reduce bool"]
    assert "convert" in refused["all_reduce bool"]
    assert "op='avg' needs a floating-point tensor" in refused["all_reduce int avg"]
    # nothing reached the wire: the next collective still matched on every rank
    assert all(rep["after_ok"] for rep in reps)


_BLOCK_MPI4PY = """
import sys
sys.modules["mpi4py"] = None          # as if mpi4py were not installed
sys.modules["mpi4py.MPI"] = None
from zero_core.runtime import registry
from zero_core.backends.comm.mpi import MpiCommunicator
from zero_core.errors import BackendUnavailable
from zero_core.runtime.launch import LaunchInfo
from zero_core.runtime.topology import Topology
ok, why = MpiCommunicator.availability()
print("AVAILABLE", ok, why)
try:
    MpiCommunicator(LaunchInfo(0, 1, 0, 1, "single"), Topology(1, 1))
    print("CONSTRUCTED")
except BackendUnavailable as exc:
    print("CONSTRUCT", exc)
try:
    registry.load().communicator_class("mpi")
    print("SELECTED")
except BackendUnavailable as exc:
    print("SELECT", exc)
"""


def test_missing_mpi4py_says_how_to_install_it():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    out = subprocess.run([sys.executable, "-c", _BLOCK_MPI4PY], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split(" ", 1)[0]: line for line in out.stdout.splitlines()}
    hint = "pip install 'zero-core[mpi]'"
    assert lines["AVAILABLE"].startswith("AVAILABLE False") and hint in lines["AVAILABLE"]
    assert "CONSTRUCT" in lines and hint in lines["CONSTRUCT"]
    assert "SELECT" in lines and hint in lines["SELECT"] and "'mpi'" in lines["SELECT"]
