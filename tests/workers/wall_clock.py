"""Multi-rank worker for tests/test_wall_clock_breakdown.py: ``wall_clock_breakdown`` and
``steps_per_print`` on real ranks.

Usage: ``python wall_clock.py <stage>[,<stage>...]`` on every rank. Per stage it trains
STEPS optimizer steps of GAS micro-steps with the breakdown on and steps_per_print PRINT,
printing its own marker ``== <stage> after step <n>`` after each optimizer step (so the test
can see, in each rank's output, after which step each line came), and reports per stage the
last step's per-phase bytes (``engine.wall_clock.last_comm``), the step's ledger total
(``engine.comm_report()``) and ``engine.get_wall_clock_timers()``.
"""
from __future__ import annotations

import sys

import torch

import zero_core
from zero_core.runtime.context import shutdown
from zero_core.testing.ranks import report

STEPS, GAS, PRINT, MICRO = 4, 2, 2, 4


def train(stage: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    engine, *_ = zero_core.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage}, "wall_clock_breakdown": True,
        "steps_per_print": PRINT, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    g = torch.Generator().manual_seed(engine.global_rank)
    for step in range(STEPS):
        for _ in range(GAS):
            loss = engine(torch.randn(MICRO, 16, generator=g)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        print(f"== {stage} after step {step + 1}", flush=True)
    out = {"last_comm": engine.wall_clock.last_comm,
           "step_sent_bytes": engine.comm_report()["sent_bytes"],
           "timers": engine.get_wall_clock_timers(), "rank": engine.global_rank}
    engine.destroy()
    print(f"== {stage} destroyed", flush=True)
    return out


def main():
    stages = [int(s) for s in sys.argv[1].split(",")]
    zero_core.init_distributed()
    report({str(stage): train(stage) for stage in stages})
    shutdown()


if __name__ == "__main__":
    main()
