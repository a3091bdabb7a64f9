"""zero-core conformance suite: does a communicator / accelerator plugin keep the contract?

It checks, on real ranks, what ``zero_core/communicator.py`` and ``zero_core/accelerator.py``
promise, and prints one pass/fail line per check on rank 0.

Communicator checks (every rank, same order):
  * every collective — all_gather_into, reduce_scatter and all_reduce with sum/avg/max/min,
    all_to_all_single, broadcast from every source, barrier — on fp32, bf16, fp16, int8 and
    uint8, against references each rank computes in float64 from every rank's seeded input
    (a fresh seed per run, broadcast from rank 0 and printed, ``--seed`` reproduces a run).
    A dtype the backend declares unsupported (``supports(op, dtype)`` is False) must be
    refused with CommError before anything is sent; it is reported as ``unsupported``;
  * refusals with a clear CommError, after which the communicator still works: uneven and
    mismatched sizes, non-contiguous tensors, mixed dtypes, out-of-range ``src``, unknown
    reduce ops, groups this rank is not in, malformed groups;
  * async: several collectives in flight waited in another order; an async call returns
    before its collective completes (one rank enters 1 s late);
  * groups: ``new_group`` on a subset, ``split``, intra- and inter-node groups and
    ``spans_nodes`` (run 4 ranks with ``ZERO_CORE_RANKS_PER_NODE=2`` to emulate 2 nodes);
  * the ledger: bytes sent per op and group exactly as the table in ``zero_core/ledger.py``
    says, classified inter-/intra-node by the group's nodes.

Accelerator checks, for every accelerator available on the machine: device placement,
memory counters that move with a 64 MiB allocation, peak reset, pin_memory round trip,
arithmetic in each supported dtype, and the kernel set resolving through the registry
(its Adam/SGD steps compared with torch.optim).

Running it against your own backend
-----------------------------------
Install your plugin package (its ``[project.entry-points.zero_core]`` entry makes the
registry find it), then launch the suite the way your users launch training::

    mpirun -np 4 python -m zero_core.conformance --comm mycomm
    torchrun --nproc-per-node 4 -m zero_core.conformance --comm mycomm --accelerator mydev
    ZERO_CORE_RANKS_PER_NODE=2 mpirun -np 4 python -m zero_core.conformance --comm mycomm

Before packaging, register the plugin module directly: ``--plugin my_pkg.zero_core_plugin``
(it must be importable on every rank). ``-k all_reduce`` runs only the checks whose names
contain a substring; ``--comm-only`` / ``--accelerator-only`` narrow the run; ``--timeout``
is the collective timeout in seconds. The exit status is 0 when no check failed (checks
that are ``unsupported`` or ``skip`` do not fail a run), 1 otherwise, on every rank.

From Python (on every rank)::

    from zero_core.conformance import run_conformance
    report = run_conformance(comm="mycomm", plugins=["my_pkg.zero_core_plugin"])
    assert report.ok, report.table()

The suite coordinates ranks (shared seed, result gathering, timing checks) over
torch.distributed, which ``zero_core.runtime.context.init_distributed`` always sets up beside the
communicator, so a broken communicator cannot hide its own failures.
"""
from .cli import main
from .results import CheckResult
from .suite import SuiteReport, run_conformance

__all__ = ["run_conformance", "SuiteReport", "CheckResult", "main"]
