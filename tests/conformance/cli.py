"""Command line of the conformance suite (``python -m zero_core.conformance``)."""
from __future__ import annotations

import argparse
import os

from .suite import run_conformance


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m zero_core.conformance",
        description="Check a zero-core communicator and the available accelerators against "
                    "the interface contract. Run it on every rank of a job (mpirun / torchrun).")
    p.add_argument("--comm", help="communicator to check (default: ZERO_CORE_COMM, else the "
                                  "accelerator's default)")
    p.add_argument("--accelerator", help="accelerator to run on (default: ZERO_CORE_ACCELERATOR, "
                                         "else auto-detection)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE and register it as a plugin (to test a plugin before it "
                        "is packaged); repeatable")
    p.add_argument("--ranks-per-node", type=int, help="topology override, as ZERO_CORE_RANKS_PER_NODE")
    p.add_argument("--seed", type=int, help="seed of a previous run, to reproduce it")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("-k", "--select", action="append", default=[], metavar="SUBSTRING",
                   help="run only checks whose name contains SUBSTRING; repeatable")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--comm-only", action="store_true", help="skip the accelerator checks")
    which.add_argument("--accelerator-only", action="store_true", help="skip the communicator checks")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the suite on this rank; 0 when every check passed (or is declared unsupported)."""
    from zero_core.runtime import context as runtime
    from zero_core.testing.ranks import report as report_to_launcher

    args = parse_args(argv)
    result = run_conformance(args.comm, args.accelerator, plugins=args.plugin,
                             ranks_per_node=args.ranks_per_node, seed=args.seed,
                             timeout=args.timeout, select=args.select,
                             check_comm=not args.accelerator_only,
                             check_accelerators=not args.comm_only)
    if os.environ.get("ZERO_CORE_REPORT_DIR"):  # launched by zero_core.testing.ranks.run_ranks
        report_to_launcher(result.to_json())
    if not result.aborted:  # after an abort, peers may be gone: do not wait for them
        runtime.shutdown()
    return 0 if result.ok else 1
