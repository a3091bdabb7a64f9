"""DeepSpeed's input-casting, autocast, gradient-averaging and bf16 overflow options, as the
engine applies them (one process; the multi-rank reductions are in test_grad_dtypes.py).

Each case runs the engine and an independent reference — plain torch arithmetic on a copy of
the model, in float64 where the engine computes in fp32 — on fresh random inputs.
"""
from __future__ import annotations

import copy

import pytest
import torch

import zero_core
from zero_core.errors import ConfigError


class Probe(torch.nn.Module):
    """Two linear layers that record the dtype of every input they were called with."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        self.seen.append(x.dtype)
        h = self.a(x)
        self.seen.append(h.dtype)
        return self.b(torch.tanh(h))


def engine_for(model, stage=0, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    return engine


@pytest.mark.parametrize("precision,auto_cast,expected", [
    ("fp16", True, torch.float16),     # fp16.auto_cast: floating inputs become fp16
    ("fp16", False, torch.float32),    # DeepSpeed's default: inputs keep their dtype
    ("bf16", None, torch.float32),     # bf16 has no input casting in DeepSpeed
])
def test_inputs_are_cast_only_with_fp16_auto_cast(precision, auto_cast, expected):
    section = {"enabled": True}
    if auto_cast is not None:
        section["auto_cast"] = auto_cast
    model = Probe()
    engine = engine_for(model, **{precision: section})
    try:
        x = torch.randn(4, 6)
        ids = torch.arange(4)
        if expected == torch.float32:
            # the caller casts, as with DeepSpeed; the engine must not have done it
            with pytest.raises(RuntimeError, match="dtype"):
                engine(x)
            assert model.seen[0] == torch.float32
            model.seen.clear()
            engine(x.to(engine.compute_dtype))
        else:
            engine(x)
            assert model.seen[0] == expected
        assert engine._to_device(ids).dtype == torch.int64  # integer inputs never change
    finally:
        engine.destroy()


def test_torch_autocast_runs_the_forward_under_autocast_and_keeps_fp32_parameters():
    torch.manual_seed(0)
    model = Probe()
    reference = copy.deepcopy(model)
    engine = engine_for(model, torch_autocast={"enabled": True, "dtype": "bfloat16"})
    try:
        assert all(p.dtype == torch.float32 for p in model.parameters())
        x = torch.randn(4, 6)
        loss = engine(x).float().pow(2).mean()
        assert model.seen == [torch.float32, torch.bfloat16]  # Linear ran in bf16
        engine.backward(loss)
        engine.step()
        # reference: the same autocast forward, fp32 gradients, one SGD step by hand
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            ref_loss = reference(x).float().pow(2).mean()
        ref_loss.backward()
        with torch.no_grad():
            for p, r in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p, r - 0.1 * r.grad, rtol=1e-6, atol=1e-7)
    finally:
        engine.destroy()


def test_torch_autocast_excludes_fp16():
    # bf16 + torch_autocast is DeepSpeed's combination: tests/test_torch_autocast.py
    with pytest.raises(ConfigError, match="torch_autocast.enabled"):
        engine_for(Probe(), torch_autocast={"enabled": True}, fp16={"enabled": True})


@pytest.mark.parametrize("stage", [0, 2])
def test_gradient_predivide_factor_splits_the_average(stage):
    """f != 1: gradients are divided by f before the reduction and by world/f after it, so
    the reduced buffer holds f-times-smaller values until the step, and the update is the
    one of the plain mean (world size 1 here: the mean is the gradient itself)."""
    torch.manual_seed(1)
    f = 8.0
    model = Probe()
    reference = copy.deepcopy(model).double()
    engine = engine_for(model, stage=stage, gradient_predivide_factor=f,
                        gradient_clipping=0.0)
    try:
        x = torch.randn(4, 6)
        engine.backward(engine(x).pow(2).mean())
        engine.reducer.wait_all()  # overlap_comm: the last bucket may still be in flight
        grads = [t.clone() for gb in engine.parts.buffers if gb is not None
                 for t in gb.reduced_grad_tensors()]
        reference(x.double()).pow(2).mean().backward()
        flat_ref = torch.cat([r.grad.reshape(-1) for r in reference.parameters()])
        assert torch.cat([g.reshape(-1) for g in grads]).double().abs().sum() == pytest.approx(
            float(flat_ref.abs().sum() / f), rel=1e-5)
        engine.step()
        with torch.no_grad():
            for p, r in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.double(), r - 0.1 * r.grad, rtol=1e-5, atol=1e-6)
        assert engine.get_global_grad_norm() == pytest.approx(float(flat_ref.norm()), rel=1e-5)
    finally:
        engine.destroy()


@pytest.mark.parametrize("check", [True, False])
def test_bf16_non_finite_step_is_skipped_with_check_grad_overflow(check):
    torch.manual_seed(2)
    model = Probe()
    engine = engine_for(model, stage=2, bf16={"enabled": True, "check_grad_overflow": check})
    try:
        x = torch.randn(4, 6).bfloat16()
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        before = [p.detach().clone() for p in model.parameters()]
        engine.backward(engine(x).float().pow(2).mean() * float("inf"))
        engine.step()
        after = list(model.parameters())
        if check:
            # DeepSpeed 0.19.8's default: the step is skipped on every rank, weights untouched
            assert engine.skipped_steps == 1
            assert all(torch.equal(a, b) for a, b in zip(after, before))
            assert engine.get_global_grad_norm() == float("inf")
        else:
            assert engine.skipped_steps == 0
            assert any(not torch.isfinite(a).all() for a in after)
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_gradient_accumulation_in_the_ledger_and_the_formula(stage):
    """data_types.grad_accum_dtype fp32 under bf16: the accumulator costs 4 bytes per element
    (stage 1: the full buffer; stages 2-3: the partition), in the ledger and the formula."""
    from zero_core.memory import model_state_breakdown
    torch.manual_seed(3)
    engine = engine_for(Probe(), stage=stage, bf16={"enabled": True},
                        data_types={"grad_accum_dtype": "fp32"})
    try:
        engine.backward(engine(torch.randn(4, 6).bfloat16()).float().pow(2).mean())
        engine.step()
        rep = engine.memory_report()
        form = model_state_breakdown(stage, engine.num_parameters, 1, "bf16", 4,
                                     grads_dtype="fp32")
        assert rep["formula"]["gradients"] == form["gradients"] == 4 * engine.num_parameters
        pad = rep["padding_elements"]
        assert 0 <= rep["ledger"]["gradients"] - form["gradients"] <= 4 * pad
    finally:
        engine.destroy()
