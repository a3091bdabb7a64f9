"""Jobs under torchrun's elastic agent, and real faults injected into them: what the fault
tests (tests/test_elastic_faults.py) and the fault benchmark (ci/bench/faults.py) share.

:func:`start_elastic` starts one agent (``python -m torch.distributed.run``) with the c10d
rendezvous on this machine, restarts allowed, and settings that let a lost node be noticed
in seconds (``keep_alive_interval=1``, ``last_call_timeout=3``): torch's defaults take tens
of seconds, fine on a cluster, too slow for a test. :func:`kill_tree` SIGKILLs a process and
everything it started (torchrun starts each worker in a session of its own, so a process
group kill of the agent would leave its workers running).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from zero_core.testing.ranks import INHERITED_LAUNCH_VARS

RDZV_CONF = ("last_call_timeout=3,join_timeout=60,close_timeout=5,keep_alive_interval=1,"
             "keep_alive_max_attempt=2")


def start_elastic(script: str, args: list, out: str, port: int, nnodes: str = "1",
                  nproc: int = 2, max_restarts: int = 6, env: dict | None = None) -> subprocess.Popen:
    """One torchrun agent running *script* with *args*; its output goes to file *out*."""
    full_env = {k: v for k, v in os.environ.items() if k not in INHERITED_LAUNCH_VARS}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
           "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
           "--monitor-interval", "0.2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}",
           "--rdzv-conf", RDZV_CONF, script, *args]
    return subprocess.Popen(cmd, env=full_env, stdout=open(out, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def process_tree(pid: int) -> list[int]:
    """*pid* and its descendants (Linux /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += [c for c, parent in parents.items() if parent == p]
    return found


def kill(pids) -> None:
    """SIGKILL each of *pids* (gone ones are skipped)."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def kill_tree(pid: int) -> None:
    """SIGKILL *pid* and everything it started: a node lost."""
    kill(process_tree(pid))


def read_json_lines(path: str) -> list[dict]:
    """The complete JSON lines of *path* so far ([] if it is not there yet)."""
    try:
        with open(path) as fh:
            return [json.loads(x) for x in fh if x.endswith("\n")]
    except (OSError, ValueError):
        return []
