"""Stage 3 in one process: the saved-tensor hooks (zero_core/stage3/saved_views.py) and
unregistering an external parameter.

The multi-rank tests (test_stage3_multirank.py) check that training with them matches the
single-process reference and that no released unit's buffer stays alive after forward;
these check the two paths a normal training step does not take: unpacking a view whose
unit is not gathered (it gathers it), and replaying a graph after an optimizer step (an
error, not silently new values)."""
from __future__ import annotations

import pytest
import torch

import zero_core
from zero_core.errors import ZeroCoreError
from zero_core.stage3.partitioned_params import ParameterNotGatheredError
from zero_core.stage3.units import UnitState


class ReadsAnotherModulesWeight(torch.nn.Module):
    """The head reads the first layer's weight in its own forward (an external parameter)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(12, 16)
        self.head = Head(self.first)

    def forward(self, x):
        return self.head(torch.tanh(self.first(x)))


class Head(torch.nn.Module):
    def __init__(self, first):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.__dict__["first"] = first     # not a submodule: only its weight is read

    def forward(self, h):
        return torch.tanh(self.proj(h)) @ self.first.weight


def make_engine(seed: int, model=None):
    torch.manual_seed(seed)
    if model is None:
        model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 12), torch.nn.Tanh(),
                                    torch.nn.Linear(12, 4))
    cfg = {"train_micro_batch_size_per_gpu": 3,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           # one unit per weight, nothing persistent, nothing kept gathered after use
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 1, "reduce_bucket_size": 1,
                                 "stage3_max_live_parameters": 1,
                                 "stage3_max_reuse_distance": 0}}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    return engine


@pytest.fixture
def seed():
    return int.from_bytes(__import__("os").urandom(4), "little")


def test_unpacking_a_released_unit_gathers_it_again(seed):
    engine = make_engine(seed)
    try:
        views = engine.parts.module_hooks.saved_views
        u = next(u for u in engine.parts.units if u.numel > 100)
        engine.parts.gatherer.ensure([u])
        full = u.full
        original = full.clone()
        view = full.narrow(0, 5, 40).view(8, 5).t()          # non-contiguous, offset
        packed = views._pack(view)
        assert type(packed) is not torch.Tensor, "a view of a gathered unit must be packed"
        expected = view.clone()
        del view, full
        engine.parts.gatherer.release(u)
        assert u.state is UnitState.RELEASED and u.full is None
        again = views._unpack(packed)
        assert u.state is UnitState.GATHERED
        assert torch.equal(again, expected), f"seed {seed}"
        assert torch.equal(u.full, original)
        # tensors that are not views of a gathered unit pass through untouched
        other = torch.randn(3)
        assert views._pack(other) is other
    finally:
        engine.destroy()


def test_backward_after_a_step_is_an_error_not_new_values(seed):
    engine = make_engine(seed)
    try:
        x = torch.randn(3, 12, generator=torch.Generator().manual_seed(seed))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        stale = engine(x).pow(2).mean()
        assert engine.parts.module_hooks.saved_views.packed > 0
        engine.backward(engine(x).pow(2).mean())   # another update, on a graph of its own
        engine.step()
        with pytest.raises(ZeroCoreError, match="before the last optimizer step"):
            engine.backward(stale)
    finally:
        engine.destroy()


def test_unregistered_external_parameter_is_no_longer_gathered(seed):
    model = ReadsAnotherModulesWeight()
    zero_core.register_external_parameter(model.head, model.first.weight)
    reference = ReadsAnotherModulesWeight()
    reference.load_state_dict(model.state_dict())
    engine = make_engine(seed, model)
    try:
        x = torch.randn(3, 12, generator=torch.Generator().manual_seed(seed))
        out = engine(x)
        assert torch.allclose(out, reference(x), rtol=1e-6, atol=1e-6), f"seed {seed}"
        engine.backward(out.pow(2).mean())
        engine.step()
        zero_core.unregister_external_parameter(model.head, model.first.weight)
        with pytest.raises(ParameterNotGatheredError, match="first.weight"):
            engine(x)
    finally:
        engine.destroy()
