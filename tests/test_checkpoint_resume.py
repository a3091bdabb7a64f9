"""Exact resume: 20 steps straight == 10 steps + save + load in a NEW job + 10 steps, bit
for bit, on real ranks (gloo under a torchrun-style launch, MPI under mpirun).

The worker (tests/workers/ckpt_train.py) trains a tiny model with dropout, a tied
embedding/head, a frozen layer, two parameter groups, gradient accumulation, clipping and
a warmup LR schedule. Its data come from every RNG a pipeline may use — each rank's torch
CPU generator, Python's ``random``, numpy's global generator — plus a sampler-like
generator carried in ``client_state``. So equality needs parameters, master weights,
optimizer states, step counts, scheduler, loss scaler (the fp16 run starts at a scale that
overflows and skips steps), counters, RNG states and client_state all restored; a single
missing piece changes the first loss after the resume. The negative control loads only
the module and must differ.
"""
from __future__ import annotations

import json
import os

import pytest

from zero_core.testing.ranks import mpirun_path, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "ckpt_train.py")
COMM = {"torchrun": "gloo", "mpirun": "mpi"}
pytestmark = pytest.mark.multirank

ALL = ["s0_sgd", "s1", "s2", "s2_bf16", "s1_fp16", "s3", "s3_bf16"]
MPI_SET = ["s2", "s1_fp16", "s3"]


def launch(tasks, nprocs, launcher):
    results = run_ranks(WORKER, nprocs, launcher, args=[json.dumps(tasks)],
                        env={"ZERO_CORE_COMM": COMM[launcher], "ZERO_CORE_COMM_TIMEOUT": "120"},
                        timeout=600)
    assert all(r.report is not None for r in results), "a rank did not report"
    return [r.report for r in results]


def launchers():
    return ["torchrun", pytest.param("mpirun", marks=pytest.mark.skipif(
        mpirun_path() is None, reason="mpirun not installed: pip install 'zero-core[mpi]'"))]


@pytest.mark.parametrize("launcher", launchers())
def test_exact_resume_in_a_new_job(tmp_path, launcher):
    names = ALL if launcher == "torchrun" else MPI_SET
    first = launch([["resume_first", str(tmp_path / n), n] for n in names], 2, launcher)
    second_tasks = [["resume_second", str(tmp_path / n), n] for n in names]
    second_tasks.append(["resume_second", str(tmp_path / "s1"), "s1", True]
                        if "s1" in names else ["resume_second", str(tmp_path / "s2"), "s2", True])
    second = launch(second_tasks, 2, launcher)
    for rank in range(2):
        for i, name in enumerate(names):
            a, b = first[rank][i], second[rank][i]
            straight = a["straight"]
            # the load restored exactly what was saved
            assert b["loaded"]["params"] == a["saved"]["params"], (name, rank)
            for key in ("global_steps", "micro_steps", "skipped_steps", "lr", "loss_scale"):
                assert b["loaded"][key] == a["saved"][key], (name, key)
            assert b["client_keys"] == ["data_gen", "epoch", "note"] and b["epoch"] == 3
            assert b["path"] == str(tmp_path / name / "global_step10")
            # and training continued bit for bit
            assert b["losses"] == straight["losses"], (name, rank)
            assert b["params"] == straight["params"], (name, rank)
            for key in ("global_steps", "micro_steps", "skipped_steps", "lr", "loss_scale"):
                assert b[key] == straight[key], (name, key)
            if name == "s1_fp16":  # the scaler state mattered: steps were skipped
                assert straight["skipped_steps"] > 0 and a["saved"]["skipped_steps"] > 0
        control = second[rank][len(names)]
        ref = first[rank][names.index(second_tasks[-1][2])]["straight"]
        # module only: no optimizer state, counters, RNG -> a different continuation
        assert control["loaded"]["params"] == first[rank][names.index(second_tasks[-1][2])]["saved"]["params"]
        assert control["global_steps"] == 10 and control["params"] != ref["params"]
