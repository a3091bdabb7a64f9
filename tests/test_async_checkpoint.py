"""Asynchronous and periodic saves, resuming by itself, and the errors on the way — on real
ranks (2 gloo ranks under a torchrun-style launch; one launch runs several tasks of
tests/workers/async_ckpt.py, a second checks a resume on 1 rank with
tests/workers/resume_train.py).

An async save is checked against a synchronous save of the same state (every tensor of
every shard equal, although training changed the state while the thread wrote); a
background write that fails (a full disk on one rank) is raised by name on every rank at
a following step, with the partial files removed and ``latest`` unchanged; resuming on
another world size keeps the global batch and reads every sample once in the epoch.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from zero_core.testing.ranks import run_ranks

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.multirank
SNAPSHOT_VARIANTS = ("s2", "s3_bf16", "s2_offload_cpu", "s3_offload_nvme")


def launch(script, nprocs, args):
    results = run_ranks(os.path.join(HERE, "workers", script), nprocs, "torchrun",
                        args=[json.dumps(args)],
                        env={"ZERO_CORE_COMM": "gloo", "ZERO_CORE_COMM_TIMEOUT": "120"},
                        timeout=300)
    assert all(r.report is not None for r in results), "a rank did not report"
    return [r.report for r in results]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("async")
    tasks = [["snapshot", str(d / v), v] for v in SNAPSHOT_VARIANTS]
    tasks += [["failure", str(d / "f")],
             ["periodic", str(d / "p")], ["resume_errors", str(d / "r")]]
    return launch("async_ckpt.py", 2, tasks)


@pytest.mark.parametrize("variant", SNAPSHOT_VARIANTS)
def test_an_async_save_holds_the_state_at_the_call(reports, variant):
    # optimizer states on the device, in host memory, in NVMe swap files; stage 3 in bf16
    for rank in range(2):
        snap = reports[rank][SNAPSHOT_VARIANTS.index(variant)]
        assert snap["equal"] and snap["tensors"] >= 4
        assert snap["appeared_after_steps"] is not None  # committed at a step, not at wait
        assert snap["latest"] == "t"


def test_a_failed_background_write_is_raised_on_every_rank(reports):
    for rank in range(2):
        f = reports[rank][len(SNAPSHOT_VARIANTS)]
        assert f["error"] is not None, "the failure was lost"
        for words in ("'bad'", "rank 1", "disk full (ENOSPC)", "rank_00001.safetensors",
                      "partial files", "are gone", "'latest'", "unchanged"):
            assert words in f["error"], words
        assert f["left"] == ["good", "latest"] and f["latest"] == "good"
        assert f["latest_after"] == "good2"  # and the next async save works


def test_periodic_saves_keep_the_newest(reports):
    p = reports[0][len(SNAPSHOT_VARIANTS) + 1]  # rank 0 prunes: read its listing
    assert p["steps"] == ["global_step6", "global_step8", "latest"]
    saved = [n for n in p["minutes"] if n.startswith("global_step")]
    assert len(saved) >= 2, p["minutes"]  # every 0.001 minutes with 30 ms steps


def test_resume_errors_are_named(reports):
    for rank in range(2):
        r = reports[rank][len(SNAPSHOT_VARIANTS) + 2]
        assert "resume is \"require\"" in r["require"] and "does not exist" in r["require"]
        assert r["model"].startswith("CheckpointMismatchError") and \
            "saved from a different model" in r["model"] and "[16, 4]" in r["model"]
        assert "dataset of 64 samples, this one has 48" in r["data"]
        assert "could be loaded" not in r["data"]  # not retried on older checkpoints
        assert r["batch"].startswith("ConfigError") and "3 x 2 to divide 8" in r["batch"] \
            and "keep_micro" in r["batch"]
        assert r["left"] == ["global_step2", "latest"]  # nothing written, nothing removed


def _sample_counts(log_path, keep):
    """Sample ids of the micro-steps that count: *keep(line)* picks them."""
    with open(log_path) as fh:
        lines = [json.loads(x) for x in fh]
    return Counter(i for line in lines if keep(line) for i in line["ids"])


def test_resume_on_one_rank_keeps_the_global_batch_and_reads_every_sample_once(tmp_path):
    opts = {"save_dir": str(tmp_path / "ck"), "steps": 8, "interval": 4, "async": True,
            "samples": 96, "micro": 4, "log": str(tmp_path / "log")}
    first = launch("resume_train.py", 2, opts)
    assert [r["end_step"] for r in first] == [8, 8]
    second = launch("resume_train.py", 1, {**opts, "steps": 12,
                                            "final": str(tmp_path / "resumed.pt")})
    assert second[0]["start_step"] == 8 and second[0]["gas"] == 2  # 2 x 4 x 1 -> 1 x 4 x 2
    # epoch = 96 samples = 12 steps of 8: steps 1-8 on 2 ranks, 9-12 on 1 rank
    counts = _sample_counts(opts["log"], lambda line: line["micro"] <= 8 if line["world"] == 2
                            else True)
    assert sorted(counts) == list(range(96)) and set(counts.values()) == {1}
    # the same training as 2 ranks straight through, up to the reduction order
    launch("resume_train.py", 2, {**opts, "save_dir": None, "steps": 12, "log": None,
                                  "final": str(tmp_path / "straight.pt")})
    a, b = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "straight.pt")
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), k
