"""The GPU kit's multi-rank checks: 2 and 4 ranks sharing the one GPU.

NCCL refuses two ranks on one device, so these run through the host communicators — gloo
(torchrun) and MPI (mpirun, when installed) — with device staging (zero_core/interfaces/
staging.py): device -> pinned host buffer -> collective -> device. That is how ZeRO++'s
quantized gathers and gradients reach the Triton kernels at more than one rank here, hpZ
gets a secondary group, offload runs per rank, and a checkpoint written by 2 GPU ranks is
loaded by 4 (resharded).

Each check launches tests/workers/device_matrix.py (the engine feature matrix the CPU test
suite runs on the vdev device) with ZERO_CORE_ACCELERATOR set to the kit's device, and
applies the suite's bounds: against the single-process plain-torch reference 1e-5 (fp32)
and 2e-2 (bf16; the worker's docstring says why), no engine tensor off its device
(device_audit), and for the checkpoint: the loaded weights bit-identical to the saved ones
and one more step after the load bit-identical to the step after the save.
"""
from __future__ import annotations

import os

from check_support import REPO, Ctx

WORKER = os.path.join(REPO, "tests", "workers", "device_matrix.py")
RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
#: (ranks, launcher) -> scenarios (device_matrix.py's names); quick: the dry run's subset
CASES = {(2, "torchrun"): ("s1", "s2", "s3", "s2_bf16", "s3_bf16", "zpp_qwz", "zpp_hpz",
                           "zpp_qgz", "off_opt_cpu", "ckpt"),
         (2, "mpirun"): ("s3_bf16", "zpp_qgz"),
         (4, "torchrun"): ("s3_bf16", "zpp_hpz", "zpp_qgz", "ckpt")}
QUICK = {(2, "torchrun"): ("s2", "zpp_qgz", "ckpt")}
COMM = {"torchrun": "gloo", "mpirun": "mpi"}


#: the 2-rank launch's saved weights fingerprint, for the 4-rank launch that reshards it
SAVED_BY_TWO = "ranks2_saved_fingerprint.txt"


def _saved_by_two(ctx: Ctx) -> str | None:
    path = os.path.join(ctx.scratch, SAVED_BY_TWO)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def cases(ctx: Ctx) -> list[tuple[int, str]]:
    return list((QUICK if ctx.quick else CASES).keys())


def run_ranks_case(ctx: Ctx, nprocs: int, launcher: str) -> dict:
    from zero_core.testing.ranks import mpirun_path, run_ranks
    if launcher == "mpirun" and mpirun_path() is None:
        return {"status": "skip", "detail": "mpirun not installed", "numbers": {}}
    names = (QUICK if ctx.quick else CASES)[(nprocs, launcher)]
    scratch = os.path.join(ctx.scratch, f"ranks{nprocs}{launcher}")
    os.makedirs(scratch, exist_ok=True)
    env = {"ZERO_CORE_ACCELERATOR": ctx.device, "ZERO_CORE_COMM": COMM[launcher],
           # 2 per node: at 4 ranks two emulated nodes, so qgZ quantizes (on one node it
           # falls back to the plain reduce-scatter) and hpZ=2 stays inside a node
           "ZERO_CORE_RANKS_PER_NODE": "2"}
    # the 4-rank launch loads the checkpoint the 2-rank launch saved: a reshard
    saved_by_two = os.path.join(ctx.scratch, "ranks2torchrun", ctx.device)
    if nprocs == 4 and os.path.isdir(saved_by_two):
        env["LOAD_FROM"] = saved_by_two
    results = run_ranks(WORKER, nprocs, launcher, args=[",".join(names), scratch], env=env,
                        timeout=220, check=False)
    failed = [r for r in results if r.returncode != 0 or r.report is None]
    if failed:
        return {"numbers": {}, "failures": [f"rank {r.rank} exited {r.returncode}: "
                                            f"{(r.log or '')[-600:]}" for r in failed[:1]]}
    failures, numbers = [], {}
    for rank, r in enumerate(results):
        for name, rep in r.report.items():
            if rep.get("misplaced"):
                failures.append(f"{name} rank {rank}: misplaced {rep['misplaced'][:3]}")
            if name.startswith("ckpt"):
                resharded = "LOAD_FROM" in env
                # a reshard loads what the 2-rank launch saved (its training differs from this
                # launch's: only the loaded weights compare); else this launch's own save
                want = _saved_by_two(ctx) if resharded else rep["saved"]
                if rep["loaded"] != want or (not resharded and rep["resumed"] != rep["continued"]):
                    failures.append(f"{name} rank {rank}: the checkpoint loaded from "
                                    f"{rep['load_from']} differs from the one saved")
                if nprocs == 2 and rank == 0:
                    with open(os.path.join(ctx.scratch, SAVED_BY_TWO), "w") as f:
                        f.write(rep["saved"])
                numbers[name] = {"load_from": os.path.basename(rep["load_from"]),
                                 "resharded": "LOAD_FROM" in env}
                continue
            if rank == 0:
                numbers[name] = {k: rep[k] for k in ("rel_diff", "precision", "device")
                                 if k in rep}
            bound = RTOL[rep["precision"]]
            if rep.get("rel_diff", 0.0) > bound:
                failures.append(f"{name}: rel. diff {rep['rel_diff']:.2e} > {bound:g}")
    detail = f"{len(names)} scenarios on {nprocs} ranks over {COMM[launcher]}, staged"
    return {"numbers": numbers, "failures": failures, "detail": detail}
