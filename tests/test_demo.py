"""The demo job (examples/train_gpt.py) end to end on 2 real ranks, and its data pipeline
(examples/text_data.py)."""
from __future__ import annotations

import io
import os
import sys

import pytest
import torch

from zero_core.testing.ranks import run_ranks

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
sys.path.insert(0, EXAMPLES)
from text_data import (GlobalBatchSampler, is_validation_file, load_stdlib_text,  # noqa: E402
                       stdlib_root, stdlib_source_files, validation_batches)
from train_gpt import format_memory_table  # noqa: E402

from zero_core.progress import ProgressBar  # noqa: E402

TRAIN_GPT = os.path.join(EXAMPLES, "train_gpt.py")


# ------------------------------------------------------------------ the job, on 2 ranks

def _run_demo(launcher: str, *flags) -> list:
    # tiny model, a few steps: seconds of compute; the timeout allows for a busy machine
    args = ["--model", "tiny", "--steps", "12", "--micro-batch", "4", "--val-sequences", "8",
            "--quiet", *flags]
    return run_ranks(TRAIN_GPT, 2, launcher=launcher, args=args, timeout=240)


def _check_learned(results, communicator: str) -> None:
    reports = [r.report for r in results]
    assert all(rep is not None for rep in reports), results[0].log[-3000:]
    # every rank computed the same (all-reduced) validation losses and step losses
    assert reports[0]["val_start"] == pytest.approx(reports[1]["val_start"], rel=1e-6)
    assert reports[0]["val_end"] == pytest.approx(reports[1]["val_end"], rel=1e-6)
    assert reports[0]["losses"] == pytest.approx(reports[1]["losses"], rel=1e-6)
    rep = reports[0]
    assert rep["world_size"] == 2 and rep["communicator"] == communicator
    # byte-level text from a random init starts near ln(256) = 5.55 and falls quickly
    assert rep["val_start"] > 5.0
    assert rep["val_end"] < rep["val_start"] - 0.3, rep
    losses = rep["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    log = results[0].log
    for line in ("validation loss at start", "validation loss at end",
                 "memory per rank (MiB)", "= model states", "communication per rank"):
        assert line in log, f"{line!r} missing from rank 0's output:\n{log[-3000:]}"


@pytest.mark.multirank
def test_demo_under_mpirun_uses_mpi_and_learns():
    _check_learned(_run_demo("mpirun", "--comm", "mpi"), communicator="mpi")


@pytest.mark.multirank
def test_demo_under_torchrun_with_gloo_stage1_learns():
    _check_learned(_run_demo("torchrun", "--stage", "1", "--comm", "gloo"), communicator="gloo")


@pytest.mark.multirank
def test_demo_stage0_bf16_with_gradient_accumulation_learns():
    _check_learned(_run_demo("torchrun", "--stage", "0", "--precision", "bf16", "--grad-accum", "2"),
                   communicator="gloo")


# ------------------------------------------------------------------ data

@pytest.fixture(scope="module")
def text():
    return load_stdlib_text(max_bytes=2 << 20)


def test_tokens_are_the_bytes_of_the_stdlib_sources(text):
    files = stdlib_source_files()
    first_train = next(f for f in files if not is_validation_file(f))
    with open(os.path.join(stdlib_root(), first_train), "rb") as fh:
        raw = fh.read()
    assert bytes(text.train[:len(raw)].tolist()) == raw
    assert text.train.dtype == torch.uint8 and text.val.dtype == torch.uint8
    assert text.train.numel() > 10 * text.val.numel() // 2  # roughly 90/10 by files


def test_train_and_validation_come_from_different_files():
    files = stdlib_source_files()
    val = [f for f in files if is_validation_file(f)]
    assert 0.03 < len(val) / len(files) < 0.2
    assert not any(os.sep + "test" + os.sep in os.sep + f for f in files)
    # the split is a property of the path, not of the run
    assert [f for f in files if is_validation_file(f)] == val


def test_rank_shares_partition_each_global_batch(text):
    world, micro, accum = 3, 2, 2
    sampler = GlobalBatchSampler(text.train, 16, micro, world, accum, seed=5)
    for step in (0, 7):
        x, y = sampler.global_step_batch(step)
        assert x.shape == (world * micro * accum, 16)
        parts = [sampler.rank_batch(step, r, m) for m in range(accum) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    # targets are the inputs shifted by one token
    x, y = sampler.rank_batch(3, 1, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_depend_only_on_seed_and_step(text):
    a = GlobalBatchSampler(text.train, 16, 4, 2, seed=1)
    b = GlobalBatchSampler(text.train, 16, 4, 2, seed=1)
    c = GlobalBatchSampler(text.train, 16, 4, 2, seed=2)
    torch.manual_seed(0)  # the global RNG plays no part
    xa = a.rank_batch(4, 1)[0]
    torch.manual_seed(1)
    assert torch.equal(xa, b.rank_batch(4, 1)[0])
    assert not torch.equal(xa, c.rank_batch(4, 1)[0])
    assert not torch.equal(xa, a.rank_batch(5, 1)[0])


def test_sampler_refuses_bad_rank_and_short_text(text):
    sampler = GlobalBatchSampler(text.train, 16, 2, 2)
    with pytest.raises(ValueError, match="rank 2"):
        sampler.rank_batch(0, 2)
    with pytest.raises(ValueError, match="too short"):
        GlobalBatchSampler(text.train[:10], 16, 2, 2)


def test_validation_set_is_fixed(text):
    x1, _ = validation_batches(text.val, 32, 4)
    x2, _ = validation_batches(text.val, 32, 4)
    assert torch.equal(x1, x2) and x1.shape == (4, 32)


# ------------------------------------------------------------------ output helpers

def test_progress_bar_prints_a_few_lines_when_not_a_terminal():
    out = io.StringIO()
    bar = ProgressBar(100, stream=out)
    for step in range(1, 101):
        bar.update(step, {"loss": f"{5 - step / 50:.3f}"})
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 20  # every 5%
    assert lines[-1].startswith("[" + "#" * 24 + "] 100/100") and "loss 3.000" in lines[-1]


def test_progress_bar_in_percent_for_bytes():
    out = io.StringIO()
    bar = ProgressBar(3 * 2**20, "convert", stream=out, show_count=False)
    for done in (2**20, 2 * 2**20, 3 * 2**20):
        bar.update(done, {"tensors": done // 2**20})
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("convert [" + "#" * 8 + "." * 16 + "]  33.3%")
    assert lines[-1].startswith("convert [" + "#" * 24 + "] 100.0%") and "tensors 3" in lines[-1]


def test_memory_table_shows_measured_and_formula_in_mib():
    mib = 2**20
    rep = {"ledger": {"parameters": 4 * mib, "gradients": 2 * mib, "master_weights": 0,
                      "optimizer_states": 4 * mib, "model_states": 10 * mib,
                      "communication_buffers": mib},
           "formula": {"parameters": 4 * mib, "gradients": 2 * mib, "master_weights": 0,
                       "optimizer_states": 4 * mib, "model_states": 10 * mib},
           "num_parameters": mib, "accelerator": {"peak": 300 * mib}}
    table = format_memory_table([rep, rep], stage=2, precision="fp32", world=2)
    assert "4Ψ + 12Ψ/N" in table
    row = next(line for line in table.splitlines() if line.startswith("= model states"))
    assert row.split()[-3:] == ["10.00", "10.00", "10.00"]
