"""Rank program: ``checkpoint.tag_validation`` with tags that differ across ranks.

Usage: ``tag_check.py DIR``. For each mode ("Fail", then "Warn") the rank trains one step
and saves into ``DIR/<mode>`` under the tag ``t<rank>``; it reports per mode the directory
saved or the error text, the warnings, what the directory holds, and what loads back.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

import zero_core
from zero_core.checkpoint.store import CheckpointError
from zero_core.testing.ranks import report

out = {}
for mode in ("Fail", "Warn"):
    directory = os.path.join(sys.argv[1], mode)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    engine, *_ = zero_core.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "checkpoint": {"tag_validation": mode}})
    engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
    engine.step()
    res = out[mode] = {"rank": engine.global_rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res["saved"] = os.path.basename(
                engine.save_checkpoint(directory, tag=f"t{engine.global_rank}"))
        except CheckpointError as exc:
            res["error"] = str(exc)
    res["warnings"] = [str(w.message) for w in caught if "tags differ" in str(w.message)]
    res["dirs"] = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    if "saved" in res:
        path, _ = engine.load_checkpoint(directory, tag=res["saved"])
        res["loaded"] = os.path.basename(path)
    engine.destroy()
report(out)
