"""Rank program for tests/test_failure_report.py: ``failure_report.py MODE SYNC_DIR``.

Every mode ends the rank with an uncaught exception, as a failing training script does,
so that what the job prints is the failure report's (or Python's, with ZERO_CORE_DEBUG=1).
The ranks first wait for each other through files in SYNC_DIR (no collective is possible
before the runtime starts), so that they raise together, as ranks that agreed on an error
do, and no launcher has stopped a rank before it reached its exception. Under mpirun a
rank lingers 0.5 s after its report for the same reason.

MODE
  config    zero_core.initialize with {"zero_optimization": {"stage": 7}}: a ConfigError
            from the parser, before the runtime starts, on every rank
  keyerror  zero_core.initialize with a good config (runtime and engine up), then the
            script's own code raises KeyError('no_such_column') on every rank but rank 0,
            which waits in an all_reduce: its error only says that its peers are gone
"""
from __future__ import annotations

import atexit
import os
import sys
import time

import torch

import zero_core

MODE, SYNC_DIR = sys.argv[1], sys.argv[2]
RANK = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
WORLD = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
GOOD = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def wait_for_everyone(name: str) -> None:
    """A barrier through files: each rank writes one, then waits for all."""
    with open(os.path.join(SYNC_DIR, f"{name}.{RANK}"), "w"):
        pass
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(SYNC_DIR, f"{name}.{r}")) for r in range(WORLD)):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {RANK}: the other ranks did not reach {name!r} in 60 s")
        time.sleep(0.01)


def lookup(table: dict, column: str):
    return table[column]  # the user's own bug: a missing key


if "OMPI_COMM_WORLD_RANK" in os.environ:
    # mpirun stops the other ranks as soon as one exits non-zero; linger after the report
    # (atexit runs after sys.excepthook) so that each rank's own line reaches the log
    atexit.register(time.sleep, 0.5)
torch.manual_seed(0)  # every rank builds the same model (initialize checks it)
model = torch.nn.Linear(4, 2)
if MODE == "config":
    wait_for_everyone("start")
    zero_core.initialize(model=model, config={**GOOD, "zero_optimization": {"stage": 7}})
elif MODE == "keyerror":
    zero_core.initialize(model=model, config=GOOD)  # its agreement check: ranks in step
    if RANK > 0:
        lookup({"loss": 1.0}, "no_such_column")
    zero_core.get_runtime().comm.all_reduce(torch.ones(4))
else:
    raise SystemExit(f"unknown mode {MODE!r}: use config or keyerror")
