"""``wall_clock_breakdown`` and ``steps_per_print`` (issue 32; zero_core/engine/timers.py).

DeepSpeed's per-phase timers (fwd, bwd, bwd_inner, bwd_allreduce, step) plus the wall time
per optimizer step and the bytes each phase sent, printed on rank 0 every steps_per_print
optimizer steps (every step when steps_per_print is inf); DeepSpeed's progress line
``step=N, skipped=S, lr=[...], mom=[...]`` at the same cadence, whatever the breakdown. Off,
the phases are a shared null context: nothing printed, no clock read, no synchronization
(the count on an asynchronous device is tests/test_sync_free_step.py's "progress_every_step").
Timing asserts are sanity only (non-negative, parts within their whole): the machine is shared.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

import zero_core
from zero_core.engine.timers import COMM_PHASES, OFF, PHASES
from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "wall_clock.py")
TIME = re.compile(r"^\[Rank 0\] time \(ms\) \| (.*)$")
COMM = re.compile(r"^\[Rank 0\] comm \(MB sent\) \| (.*)$")
PROGRESS = re.compile(r"^\[Rank 0\] step=(\d+), skipped=(\d+), lr=(.*), mom=(.*)$")
ROUNDING = 0.05   # ms: the printed values have two decimals


def fields(body: str) -> dict[str, float]:
    return {k: float(v) for k, v in (part.split(": ") for part in body.split(" | "))}


def check_times(t: dict[str, float]) -> None:
    assert list(t) == [*PHASES, "iteration"], t
    assert all(v >= 0 for v in t.values()), t
    assert t["bwd_inner"] + t["bwd_allreduce"] <= t["bwd"] + ROUNDING, t
    # the phases are disjoint stretches of the optimizer step's wall time
    assert t["fwd"] + t["bwd"] + t["step"] <= t["iteration"] + ROUNDING, t
    assert t["iteration"] > 0, t


def build(steps_per_print=10, wall_clock=False, gas=1, **extra):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    engine, *_ = zero_core.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": 2}, "steps_per_print": steps_per_print,
        "wall_clock_breakdown": wall_clock, "safety": {"launcher_notice": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **extra})
    return engine


def train(engine, steps: int, capsys) -> list[list[str]]:
    """The engine's lines printed during each optimizer step (and, last, by destroy())."""
    g = torch.Generator().manual_seed(1)
    capsys.readouterr()
    per_step = []
    for _ in range(steps):
        for _ in range(engine.gradient_accumulation_steps):
            engine.backward(engine(torch.randn(4, 16, generator=g)).pow(2).mean())
            engine.step()
        per_step.append(_lines(capsys))
    engine.destroy()
    per_step.append(_lines(capsys))
    return per_step


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[Rank")]


def test_off_prints_nothing_and_never_synchronizes(capsys):
    engine = build(wall_clock=False)          # steps_per_print 10: not reached
    syncs = []
    engine.runtime.accelerator.synchronize = lambda: syncs.append(1)
    engine.wall_clock._sync = lambda: syncs.append(1)
    assert all(engine.wall_clock(name) is OFF for name in PHASES)
    lines = train(engine, 3, capsys)
    assert lines == [[], [], [], []]
    assert syncs == [] and engine.get_wall_clock_timers() == {}


def test_progress_line_every_steps_per_print(capsys):
    engine = build(steps_per_print=2)
    lines = train(engine, 5, capsys)
    printed = [(i + 1, PROGRESS.match(line)) for i, step in enumerate(lines) for line in step]
    assert all(m for _, m in printed), lines
    assert [int(m.group(1)) for _, m in printed] == [2, 4]
    for _, m in printed:
        assert m.group(2) == "0" and m.group(3) == "[0.01]" and m.group(4) == "[(0.9, 0.999)]"
    # the host reads a step's outcome one step later: step N's line comes with step N+1's
    # update at the latest, never before step N
    assert [after for after, _ in printed] == [3, 5]


def test_breakdown_at_steps_per_print_with_monitor(capsys, tmp_path):
    engine = build(steps_per_print=3, wall_clock=True, gas=2, csv_monitor={
        "enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    lines = train(engine, 6, capsys)
    assert [len(step) for step in lines] == [0, 0, 3, 0, 0, 3, 0], lines
    for k in (2, 5):                         # after optimizer steps 3 and 6
        progress, time_line, comm_line = lines[k]
        assert int(PROGRESS.match(progress).group(1)) == k + 1
        check_times(fields(TIME.match(time_line).group(1)))
        comm = fields(COMM.match(comm_line).group(1))
        assert comm == dict.fromkeys(COMM_PHASES, 0.0)      # one process: nothing sent
    # DeepSpeed's monitor events, one per optimizer step
    for name in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        path = tmp_path / "job" / f"Train_Samples_elapsed_time_ms_{name}.csv"
        rows = path.read_text().splitlines()
        assert len([r for r in rows if r[:1].isdigit()]) == 6, (name, rows)


def test_breakdown_every_step_when_steps_per_print_is_inf(capsys):
    engine = build(steps_per_print=float("inf"), wall_clock=True)
    lines = train(engine, 3, capsys)
    assert [[line.split(" |")[0] for line in step] for step in lines] == \
        [["[Rank 0] time (ms)", "[Rank 0] comm (MB sent)"]] * 3 + [[]]
    check_times(engine.get_wall_clock_timers())


def engine_lines_by_step(log: str, stage: str) -> list[list[str]]:
    """Rank 0's lines printed while the worker trained *stage* (after the previous stage's
    ``destroyed`` marker), grouped by the last ``after step`` marker before them."""
    groups: list[list[str]] = [[]]
    lines = log.splitlines()
    end = lines.index(f"== {stage} destroyed")
    start = max((i + 1 for i in range(end)
                 if lines[i].startswith("== ") and lines[i].endswith(" destroyed")), default=0)
    for line in lines[start:end]:
        if line.startswith(f"== {stage} after step "):
            groups.append([])
        elif line.startswith("[Rank 0]"):
            groups[-1].append(line)
    return groups


@pytest.mark.multirank
def test_two_ranks_rank0_prints_at_the_cadence():
    results = run_ranks(WORKER, 2, "torchrun", args=["2,3"], env={"ZERO_CORE_COMM": "gloo"},
                        timeout=300)
    reports = [r.report for r in results]
    assert all(rep is not None for rep in reports), "a rank did not report"
    rank0, rank1 = results[0].log, results[1].log
    assert "[Rank" not in rank1, rank1
    for stage in ("2", "3"):
        ours = engine_lines_by_step(rank0, stage)
        # index k: after step k's marker, i.e. during step k+1 (the last: destroy())
        assert [len(c) for c in ours] == [0, 3, 0, 3, 0], (stage, ours)
        for k in (2, 4):
            progress, time_line, comm_line = ours[k - 1]
            assert int(PROGRESS.match(progress).group(1)) == k
            check_times(fields(TIME.match(time_line).group(1)))
            comm = fields(COMM.match(comm_line).group(1))
            # (the step's own bytes, a norm all-reduce here, print as 0.000 MB: checked below)
            assert comm["bwd"] > 0 and (comm["fwd"] > 0) == (stage == "3"), (stage, comm)
        for rep in reports:
            r = rep[stage]
            last = r["last_comm"]
            # every byte of the step went out inside one of its phases
            assert sum(c["sent_bytes"] for c in last.values()) == r["step_sent_bytes"], r
            assert last["bwd"]["sent_bytes"] > 0 and last["step"]["sent_bytes"] > 0, r
            # stage 3 gathers parameters in forward; stage 2 sends nothing there
            assert (last["fwd"]["sent_bytes"] > 0) == (stage == "3"), r
            check_times(r["timers"])
