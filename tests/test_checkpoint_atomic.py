"""Atomic saves: a rank killed (SIGKILL) halfway through writing its shard leaves the
previous checkpoint and ``latest`` intact and loadable, and the surviving rank fails with
a clear error within the communicator's timeout (ZERO_CORE_COMM_TIMEOUT, short here).

The worker (tests/workers/ckpt_train.py, action kill_save) saves tag 'good', trains two
more steps, then saves tag 'bad' with rank 1's shard writer replaced by one that writes
half of the tensors for real and then SIGKILLs its own process.
"""
from __future__ import annotations

import json
import os

import pytest

from zero_core.testing.ranks import mpirun_path, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "ckpt_train.py")
COMM = {"torchrun": "gloo", "mpirun": "mpi"}
TIMEOUT = 10.0  # s, the communicator's collective timeout in the killed job
pytestmark = pytest.mark.multirank


def launch(tasks, nprocs, launcher="torchrun", check=True, timeout_s=120):
    return run_ranks(WORKER, nprocs, launcher, args=[json.dumps(tasks)], check=check,
                     env={"ZERO_CORE_COMM": COMM[launcher],
                          "ZERO_CORE_COMM_TIMEOUT": str(timeout_s)}, timeout=300)


def check_intact_and_recover(d, good_params):
    with open(d / "latest") as fh:
        assert fh.read().strip() == "good"
    assert not (d / "bad").exists()
    assert (d / ".bad.partial").is_dir()  # the dead save's leftovers, never read
    # a new job (one rank: it reads both saved shards) loads the previous checkpoint, then
    # saves 'bad' properly, which clears the leftovers
    res = launch([["load_latest", str(d)], ["save_tag", str(d), "bad"]], 1)
    loaded, saved = res[0].report
    assert loaded["path"] == str(d / "good") and loaded["global_steps"] == 3
    assert loaded["params"] == good_params
    assert saved["path"] == str(d / "bad") and not (d / ".bad.partial").exists()
    with open(d / "latest") as fh:
        assert fh.read().strip() == "bad"


def test_rank_killed_mid_save_gloo(tmp_path):
    res = launch([["kill_save", str(tmp_path), TIMEOUT]], 2, check=False, timeout_s=TIMEOUT)
    assert res[1].returncode == -9, res[1].log[-3000:]  # SIGKILL, mid-write
    assert res[0].returncode == 3, res[0].log[-3000:]
    (outcome,) = res[0].report
    assert outcome["type"] == "CheckpointError"
    msg = outcome["error"]
    assert "checkpoint 'bad'" in msg and "unchanged" in msg and str(tmp_path) in msg, msg
    assert outcome["seconds"] < TIMEOUT + 10, outcome["seconds"]
    print(f"surviving rank failed after {outcome['seconds']:.1f} s: {msg}")
    check_intact_and_recover(tmp_path, outcome["good"])


def test_rank_hung_mid_save_times_out_gloo(tmp_path):
    # a rank that stops (SIGSTOP) instead of dying: the survivor must give up after the
    # communicator's timeout, not hang
    res = launch([["kill_save", str(tmp_path), TIMEOUT, "stop"]], 2, check=False,
                 timeout_s=TIMEOUT)
    assert res[0].returncode == 3, res[0].log[-3000:]
    assert res[1].returncode == -9  # ended by rank 0 after its report
    (outcome,) = res[0].report
    msg = outcome["error"]
    assert "checkpoint 'bad'" in msg and "unchanged" in msg and "timeout" in msg.lower(), msg
    assert TIMEOUT - 1 <= outcome["seconds"] < TIMEOUT + 10, outcome["seconds"]
    print(f"surviving rank failed after {outcome['seconds']:.1f} s: {msg}")
    check_intact_and_recover(tmp_path, outcome["good"])


@pytest.mark.skipif(mpirun_path() is None, reason="mpirun not installed: pip install 'zero-core[mpi]'")
def test_rank_killed_mid_save_mpirun(tmp_path):
    # Open MPI ends the whole job when a rank dies; what matters is what is on disk
    res = launch([["kill_save", str(tmp_path), TIMEOUT]], 2, "mpirun", check=False,
                 timeout_s=TIMEOUT)
    assert res[0].returncode not in (0, None), res[0].log[-3000:]
    with open(tmp_path / "good_params.json") as fh:  # written by rank 0 before the crash
        good = json.load(fh)
    check_intact_and_recover(tmp_path, good)
