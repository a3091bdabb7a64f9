"""What the DeepSpeed fixture makers in this folder share: starting one local job of N ranks,
and reading the fp32 master weights of DeepSpeed's stage-0 optimizer.

The makers run in DeepSpeed's own environment (``DS_ACCELERATOR=cpu``) and record what
DeepSpeed computes; each rank is the same Python re-running the maker script with its
``--rank ...`` arguments, under the torch.distributed environment a single-node launcher
would set. One place for these, so the makers only say what a rank does.
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


def stage0_masters(engine) -> dict:
    """``{id(param): its fp32 master}`` where DeepSpeed's stage-0 bf16/fp16 optimizer
    (FP16_Optimizer) keeps flat fp32 groups; empty for the other optimizers (ZeRO's masters
    are read with ``safe_get_full_fp32_param``)."""
    masters, opt = {}, engine.optimizer
    if hasattr(opt, "fp32_groups_flat") and hasattr(opt, "fp16_groups"):
        for flat, group in zip(opt.fp32_groups_flat, opt.fp16_groups):
            pos = 0
            for p in group:
                masters[id(p)] = flat[pos:pos + p.numel()].view(p.shape)
                pos += p.numel()
    return masters
