"""Offload faults: a full disk, a file-size limit, a missing or unwritable nvme_path, a
truncated or corrupted swap file — each a clear OffloadError naming the path and the
fix, never silently wrong values — and the swap directories removed at exit, on an
exception, on SIGTERM, and (after a SIGKILL) by the next run.

Each scenario runs tests/workers/offload_faults.py in its own process (a single rank),
because what is tested includes what happens when that process ends.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "offload_faults.py")


def run(scenario: str, path: str, timeout: float = 180):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-W", "ignore", WORKER, scenario, str(path)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout
    res = dirs = None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
        if line.startswith("DIRS "):
            dirs = json.loads(line[5:])
    return proc, res, dirs


def leftovers(path) -> list:
    return [n for n in os.listdir(path) if n.startswith("zero_core_offload.")]


def test_no_fault_trains_and_removes_its_directory(tmp_path):
    proc, res, _ = run("train", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert res["error"] is None and res["offload"]["bytes_written"] > 0
    assert len(res["dirs"]) == 1 and res["dirs"][0].startswith(str(tmp_path))
    assert leftovers(tmp_path) == []


def mount_tmpfs(where, options: str):
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs to simulate the disk (needs root/CAP_SYS_ADMIN): "
                    f"{done.stderr}")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs: smaller than one state file of the worker's model (~270 KB)."""
    mnt = tmp_path / "small_disk"
    mount_tmpfs(mnt, "size=256k")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only file system: unwritable even for root (who ignores permissions)."""
    mnt = tmp_path / "read_only"
    mount_tmpfs(mnt, "ro,size=64k")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_is_a_clear_error_and_leaves_nothing(small_tmpfs):
    proc, res, _ = run("full", small_tmpfs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    msg = res["error"]
    assert res["type"] == "OffloadError"
    assert str(small_tmpfs) in msg and "full" in msg and "nvme_path" in msg, msg
    assert "errno 28" in msg   # ENOSPC
    assert leftovers(small_tmpfs) == []


def test_file_size_limit_is_a_clear_error(tmp_path):
    proc, res, _ = run("fsize", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    msg = res["error"]
    assert str(tmp_path) in msg and "RLIMIT_FSIZE" in msg and "errno 27" in msg, msg
    assert leftovers(tmp_path) == []


def test_missing_nvme_path_names_it_and_is_not_created(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    proc, res, _ = run("missing", missing)
    msg = res["error"]
    assert "zero_optimization.offload_optimizer.nvme_path" in msg and str(missing) in msg
    assert "does not exist" in msg and "mkdir -p" in msg
    assert not (tmp_path / "no").exists()


def test_nvme_path_that_is_a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    proc, res, _ = run("not_dir", f)
    assert "is not a directory" in res["error"] and str(f) in res["error"]


def test_unwritable_nvme_path(read_only_dir):
    proc, res, _ = run("unwritable", read_only_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    msg = res["error"]
    assert "cannot create swap files" in msg and str(read_only_dir) in msg, msg
    assert "writable" in msg and "read-only" in msg.lower() or "Read-only" in msg, msg


@pytest.mark.parametrize("scenario,word", [("truncate", "truncated"), ("corrupt", "corrupted"),
                                           ("param_truncate", "truncated")])
def test_damaged_swap_file_is_detected_on_read(tmp_path, scenario, word):
    proc, res, _ = run(scenario, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    msg = res["error"]
    assert msg is not None, "a damaged swap file was read without an error"
    assert word in msg and ".swap" in msg and str(tmp_path) in msg and "checkpoint" in msg
    assert leftovers(tmp_path) == []


def test_directory_removed_when_the_script_raises(tmp_path):
    proc, _, dirs = run("raise", tmp_path)
    assert proc.returncode != 0 and "the training script failed" in proc.stderr
    assert dirs and not os.path.exists(dirs[0])
    assert leftovers(tmp_path) == []


def test_directory_removed_on_sigterm(tmp_path):
    proc, _, dirs = run("sigterm", tmp_path)
    assert proc.returncode == -15
    assert dirs and not os.path.exists(dirs[0])


def test_directory_left_by_sigkill_is_removed_by_the_next_run(tmp_path):
    proc, _, dirs = run("sigkill", tmp_path)
    assert proc.returncode == -9
    assert dirs and os.path.isdir(dirs[0])   # nothing can run on SIGKILL
    proc, res, _ = run("train", tmp_path)
    assert proc.returncode == 0 and res["error"] is None
    assert not os.path.exists(dirs[0])
    assert leftovers(tmp_path) == []
