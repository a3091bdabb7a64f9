"""The plan of the GPU kit: every check, the worker group it runs in and its time cap
(ci/gpu/check.py runs them; the checks are defined in the ``*_checks.py`` modules here).

Every check is a function ``check(ctx) -> dict`` listed by :func:`plan` under a name
``group/what``. It raises on an unexpected error (the runner records a failure with
the traceback's last lines) and otherwise returns::

    {"numbers": {...},          # what was measured (JSON-serializable)
     "failures": [str, ...],    # criteria that failed (empty/absent: pass)
     "status": "skip"|"refused" # optional: not run here / the engine refused the config
     "detail": "one line"}      # optional summary for the markdown table

A check runs in a worker process of its group (``conformance``, ``kernels``, ``engine``)
on the device of ``ctx.device`` ("cuda", or "cpu" for the dry run). Workers initialize
zero-core's process-wide runtime once (accelerator ``ctx.device``, communicator nccl or
gloo, world size 1); engines are built and destroyed per check.

Comparisons and their bounds are written next to each check. The plain-torch references
run on the same device as the engine, from a copy of the same initial model, on the same
batches.
"""
from __future__ import annotations

from dataclasses import dataclass

from bench_checks import BENCH, QUICK_BENCH, run_bench
from check_support import Ctx
from checkpoint_checks import run_checkpoint_case
from conformance_checks import check_conformance_cli, check_conformance_preinit
from engine_cases import checkpoint_cases, engine_cases
from engine_checks import run_engine_case
from kernel_checks import check_optim_fused, check_quant_bandwidth, check_quant_triton
from ranks_checks import cases as ranks_cases, run_ranks_case


@dataclass(frozen=True)
class Check:
    name: str
    group: str          # worker process it runs in
    cap_s: float        # a single check running longer than this is stopped
    run: object         # fn(ctx) -> dict


def plan(ctx: Ctx) -> list[Check]:
    """Every check, in the order they run (cheap and independent first)."""
    checks = [
        Check("conformance/cli", "conformance", 240, check_conformance_cli),
        Check("conformance/preinit-filestore", "conformance-preinit", 180,
              check_conformance_preinit),
        Check("kernels/quant-triton-bitwise", "kernels", 240, check_quant_triton),
        Check("kernels/quant-bandwidth", "kernels", 120, check_quant_bandwidth),
        Check("kernels/optim-fused", "kernels", 120, check_optim_fused),
    ]
    for case in engine_cases(ctx):
        checks.append(Check(f"engine/{case.name}", "engine", 150,
                            lambda c, case=case: run_engine_case(c, case)))
    for case in checkpoint_cases(ctx):
        checks.append(Check(f"checkpoint/{case.name}-to-cpu", "engine", 240,
                            lambda c, case=case: run_checkpoint_case(c, case)))
    for contender in (QUICK_BENCH if ctx.quick else BENCH):
        checks.append(Check(f"bench/{contender}", "engine", 150,
                            lambda c, contender=contender: run_bench(c, contender)))
    # last: when the budget runs out, the multi-rank launches are what is skipped
    for nprocs, launcher in ranks_cases(ctx):
        checks.append(Check(f"ranks/{nprocs}-{launcher}", "ranks", 240,
                            lambda c, n=nprocs, la=launcher: run_ranks_case(c, n, la)))
    return checks
