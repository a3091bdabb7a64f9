"""Multi-rank worker for tests/test_save_16bit_model.py: train 3 steps at each ZeRO stage
(same weights, same data) and save_16bit_model, with and without the frozen parameters.

Usage: ``python save16.py <dir> <precision>``; reports, per stage, what save_16bit_model
returned and the file's keys and dtypes (rank 0 reads the files)."""
from __future__ import annotations

import os
import sys

import torch

import zero_core
from zero_core.testing.ranks import leave_rank, report


def run(stage: int, directory: str, precision: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    model[0].bias.requires_grad_(False)  # a frozen parameter
    cfg = {"train_micro_batch_size_per_gpu": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage,
                                 "stage3_gather_16bit_weights_on_model_save": True}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zero_core.initialize(model=model, config=cfg,
                                      model_parameters=[p for p in model.parameters()
                                                        if p.requires_grad])
    g = torch.Generator().manual_seed(1 + engine.global_rank)
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        out = engine(x.to(engine.compute_dtype)).float()
        engine.backward(torch.nn.functional.mse_loss(out, y))
        engine.step()
    out = {}
    for name, exclude in (("all", False), ("trainable", True)):
        path = os.path.join(directory, f"s{stage}")
        ok = engine.save_16bit_model(path, f"{name}.bin", exclude_frozen_parameters=exclude)
        out[name] = {"returned": ok}
        if engine.global_rank == 0:
            sd = torch.load(os.path.join(path, f"{name}.bin"), weights_only=True)
            out[name].update(keys=sorted(sd), dtypes=sorted({str(v.dtype) for v in sd.values()}),
                             values={k: v.float().flatten().tolist() for k, v in sd.items()})
    engine.destroy()
    return out


if __name__ == "__main__":
    directory, precision = sys.argv[1], sys.argv[2]
    report({str(stage): run(stage, directory, precision) for stage in (0, 1, 2, 3)})
    leave_rank()
