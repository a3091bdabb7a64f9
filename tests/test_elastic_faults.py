"""Fault injection with real processes and real kills: a training run under torchrun's
elastic agent loses ranks at random points and finishes by itself.

The script is tests/workers/resume_train.py — a README-style loop with
``checkpoint.save_dir`` / ``save_interval_steps`` / ``async_save`` and
``initialize(training_data=...)``; torchrun restarts it and ``checkpoint.resume`` does the
rest. This test drives it like a bad day on a cluster:

- 2 ranks, one agent, ``--max-restarts``: one rank is SIGKILLed three times at random
  steps, once while an async save is being written (a slow disk makes the write last). The
  run finishes on its own; its final weights equal an uninterrupted run's bit for bit
  (fp32, deterministic data); every restart resumed from the checkpoint ``latest`` named
  when the rank died, so the steps redone are exactly those since that checkpoint; and the
  samples of every step equal the uninterrupted run's (none skipped, none repeated).
- 2 agents of 1 rank each (``--nnodes 1:2``): one agent and its rank are killed (a node
  lost); the other continues alone on 1 rank, keeping the global batch, from the newest
  checkpoint, reads the same samples per step, and ends within float tolerance of the
  uninterrupted 2-rank run.
"""
from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch

from zero_core.testing.elastic import kill, kill_tree, read_json_lines, start_elastic
from zero_core.testing.ranks import free_port, run_ranks

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "workers", "resume_train.py")
pytestmark = pytest.mark.multirank


def _torchrun(opts: dict, out: str, nnodes: str, nproc: int, port: int):
    return start_elastic(WORKER, [json.dumps(opts)], out, port, nnodes, nproc,
                         env={"ZERO_CORE_COMM": "gloo", "ZERO_CORE_COMM_TIMEOUT": "30"})


def _latest_step(save_dir: str) -> int:
    try:
        with open(os.path.join(save_dir, "latest")) as fh:
            return int(fh.read().strip().replace("global_step", ""))
    except (OSError, ValueError):
        return 0


def _per_step_samples(lines: list[dict], cut: dict) -> dict:
    """{step: sorted sample ids} of the micro-steps that count: those of each attempt up to
    the step the next attempt resumed from (*cut*: attempt -> last counted step)."""
    steps: dict = {}
    for line in lines:
        limit = cut.get(line["attempt"])
        # a line's "step" is the step count after its micro-step: the micro-step belongs
        # to step "step + 1" unless it ended one
        gas = 2 if line["world"] == 1 else 1
        step = (line["micro"] - 1) // gas + 1
        if limit is None or step <= limit:
            steps.setdefault(step, []).extend(line["ids"])
    return {s: sorted(v) for s, v in steps.items()}


def _resumed_at(lines: list[dict]) -> int:
    """The optimizer step an attempt started from (its first micro-step's step count)."""
    gas = 2 if lines[0]["world"] == 1 else 1
    return min((x["micro"] - 1) // gas for x in lines)


def _straight(tmp, opts) -> tuple[dict, dict]:
    log = str(tmp / "straight.log")
    run_ranks(WORKER, 2, "torchrun", args=[json.dumps({**opts, "save_dir": None,
                                                        "log": log, "slow_write": 0,
                                                        "step_sleep": 0,
                                                        "final": str(tmp / "straight.pt")})],
              env={"ZERO_CORE_COMM": "gloo"}, timeout=300)
    return torch.load(tmp / "straight.pt"), _per_step_samples(read_json_lines(log), {})


def test_killed_ranks_restart_and_finish_bit_identical(tmp_path):
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    interval, steps = 4, 30
    opts = {"save_dir": str(tmp_path / "ck"), "steps": steps, "interval": interval,
            "async": True, "samples": 96, "micro": 4, "log": str(tmp_path / "log"),
            "final": str(tmp_path / "final.pt"), "slow_write": 0.25, "step_sleep": 0.02}
    first = rng.randint(3, 7)
    targets = [first, first + rng.randint(6, 9)]
    targets.append(targets[-1] + rng.randint(6, 8))
    during_save = rng.randrange(3)  # this kill comes just after a save started
    job = _torchrun(opts, str(tmp_path / "out"), "1", 2, free_port())
    kills, deadline = [], time.monotonic() + 240
    try:
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
            if len(kills) == len(targets):
                continue
            lines = read_json_lines(opts["log"])
            attempt = max((x["attempt"] for x in lines), default=0)
            if kills and attempt <= kills[-1]["attempt"]:
                continue  # the killed attempt has not been replaced yet
            now = [x for x in lines if x["attempt"] == attempt]
            target = targets[len(kills)]
            if len(kills) == during_save:  # the first save step at or after the target
                target = -(-target // interval) * interval
            hit = [x for x in now if x["step"] >= target]
            if not hit:
                continue
            victim = hit[0] if rng.random() < 0.5 else hit[-1]
            partial = [n for n in os.listdir(opts["save_dir"]) if n.endswith(".partial")]
            latest = _latest_step(opts["save_dir"])
            kill([victim["pid"]])
            kills.append({"attempt": attempt, "rank": victim["rank"], "latest": latest,
                          "partial": partial,
                          "last_step": max(x["step"] for x in read_json_lines(opts["log"])
                                           if x["attempt"] == attempt)})
        rc = job.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        kill_tree(job.pid)
    with open(tmp_path / "out") as fh:
        out = fh.read()
    why = f"seed {seed}, kills {kills}\n{out[-4000:]}"
    assert rc == 0 and len(kills) == 3, why
    assert any(k["partial"] for k in kills), f"no kill landed during an async save: {why}"

    lines = read_json_lines(opts["log"])
    attempts = sorted({x["attempt"] for x in lines})
    resumed = {a: _resumed_at([x for x in lines if x["attempt"] == a]) for a in attempts[1:]}
    cut = {}
    for dead in kills:
        after = min(a for a in attempts if a > dead["attempt"])
        # the restart resumed from the checkpoint `latest` named when the rank died (or the
        # one an async save in flight committed in the same instant)
        assert resumed[after] in (dead["latest"], dead["latest"] + interval), why
        assert resumed[after] % interval == 0
        cut[dead["attempt"]] = resumed[after]
        redone = dead["last_step"] - resumed[after]
        assert 0 <= redone <= dead["last_step"] - dead["latest"], why
    final, straight_steps = _straight(tmp_path, opts)
    mine = torch.load(opts["final"])
    assert all(torch.equal(mine[k], final[k]) for k in final), f"weights differ: {why}"
    assert _per_step_samples(lines, cut) == straight_steps, why


def test_a_lost_node_continues_on_the_remaining_rank(tmp_path):
    opts = {"save_dir": str(tmp_path / "ck"), "steps": 20, "interval": 4, "async": True,
            "samples": 96, "micro": 4, "log": str(tmp_path / "log"),
            "final": str(tmp_path / "final.pt"), "step_sleep": 0.05}
    port = free_port()
    a = _torchrun(opts, str(tmp_path / "out_a"), "1:2", 1, port)
    time.sleep(0.3)
    b = _torchrun(opts, str(tmp_path / "out_b"), "1:2", 1, port)
    killed_at = None
    deadline = time.monotonic() + 200
    try:
        while a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
            if killed_at is None and any(x["world"] == 2 and x["step"] >= 9
                                         for x in read_json_lines(opts["log"])):
                killed_at = (time.monotonic(), _latest_step(opts["save_dir"]))
                kill_tree(b.pid)
        rc = a.wait(timeout=max(1.0, deadline - time.monotonic()))
        finished = time.monotonic()
    finally:
        kill_tree(a.pid)
        kill_tree(b.pid)
    with open(tmp_path / "out_a") as fh:
        out = fh.read()
    assert rc == 0 and killed_at is not None, out[-4000:]
    lines = read_json_lines(opts["log"])
    alone = [x for x in lines if x["world"] == 1]
    assert alone and max(x["step"] for x in alone) == 20, out[-4000:]
    resumed = _resumed_at(alone)
    assert resumed in (killed_at[1], killed_at[1] + 4)
    assert "now 1; global batch 8 kept: accumulation 1 -> 2" in out
    two = max(x["attempt"] for x in lines if x["world"] == 2)
    final, straight_steps = _straight(tmp_path, {**opts, "step_sleep": 0})
    assert _per_step_samples(lines, {two: resumed}) == straight_steps
    mine = torch.load(opts["final"])
    for k in final:
        assert torch.allclose(mine[k], final[k], rtol=1e-5, atol=1e-6), k
    print(f"lost node: recovered and finished {finished - killed_at[0]:.1f} s after the kill")
