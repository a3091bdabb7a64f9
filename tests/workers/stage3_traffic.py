"""Multi-rank worker for tests/test_stage3_traffic.py: what plain ZeRO-3 puts on the
wire in one optimizer step, by the ledger, for settings where the formula is exact.

Usage: ``python stage3_traffic.py`` on every rank. For each scenario (precision,
persistence threshold, reuse distance, live window) a fresh engine trains the same stack
of LayerNorm + bias-free Linear(64, 64) blocks for three steps; the report holds the last
step's ledger (engine.comm_report()) and the model's parameter counts split the way the
engine's rule splits them (a parameter with fewer elements than the threshold is
persistent), counted here from the model, not from the engine. Sizes are multiples of 128 elements, so that no
unit is padded at 2 or 4 ranks in fp32 or bf16 (64-byte alignment); the report includes
the engine's padded and unpadded unit sizes so that the test can hold it to that.
"""
from __future__ import annotations

import torch

import zero_core
from zero_core.testing.ranks import leave_rank, report

WIDTH, BLOCKS, MICRO = 64, 4, 2

BLOCK = WIDTH * WIDTH + 2 * WIDTH    # one LayerNorm + Linear: one fetch unit
SCENARIOS = {
    # name: (precision, stage3_param_persistence_threshold, stage3_max_reuse_distance,
    #        stage3_max_live_parameters)
    "regather-fp32": ("fp32", 0, 0, 2 * BLOCK),
    "regather-bf16": ("bf16", 0, 0, 2 * BLOCK),
    "one-unit-window-fp32": ("fp32", 0, 0, BLOCK),
    "window-keeps-all-fp32": ("fp32", 0, 0, 10**9),
    "keep-fp32": ("fp32", 0, 10**9, 10**9),
    "persistent-norms-fp32": ("fp32", 100, 0, 2 * WIDTH * WIDTH),
    "all-persistent-bf16": ("bf16", 10**6, 0, 10**9),
}


def kept_for_backward(blocks: list[int], max_live: int) -> int:
    """Gathered elements the forward leaves gathered for the backward (the rule stated
    independently of the coordinator): the last block, whose next use is the backward's
    first request; before it, going back, each block while the live window holds it with
    the ones after it, since the prefetcher would gather those again before their next
    use anyway."""
    kept = blocks[-1] if blocks else 0
    for n in reversed(blocks[:-1]):
        if kept + n > max_live:
            break
        kept += n
    return kept


def build() -> torch.nn.Module:
    layers = []
    for _ in range(BLOCKS):
        layers += [torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH, bias=False)]
    return torch.nn.Sequential(*layers)


def run(precision: str, threshold: int, reuse: int, max_live: int) -> dict:
    torch.manual_seed(0)
    model = build()
    params = list(model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           # reduce_bucket_size caps a fetch unit: one LayerNorm + Linear block each
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold,
                                 "stage3_max_reuse_distance": reuse,
                                 "stage3_max_live_parameters": max_live,
                                 "reduce_bucket_size": WIDTH * WIDTH}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zero_core.initialize(model=model, model_parameters=params, config=cfg)
    gen = torch.Generator().manual_seed(1 + engine.global_rank)
    for _ in range(3):
        x = torch.randn(MICRO, WIDTH, generator=gen)
        x = x.to(torch.bfloat16) if precision == "bf16" else x
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    out = {"comm": engine.comm_report(),
           "world_size": engine.world_size,
           "persistent_elements": sum(p.numel() for p in params if p.numel() < threshold),
           "gathered_elements": sum(p.numel() for p in params if p.numel() >= threshold),
           "trainable_elements": sum(p.numel() for p in params),
           "kept_elements": kept_for_backward(
               [sum(p.numel() for p in model[i:i + 2].parameters() if p.numel() >= threshold)
                for i in range(0, len(model), 2)], max_live),
           "unit_numel": sum(u.numel for u in engine.parts.units),
           "unit_padded_numel": sum(u.padded_numel for u in engine.parts.units),
           "units": len(engine.parts.units),
           "persistent_units": sum(u.persistent for u in engine.parts.units)}
    engine.destroy()
    return out


def main():
    report({name: run(*spec) for name, spec in SCENARIOS.items()})
    leave_rank()


if __name__ == "__main__":
    main()
