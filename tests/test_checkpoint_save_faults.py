"""Checkpoint saves that fail on one rank (disk full, permission, missing directory, a bug):
every rank raises the same CheckpointError naming the failed rank and the real cause within
seconds (the communicator's timeout is 60 s here), the partial files are gone, ``latest``
and the previous checkpoint are unchanged, and every rank trains on and saves elsewhere.

Real processes, 2 ranks, one launch per backend (gloo under torchrun, MPI under mpirun)
running every scenario of tests/workers/ckpt_save_faults.py in sequence. Disk-full faults
are injected at the OS-call level on the one rank that writes the file (each file of a
save in turn); one scenario fills a real tmpfs and one remounts it read-only, when this
process may mount one (as root, where mounting is permitted; skipped with the reason
otherwise — the injected scenarios cover the same code everywhere).
"""
from __future__ import annotations

import os
import subprocess

import pytest

from zero_core.testing.ranks import mpirun_path, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "ckpt_save_faults.py")
COMM = {"torchrun": "gloo", "mpirun": "mpi"}
COMM_TIMEOUT = 60  # s: an answer within FAST proves nobody waited for a timeout
FAST = 10.0
TMPFS_SIZE = 8 << 20  # bytes; a save of the workers' model takes a few dozen KiB
pytestmark = pytest.mark.multirank

#: scenario -> (failed rank, cause in the message, where the message says it happened)
EXPECTED = {
    "enospc_shard_rank0": (0, "disk full (ENOSPC)", "rank_00000.safetensors"),
    "enospc_shard_rank1": (1, "disk full (ENOSPC)", "rank_00001.safetensors"),
    "enospc_common": (0, "disk full (ENOSPC)", "common.pt"),
    "enospc_metadata": (0, "disk full (ENOSPC)", "metadata.json.tmp"),
    "enospc_latest": (0, "disk full (ENOSPC)", "latest.tmp"),
    "eacces_shard_rank1": (1, "permission denied / read-only file system (EACCES)",
                           "rank_00001.safetensors"),
    "missing_dir_rank1": (1, "directory missing (ENOENT)", "rank_00001.safetensors"),
    "bug_shard_rank1": (1, "RuntimeError: injected: a bug in the middle of writing a shard",
                        "not the file system's"),
    "client_state_rank0": (0, "CheckpointError: client_state['object'] is a builtins.object",
                           "not the file system's"),
}


def _mount_tmpfs(path) -> str | None:
    """Mount a tmpfs at *path*; None if done, else why not."""
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs",
                               str(path)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run mount: {exc}"
    if done.returncode:
        return f"mount -t tmpfs is not permitted here: {done.stderr.strip() or done.returncode}"
    return None


@pytest.fixture(scope="module", params=[
    "torchrun", pytest.param("mpirun", marks=pytest.mark.skipif(
        mpirun_path() is None, reason="mpirun not installed: pip install 'zero-core[mpi]'"))])
def job(request, tmp_path_factory):
    """One 2-rank launch per backend: launcher, work dir, tmpfs mount point, each rank's
    report, and why there is no tmpfs (None when there is)."""
    launcher = request.param
    work = tmp_path_factory.mktemp(f"save_faults_{launcher}")
    mount = tmp_path_factory.mktemp(f"save_faults_tmpfs_{launcher}")
    no_tmpfs = _mount_tmpfs(mount)
    try:
        res = run_ranks(WORKER, 2, launcher, args=[str(work), "" if no_tmpfs else str(mount)],
                        env={"ZERO_CORE_COMM": COMM[launcher],
                             "ZERO_CORE_COMM_TIMEOUT": str(COMM_TIMEOUT)}, timeout=240)
    finally:
        if not no_tmpfs:
            subprocess.run(["umount", str(mount)], check=True, timeout=30)
    return {"launcher": launcher, "work": work, "mount": mount,
            "reports": [r.report for r in res], "no_tmpfs": no_tmpfs}


def check_failed_save(outcomes: list, directory, fail_rank: int | None, cause: str,
                      where: str) -> str:
    """The same error on both ranks, fast, naming *fail_rank* (None: either) and *cause*;
    the directory as before; ``latest`` and the previous checkpoint intact; the save
    elsewhere done. Returns the error's text."""
    text = outcomes[0]["error"]
    assert text is not None, "the save did not fail"
    for r, out in enumerate(outcomes):
        assert out["type"] == "CheckpointError", out
        assert out["error"] == text, f"rank {r} said something else:\n{out['error']}\n{text}"
        assert out["seconds"] < FAST, (r, out["seconds"], text)
        assert out["entries_after"] == out["entries_before"], (r, out, text)
        assert out["latest"] == "good", out
        assert out["loaded"] == str(directory / "good") and out["loaded_diff"] == 0.0, out
        assert out["verified"] and out["latest_elsewhere"] == "after", out
    assert f"saving checkpoint 'bad' in {directory} failed on " in text, text
    ranks = range(2) if fail_rank is None else [fail_rank]
    assert any(f"rank {r}, " in text for r in ranks) and cause in text, text
    assert where in text, text
    assert (f"The save's partial files ({directory / '.bad.partial'}) are gone; the previous "
            f"checkpoint and 'latest' in {directory} are unchanged") in text, text
    return text


def test_every_file_of_a_save_failing_on_one_rank(job):
    directory, reports = job["work"] / "ckpt", job["reports"]
    for name, (fail_rank, cause, where) in EXPECTED.items():
        outcomes = [rep["scenarios"][name] for rep in reports]
        text = check_failed_save(outcomes, directory, fail_rank, cause, where)
        if name != "client_state_rank0":  # a fault was injected: on the failing rank only
            assert [o["fired"] > 0 for o in outcomes] == [r == fail_rank for r in range(2)], \
                (name, [o["fired"] for o in outcomes])
        print(f"{job['launcher']} {name}: {outcomes[0]['seconds']:.2f} s: {text}")
    last = job["work"] / "elsewhere" / list(EXPECTED)[-1] / "after"
    for rep in reports:  # the last save after a failure loads back as it was saved
        assert rep["final"] == {"path": str(last), "diff": 0.0}, rep["final"]


def test_a_real_full_then_read_only_disk(job):
    if job["no_tmpfs"]:
        pytest.skip(f"{job['no_tmpfs']} (the injected disk-full scenarios ran)")
    directory, reports = job["mount"] / "ckpt", job["reports"]
    full = [rep["real_disk"]["full"] for rep in reports]
    text = check_failed_save(full, directory, None, "disk full (ENOSPC)", str(directory))
    for out in full:  # every byte the failed save took is free again
        assert out["free_before"] < out["save_bytes"], out  # the save could not fit
        assert out["free_after"] == out["free_before"], out
    print(f"{job['launcher']} tmpfs full: {text}")
    readonly = [rep["real_disk"]["readonly"] for rep in reports]
    text = check_failed_save(readonly, directory, 0,
                             "permission denied / read-only file system (EROFS)",
                             f"Read-only file system: {directory / '.bad.partial'}")
    assert "rank 0, creating the save directory" in text, text
    print(f"{job['launcher']} tmpfs read-only: {text}")
