"""Start one local job of N ranks for the DeepSpeed fixture makers in this folder.

The makers run in DeepSpeed's own environment (``DS_ACCELERATOR=cpu``) and record what
DeepSpeed computes; each rank is the same Python re-running the maker script with its
``--rank ...`` arguments, under the torch.distributed environment a single-node launcher
would set. One place for that launch, so the makers only say what a rank does.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port free on this host now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, args: list[str], world: int, what: str,
              timeout: float = 900) -> None:
    """Run ``python script *args`` as ranks 0..world-1 and wait; SystemExit naming *what*
    and the exit codes if a rank fails."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env))
    codes = [p.wait(timeout=timeout) for p in procs]
    if any(codes):
        raise SystemExit(f"{what}: ranks exited with {codes}")
