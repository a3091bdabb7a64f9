"""The GPU kit's conformance checks: the conformance suite for the device's accelerator and
communicator at world size 1, as ``python -m zero_core.conformance`` and through the
Python API after torch.distributed was set up by the caller (a FileStore,
``cpu:gloo,cuda:nccl``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from check_support import Ctx, clean_env, import_torch, tail


def conformance_numbers(rep: dict) -> tuple[dict, list]:
    results = rep.get("results", {})
    # the suite's statuses: "pass", "FAIL", "unsupported", "skip"
    failed = sorted(n for n, r in results.items() if str(r.get("status")).lower() == "fail")
    numbers = {"counts": rep.get("counts"), "comm": rep.get("comm"),
               "accelerator": rep.get("accelerator"), "world_size": rep.get("world_size"),
               "seed": rep.get("seed"), "failed": failed,
               "failed_detail": {n: results[n].get("detail", "")[:300] for n in failed[:10]},
               "unsupported": sorted(n for n, r in results.items()
                                     if r.get("status") == "unsupported"),
               "not_available": rep.get("not_available")}
    failures = [f"conformance check {n} failed: {results[n].get('detail', '')[:200]}"
                for n in failed]
    if rep.get("aborted"):
        failures.append(f"suite aborted: {rep['aborted'][:300]}")
    if rep.get("ok") is False and not failures:
        failures.append("the suite's verdict is not ok")
    return numbers, failures


def check_conformance_cli(ctx: Ctx) -> dict:
    """``python -m zero_core.conformance --comm nccl --accelerator cuda`` as a user runs it
    (one process: torch.distributed's env:// rendezvous, a TCP store on localhost that
    zero-core sets up at world size 1). The suite's own JSON report is read back."""
    report_dir = tempfile.mkdtemp(prefix="conformance_", dir=ctx.scratch)
    cmd = [sys.executable, "-m", "zero_core.conformance", "--comm", ctx.comm,
           "--accelerator", ctx.device, "--timeout", "60"]
    # cwd: not the checkout, whose zero_core/ folder would shadow the installed package
    proc = subprocess.run(cmd, env=clean_env({"ZERO_CORE_REPORT_DIR": report_dir}),
                          capture_output=True, text=True, timeout=240, cwd=ctx.scratch)
    path = os.path.join(report_dir, "rank0.json")
    numbers = {"command": " ".join(cmd[1:]), "returncode": proc.returncode}
    if not os.path.exists(path):
        return {"numbers": numbers, "failures": [
            f"the suite wrote no report (exit {proc.returncode}): "
            f"{tail(proc.stdout + proc.stderr, 12)}"]}
    with open(path) as fh:
        rep = json.load(fh)
    more, failures = conformance_numbers(rep)
    numbers.update(more)
    if proc.returncode != 0 and not failures:
        failures.append(f"exit status {proc.returncode}: {tail(proc.stderr, 8)}")
    c = rep.get("counts") or {}
    return {"numbers": numbers, "failures": failures,
            "detail": ", ".join(f"{v} {k}" for k, v in c.items())}


def check_conformance_preinit(ctx: Ctx) -> dict:
    """The suite through its Python API after torch.distributed was initialized by the
    caller from a FileStore with one backend per device type (``cpu:gloo,cuda:nccl``):
    the communicator under test then carries its traffic on an nccl group of its own and
    the suite's control plane (CPU tensors) runs on gloo. Separates a communicator problem
    from a control-plane one when the plain CLI run fails."""
    torch = import_torch()
    import torch.distributed as dist
    store_path = os.path.join(ctx.scratch, "conformance_filestore")
    if os.path.exists(store_path):
        os.remove(store_path)
    store = dist.FileStore(store_path, 1)
    backend = "cpu:gloo,cuda:nccl" if ctx.cuda else "gloo"
    if ctx.cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    from zero_core.conformance import run_conformance
    from zero_core.runtime.context import get_runtime
    rep = run_conformance(comm=ctx.comm, accelerator=ctx.device, timeout=60.0, verbose=False)
    numbers, failures = conformance_numbers(rep.to_json())
    numbers["torch_distributed_backend"] = str(dist.get_backend())
    numbers["comm_world_group_own"] = get_runtime().comm.world.handle is not None \
        if hasattr(get_runtime().comm, "world") else None
    c = numbers.get("counts") or {}
    return {"numbers": numbers, "failures": failures,
            "detail": f"backend {backend}: " + ", ".join(f"{v} {k}" for k, v in c.items())}
