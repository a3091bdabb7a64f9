"""The engine's parts meet the protocols of zero_core/interfaces/engine_parts.py.

Every real implementation is built in one process — directly (stage 0-2 group buffers) or
inside an engine (reducers, stage-3 buffers with and without offload_param, parameter
sources) — and checked member by member: each member of its protocol must be defined by
the implementation itself (its class or the instance), not inherited from a protocol
stub, which a plain ``isinstance`` on a subclass of the protocol would not notice. Also:
the buffers' answers that replaced the optimizer's stage branches, and that offload/
imports nothing of stage 3 (the arrow goes one way).
"""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import zero_core
from zero_core.interfaces.engine_parts import (BucketBuffersProtocol, GradReducerProtocol,
                                               GroupBuffersProtocol, ParamSourceProtocol,
                                               ParamStoreProtocol, UnitBuffersProtocol)
from zero_core.memory import MemoryLedger
from zero_core.offload.params import ParamOffload
from zero_core.stage0to2.buffers import GroupBuffers
from zero_core.stage0to2.grad_reduce import GradReducer
from zero_core.stage3.buffers import OffloadedStage3GroupBuffers, Stage3GroupBuffers
from zero_core.stage3.gather import ResidentPartitions
from zero_core.stage3.grad_reduce import Stage3GradReducer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def protocol_members(proto) -> set[str]:
    """Every member a protocol (and the protocols it extends) declares."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if not cls.__dict__.get("_is_protocol", False) or cls.__module__ == "typing":
            continue
        names.update(cls.__dict__.get("__annotations__", {}))
        names.update(n for n, v in cls.__dict__.items()
                     if not n.startswith("_") and (callable(v) or isinstance(v, property)))
    return names


def missing_members(obj, proto) -> list[str]:
    """Members of *proto* that *obj* does not define itself."""
    missing = []
    for name in sorted(protocol_members(proto)):
        if name in vars(obj):
            continue
        owner = next((c for c in type(obj).__mro__ if name in c.__dict__), None)
        if owner is None or owner.__dict__.get("_is_protocol", False):
            missing.append(name)
    return missing


def assert_conforms(obj, proto) -> None:
    assert isinstance(obj, proto), f"{type(obj).__name__} is not a {proto.__name__}"
    assert missing_members(obj, proto) == [], \
        f"{type(obj).__name__} lacks {missing_members(obj, proto)} of {proto.__name__}"


def test_the_check_catches_a_member_left_to_the_protocol_stub():
    class Half(GradReducerProtocol):
        def register_hooks(self):
            pass
    assert isinstance(Half(), GradReducerProtocol)      # nominal: isinstance alone passes
    assert missing_members(Half(), GradReducerProtocol) == [
        "communication_buffers", "flush", "mark_fresh", "remove_hooks", "wait_all"]
    assert not isinstance(object(), GroupBuffersProtocol)
    assert {"state_kind", "gathers_after_step", "replace_master", "master_bucket"} <= \
        protocol_members(GroupBuffersProtocol)
    assert {"grad_view", "num_buckets"} <= protocol_members(BucketBuffersProtocol)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage0to2_group_buffers(stage, dtype):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (30, 7, 50)]
    values = [p.detach().float().clone() for p in params]
    gb = GroupBuffers(params, stage, dtype, torch.device("cpu"), 0, 1, 40, MemoryLedger(),
                      values)
    assert_conforms(gb, BucketBuffersProtocol)
    assert_conforms(gb, GroupBuffersProtocol)
    # what the optimizer used to decide from the stage number
    assert gb.state_kind == ("full" if stage == 0 else "partition")
    assert gb.gathers_after_step is (stage in (1, 2))


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 6),
                                torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model[4].bias.requires_grad_(False)    # a frozen parameter: stage 3's frozen buffers
    return model


def make_engine(stage: int, offload: str = "none", nvme_path=None, bf16: bool = True):
    zc = {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 10,
          "stage3_prefetch_bucket_size": 100}
    if offload != "none":
        zc["offload_optimizer"] = {"device": "cpu"}
        zc["offload_param"] = {"device": offload, "nvme_path": str(nvme_path)}
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zc,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = zero_core.initialize(model=small_model(), config=cfg)
    loss = engine(torch.randn(2, 8).to(engine.compute_dtype)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine


def test_stage0to2_reducer():
    engine = make_engine(2)
    try:
        assert type(engine.reducer) is GradReducer
        assert_conforms(engine.reducer, GradReducerProtocol)
        for gb in engine.parts.buffers:
            if gb is not None:
                assert_conforms(gb, BucketBuffersProtocol)
    finally:
        engine.destroy()


@pytest.mark.parametrize("bf16", [False, True])
def test_stage3_parts(bf16):
    engine = make_engine(3, bf16=bf16)
    try:
        assert type(engine.reducer) is Stage3GradReducer
        assert_conforms(engine.reducer, GradReducerProtocol)
        groups = [gb for gb in engine.parts.buffers if gb is not None] + [engine.parts.frozen_buffers]
        assert engine.parts.frozen_buffers is not None
        for gb in groups:
            assert type(gb) is Stage3GroupBuffers
            assert_conforms(gb, UnitBuffersProtocol)
            assert (gb.state_kind, gb.gathers_after_step) == ("partition", False)
        source = engine.parts.gatherer.part_source
        assert type(source) is ResidentPartitions
        assert_conforms(source, ParamSourceProtocol)
    finally:
        engine.destroy()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_stage3_parts_with_parameter_offload(device, tmp_path):
    engine = make_engine(3, device, tmp_path)
    try:
        store = engine.parts.param_store
        assert type(store) is ParamOffload
        assert_conforms(store, ParamStoreProtocol)
        assert_conforms(store, ParamSourceProtocol)
        assert engine.parts.gatherer.part_source is store
        assert engine.optimizer.param_sink is store
        for gb in [gb for gb in engine.parts.buffers if gb is not None] + [engine.parts.frozen_buffers]:
            assert type(gb) is OffloadedStage3GroupBuffers
            assert_conforms(gb, UnitBuffersProtocol)
            assert gb.store is store
            # the parent's construction ran: every unit has its partition views
            assert all(u.part is not None for u in gb.units)
            assert all((u.grad_part is not None) == gb.trainable for u in gb.units)
    finally:
        engine.destroy()


def test_offload_imports_nothing_of_stage3():
    """stage3/parts.py composes the parameter offload; the arrow never points back."""
    found = []
    for path in sorted((ROOT / "zero_core" / "offload").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [f"{path.name}: {n}" for n in names if n.startswith("zero_core.stage3")]
    assert found == []
