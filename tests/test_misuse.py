"""Misuse of the training API is an error naming it, never a silent update (issue 16).

``engine.step()`` at an accumulation boundary with no ``engine.backward(loss)`` since the
last update would apply an update from zero gradients (Adam still moves the weights) and
count a step; ``loss.backward()`` instead of ``engine.backward(loss)`` bypasses the engine's
scaling and reduction. Both are refused, at every stage, and leave the weights as they were.
"""
from __future__ import annotations

import pytest
import torch

import zero_core
from zero_core.errors import ZeroCoreError


def _engine(stage: int, accumulation: int = 1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    engine, *_ = zero_core.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    return engine


def _weights(engine) -> list[torch.Tensor]:
    with zero_core.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_without_backward_is_refused_and_changes_nothing(stage):
    engine = _engine(stage)
    try:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(stage))
        before = _weights(engine)
        with pytest.raises(ZeroCoreError, match=r"engine.step\(\).*no engine.backward\(loss\)"):
            engine.step()
        assert engine.global_steps == 0
        assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine)))
        # the right order works, and after an update the next one needs its own backward
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        assert engine.global_steps == 1
        assert not all(torch.equal(a, b) for a, b in zip(before, _weights(engine)))
        with pytest.raises(ZeroCoreError, match="no engine.backward"):
            engine.step()
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_loss_backward_instead_of_engine_backward_is_refused(stage):
    engine = _engine(stage)
    try:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + stage))
        before = _weights(engine)
        engine(x).pow(2).mean().backward()
        with pytest.raises(ZeroCoreError, match=r"not loss.backward\(\)"):
            engine.step()
        assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine)))
    finally:
        engine.destroy()


def test_steps_inside_an_accumulation_window_need_no_backward_each():
    """Between boundaries step() only counts the micro-step (DeepSpeed's contract); the
    update at the boundary needs a backward somewhere in the window."""
    engine = _engine(2, accumulation=2)
    try:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(7))
        engine.backward(engine(x).pow(2).mean())
        engine.step()                      # micro-step 0: no update
        engine.step()                      # boundary: the window had a backward
        assert engine.global_steps == 1
        engine.step()                      # micro-step 2: not a boundary, nothing to check
        with pytest.raises(ZeroCoreError, match="no engine.backward"):
            engine.step()                  # boundary of a window without any backward
    finally:
        engine.destroy()
