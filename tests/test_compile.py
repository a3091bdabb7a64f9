"""torch.compile through ``engine.compile()`` (zero_core/engine/compile.py), on the CPU with
inductor: compiled training equals eager training.

Reference: the same engine, same seed and data, not compiled. The demo GPT (2 blocks) trains
3 optimizer steps (2 micro-steps each, clipping active) at stages 0-3; HF's GPT-2 trains
through ZeroCoreTrainer with ``torch_compile=True`` against ``torch_compile=False``. The
optimizer is SGD with momentum: its update is linear in the gradient, so the ~1e-8 relative
differences of inductor's fused kernels (another summation order) stay ~1e-8 in the weights;
Adam divides by the gradient's running RMS and can turn such noise in a near-zero gradient
entry into a full learning-rate step (measured 2e-4 after 3 steps), which says nothing about
compile. Bound: 1e-6 relative, as the issue asks; measured ~1e-8.

Stage 3 gathers parameters in hooks on every module, which run eagerly: each submodule call
inside a compiled block is a graph break, counted in ``engine.compile_report()``; stages 0-2
compile each block whole (no break).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import zero_core
from zero_core.errors import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt  # noqa: E402

RTOL = 1e-6
CFG = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def _train(stage: int, compiled: bool, steps: int = 3, wrapped: bool = False):
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    if wrapped:   # the user compiled the whole model before initialize()
        model = torch.compile(model)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.5, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    engine, *_ = zero_core.initialize(model=model, config=config)
    if compiled and not wrapped:
        engine.compile()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps * 2):
        idx = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
        loss = gpt.lm_loss(engine(idx[:, :-1]), idx[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    params = {k: v.detach().double().clone() for k, v in engine.module_state_dict().items()}
    report = engine.compile_report()
    engine.destroy()
    return losses, params, report


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).norm()) ** 2 for k in b) ** 0.5
    return num / sum(float(b[k].norm()) ** 2 for k in b) ** 0.5


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_training_equals_eager_training(stage):
    losses_e, params_e, _ = _train(stage, compiled=False)
    losses_c, params_c, report = _train(stage, compiled=True)
    assert report["compiled"] and report["blocks"] == CFG.n_layer
    assert report["block_class"] == ["Block"]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses_c, losses_e)) <= RTOL
    assert _rel(params_c, params_e) <= RTOL, _rel(params_c, params_e)
    if stage == 3:   # each submodule's gather hook is a break between compiled regions
        assert report["graph_breaks"] > 0, report
    else:            # blocks compile whole (already-compiled code is reused across stages)
        assert report["graph_breaks"] == 0, report


@pytest.mark.slow
def test_a_model_compiled_before_initialize_trains_at_stage_3_as_eager():
    """initialize(model=torch.compile(m)): dynamo cannot trace stage 3's gather hooks (it
    failed in the first forward); the engine unwraps the model and compiles its blocks."""
    losses_e, params_e, _ = _train(3, compiled=False)
    losses_c, params_c, report = _train(3, compiled=True, wrapped=True)
    assert report["compiled"] and report["blocks"] == CFG.n_layer
    assert max(abs(a - b) / abs(b) for a, b in zip(losses_c, losses_e)) <= RTOL
    assert _rel(params_c, params_e) <= RTOL, _rel(params_c, params_e)
    assert not any(k.startswith("_orig_mod") for k in params_c)


@pytest.mark.slow
def test_hf_trainer_torch_compile_equals_eager(tmp_path):
    """TrainingArguments(torch_compile=True) through ZeroCoreTrainer at stage 3."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
    from hf_trainer_common import TokenData, full_params, make_model
    from zero_core.integrations.transformers import ZeroCoreTrainer

    def run(compiled: bool):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(compiled)), use_cpu=True, report_to=[],
            disable_tqdm=True, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=2, learning_rate=0.05, optim="sgd", max_grad_norm=0.5,
            save_strategy="no", torch_compile=compiled, seed=3, dataloader_num_workers=0)
        model = make_model(3)
        trainer = ZeroCoreTrainer(model=model, args=args, train_dataset=TokenData(3, 16),
                                  zero_config={"zero_optimization": {"stage": 3}})
        trainer.train()
        out = full_params(model), trainer._engine.is_compiled
        trainer._engine.destroy()
        return out

    eager, was_compiled = run(False)
    compiled, is_compiled = run(True)
    assert is_compiled and not was_compiled
    rel = sum(float((compiled[k].double() - eager[k].double()).norm()) ** 2 for k in eager) ** 0.5
    rel /= sum(float(eager[k].double().norm()) ** 2 for k in eager) ** 0.5
    assert rel <= RTOL, rel


def test_deepcompile_and_schedules_are_refused_by_name():
    with pytest.raises(ConfigError, match="DeepCompile"):
        zero_core.initialize(model=torch.nn.Linear(2, 2), config={
            "train_micro_batch_size_per_gpu": 1, "compile": {"deepcompile": True},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine, *_ = zero_core.initialize(model=torch.nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "compile": {"deepcompile": False},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        with pytest.raises(ConfigError, match="DeepCompile"):
            engine.compile(schedule=[(0, "prefetch")])
        with pytest.raises(ConfigError, match="backend="):
            engine.compile(compile_kwargs={"backend": "eager"})
        assert not engine.is_compiled and engine.compile_report() == {"compiled": False}
    finally:
        engine.destroy()


def test_blocks_are_the_repeated_children():
    from zero_core.engine.compile import find_blocks
    model = gpt.GPT(CFG)
    assert find_blocks(model) == list(model.blocks)
    plain = torch.nn.Linear(3, 3)
    assert find_blocks(plain) == [plain]


@pytest.mark.slow
def test_lightning_fits_a_compiled_module_by_compiling_its_blocks():
    """trainer.fit(torch.compile(module)) with ZeroCoreStrategy: the strategy undoes
    Lightning's whole-step compile and compiles through the engine instead."""
    pl = pytest.importorskip("lightning.pytorch")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
    import lightning_common as C
    from zero_core.integrations.lightning import ZeroCoreStrategy
    saved = dict(os.environ)   # Lightning's launcher writes MASTER_ADDR, WORLD_SIZE, ...

    def fit(compiled: bool):
        module = C.lightning_module_class()(5, sched=False)
        strategy = ZeroCoreStrategy(stage=2)
        trainer = pl.Trainer(strategy=strategy, **C.trainer_kwargs(devices=1, max_epochs=1))
        trainer.fit(torch.compile(module) if compiled else module)
        return ({k: v.detach().double().clone() for k, v in module.state_dict().items()},
                strategy.engine.is_compiled)
    try:
        eager, was = fit(False)
        compiled, now = fit(True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert now and not was
    # AdamW here (Lightning's example optimizer): compiled and eager agree to ~1e-7
    assert _rel(compiled, eager) <= 1e-5, _rel(compiled, eager)
