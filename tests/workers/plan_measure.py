"""Rank program for tests/test_plan.py: the memory ledger of real engines, to hold the
planner's prediction against at this world size.

Usage: ``plan_measure.py '<json: {"overrides": {...}, "cases": [[stage, precision], ...],
"steps": 0, "zero": {...}}>'``. For every case an engine is built on examples/gpt.py's tiny
preset (with *overrides*; *zero*: extra zero_optimization keys), trained *steps* steps
(the communication pools fill on use), and the rank reports its ledger, Ψ and padding."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import torch  # noqa: E402

import zero_core  # noqa: E402
from gpt import build_model, lm_loss  # noqa: E402
from zero_core.testing.ranks import leave_rank, report  # noqa: E402

task = json.loads(sys.argv[1])
out = []
for stage, precision in task["cases"]:
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": stage, **task.get("zero", {})},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    model = build_model("tiny", seed=0, **task["overrides"])
    engine, *_ = zero_core.initialize(model=model, config=config)
    for _ in range(task.get("steps", 0)):
        x = torch.randint(0, model.cfg.vocab_size, (1, model.cfg.block_size + 1))
        engine.backward(lm_loss(engine(x[:, :-1]), x[:, 1:]))
        engine.step()
    rep = engine.memory_report()
    out.append({"stage": stage, "precision": precision, "ledger": rep["ledger"],
                "num_parameters": rep["num_parameters"],
                "padding_elements": rep["padding_elements"]})
    engine.destroy()
report(out)
leave_rank()
