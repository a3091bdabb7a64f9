"""``gradient_clipping``'s default is DeepSpeed's: a config without the key clips the global
gradient norm at 1.0, and 0.0 turns clipping off.

DeepSpeed 0.19.8 defaults the key to 1.0 at every stage (runtime/constants.py; checked on
this machine: an SGD step with gradient norm ~3.8e4 and no key moves the weights by 1.0·lr
at stages 0-3, by the full gradient with ``"gradient_clipping": 0``). Here each engine step
is compared with a float64 SGD step on the same fresh random data: clipped with
``torch.nn.utils.clip_grad_norm_``'s coefficient ``min(1, c / (norm + 1e-6))`` when the key
is absent (c = 1) or set, unclipped with 0.0. The gradients are large on purpose (norm > 2)
so that the clipped and the unclipped step differ far beyond the tolerance. Also the
integrations' translations of their frameworks' "no clipping" (HF ``max_grad_norm`` None/0,
Lightning ``gradient_clip_val`` None/0), which must be written as an explicit 0.0.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import zero_core
from zero_core.config import parse_config

LR = 0.05


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _reference(seed: int, x, y, clip: float) -> tuple[dict, float]:
    """One float64 SGD step (clipped at *clip* when > 0); the parameters and the norm."""
    model = _model(seed).double()
    loss = torch.nn.functional.mse_loss(model(x.double()), y.double())
    grads = torch.autograd.grad(loss, list(model.parameters()))
    norm = torch.sqrt(sum(g.square().sum() for g in grads)).item()
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= LR * coef * g
    return {k: v for k, v in model.state_dict().items()}, norm


def _engine_step(seed: int, x, y, stage: int, clip) -> tuple[dict, float]:
    cfg = {"train_micro_batch_size_per_gpu": x.shape[0],
           "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if clip is not None:
        cfg["gradient_clipping"] = clip
    engine, _, _, _ = zero_core.initialize(model=_model(seed), config=cfg)
    try:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return engine.module_state_dict(), engine.get_global_grad_norm()
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("clip", [None, 0.0, 0.5], ids=["absent", "off", "0.5"])
def test_absent_key_clips_at_one_and_zero_turns_it_off(stage, clip):
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 6, generator=gen) * 4
    y = torch.randn(5, 3, generator=gen) * 40    # a gradient norm well above 1
    effective = 1.0 if clip is None else clip
    want, norm = _reference(seed, x, y, effective)
    unclipped, _ = _reference(seed, x, y, 0.0)
    got, engine_norm = _engine_step(seed, x, y, stage, clip)
    assert norm > 2, f"seed {seed}: the test needs a gradient norm above 2, got {norm}"
    assert engine_norm == pytest.approx(norm, rel=1e-4)
    for name, ref in want.items():
        torch.testing.assert_close(got[name].double(), ref, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"seed {seed}, {name}: {m}")
    if effective > 0:   # clipping changed the step, far beyond the tolerance above
        assert max((unclipped[n] - want[n]).abs().max().item() for n in want) > 1e-3


def test_parsed_default_and_explicit_values():
    base = {"train_micro_batch_size_per_gpu": 1}
    assert parse_config(base, world_size=1).gradient_clipping == 1.0
    assert parse_config({**base, "gradient_clipping": 0}, world_size=1).gradient_clipping == 0.0


@pytest.mark.parametrize("max_grad_norm,want", [(1.0, 1.0), (0.3, 0.3), (0.0, 0.0),
                                                (None, 0.0)])
def test_hf_max_grad_norm_off_is_written_as_zero(max_grad_norm, want):
    from zero_core.integrations.transformers.auto_values import fill_auto_values, trainer_clipping
    args = SimpleNamespace(max_grad_norm=max_grad_norm)
    assert trainer_clipping(args) == want
    full = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1,
                           world_size=1, max_grad_norm=max_grad_norm, learning_rate=1e-3,
                           adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                           weight_decay=0.0, warmup_steps=0, fp16=False, bf16=False)
    assert fill_auto_values({"gradient_clipping": "auto"}, full)["gradient_clipping"] == want


@pytest.mark.parametrize("clip_val,config,want", [
    (None, {}, 0.0), (0.0, {}, 0.0), (None, {"gradient_clipping": "auto"}, 0.0),
    (0.5, {}, 0.5), (0.5, {"gradient_clipping": 0.5}, 0.5),
    (None, {"gradient_clipping": 2.0}, 2.0)])
def test_lightning_gradient_clip_val_none_is_written_as_zero(clip_val, config, want):
    pytest.importorskip("lightning")
    from zero_core.integrations.lightning import apply_trainer_settings
    trainer = SimpleNamespace(accumulate_grad_batches=1, gradient_clip_val=clip_val,
                              gradient_clip_algorithm="norm")
    config = dict(config)
    apply_trainer_settings(config, trainer)
    assert config["gradient_clipping"] == want
