"""Single-process tests of the engine's building blocks: partition arithmetic, the flat
buffer, memory formulas, and which optimizers the engine accepts."""
from __future__ import annotations

import random

import pytest
import torch

from zero_core.errors import ConfigError
from zero_core.partitioning.flat_buffer import FlatBuffer
from zero_core.memory import (MemoryLedger, comm_bytes_per_step, model_state_breakdown,
                              model_state_bytes, optimizer_k)
from zero_core.optim.rules import (collect_param_groups, rule_from_config,
                                      rule_from_torch_optimizer)
from zero_core.partitioning.layout import bucket_size_for, padding_bound, plan_group_layout


@pytest.mark.parametrize("seed", range(20))
def test_layout_covers_every_element_once(seed):
    rng = random.Random(seed)
    numels = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
    world, align = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 4, 16])
    bucket = rng.randint(1, 800)
    lay = plan_group_layout(numels, bucket, world, align)
    quantum = world * align
    full = bucket_size_for(bucket, world, align)
    # constant-size buckets, only the last one shorter; all multiples of world * alignment
    assert all(s == full for s in lay.bucket_sizes[:-1])
    assert all(s % quantum == 0 and 0 < s <= full for s in lay.bucket_sizes)
    assert 0 <= lay.padded_numel - sum(numels) <= padding_bound(world, align)
    assert list(lay.bucket_starts) == [sum(lay.bucket_sizes[:k]) for k in range(lay.num_buckets)]
    # every element of every parameter lands exactly once, at offset + position
    owner = torch.full((lay.padded_numel,), -1)
    for s in lay.segments:
        lo = lay.bucket_starts[s.bucket] + s.bucket_lo
        assert lo == lay.offsets[s.param] + s.param_lo
        assert s.bucket_lo + s.numel <= lay.bucket_sizes[s.bucket]
        assert (owner[lo:lo + s.numel] == -1).all()
        owner[lo:lo + s.numel] = s.param
    for i, n in enumerate(numels):
        assert int((owner == i).sum()) == n
        assert sum(s.numel for s in lay.segments_of_param(i)) == n
    # rank slices tile each bucket; a rank's partition is its slices concatenated
    assert lay.partition_numel * world == lay.padded_numel
    for k in range(lay.num_buckets):
        starts = [lay.shard_start(k, r) for r in range(world)]
        assert starts == [lay.bucket_starts[k] + r * lay.shard_size(k) for r in range(world)]
        assert lay.partition_start(k) == sum(lay.shard_size(j) for j in range(k))


def test_flat_buffer_views_share_memory():
    lay = plan_group_layout([5, 7, 3], 8, world_size=2, alignment=2)
    full = FlatBuffer(lay, "full", torch.float32, torch.device("cpu"), rank=1)
    part = FlatBuffer(lay, "partition", torch.float32, torch.device("cpu"), rank=1)
    values = torch.arange(lay.padded_numel, dtype=torch.float32)
    full.data.copy_(values)
    assert torch.equal(full.param(1, torch.Size([7])), values[5:12])
    for k in range(lay.num_buckets):
        shard = full.shard(k)
        assert shard.data_ptr() == full.data[lay.shard_start(k, 1):].data_ptr()
        part.bucket(k).copy_(shard)
    expected = torch.cat([full.shard(k) for k in range(lay.num_buckets)])
    assert torch.equal(part.data, expected)
    with pytest.raises(ValueError):
        part.shard(0)


def test_bucket_size_zero_is_refused():
    with pytest.raises(ConfigError, match="reduce_bucket_size"):
        bucket_size_for(0, 2, 16)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_memory_formulas_match_design_table(n):
    psi = 1_000_003
    # ARCHITECTURE §4, Adam (K = 12)
    assert model_state_bytes(0, psi, n, "bf16") == pytest.approx(16 * psi)
    assert model_state_bytes(1, psi, n, "fp16") == pytest.approx(4 * psi + 12 * psi / n)
    assert model_state_bytes(2, psi, n, "bf16") == pytest.approx(2 * psi + 14 * psi / n)
    assert model_state_bytes(3, psi, n, "bf16") == pytest.approx(16 * psi / n)
    assert model_state_bytes(0, psi, n, "fp32") == pytest.approx(16 * psi)
    assert model_state_bytes(1, psi, n, "fp32") == pytest.approx(8 * psi + 8 * psi / n)
    assert model_state_bytes(2, psi, n, "fp32") == pytest.approx(4 * psi + 12 * psi / n)
    # SGD with momentum: 4 master + 4 momentum; fp32 keeps no master
    assert model_state_bytes(2, psi, n, "fp32", k=optimizer_k("SGD", 0.9)) == \
        pytest.approx(4 * psi + 8 * psi / n)
    b = model_state_breakdown(1, psi, n, "bf16")
    assert b["gradients"] == 2 * psi and b["optimizer_states"] == pytest.approx(8 * psi / n)
    assert comm_bytes_per_step(2, psi, n, "fp32") == pytest.approx(2 * (n - 1) / n * 4 * psi)


def test_memory_ledger_counts_storage_once():
    led = MemoryLedger()
    t = torch.zeros(100)
    led.track("parameters", t)
    led.track("parameters", t[10:20])   # a view of the same storage
    led.track("optimizer_states", torch.zeros(10, dtype=torch.float64))
    rep = led.report()
    assert rep["parameters"] == 400 and rep["optimizer_states"] == 80
    assert rep["model_states"] == 480
    with pytest.raises(ValueError):
        led.track("nonsense", t)


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.SparseAdam]
                         + ([torch.optim.Adafactor] if hasattr(torch.optim, "Adafactor") else []))
def test_non_elementwise_optimizers_are_refused_at_stage_1_and_2(cls):
    m = _model()
    opt = cls(m.parameters())
    for stage in (1, 2):
        with pytest.raises(ConfigError, match=rf"{cls.__name__}.*stage {stage}.*element-wise"):
            rule_from_torch_optimizer(opt, stage)
    assert rule_from_torch_optimizer(opt, 0).kind == "torch"


def test_subclass_of_an_elementwise_optimizer_is_refused():
    class MyAdam(torch.optim.Adam):
        pass
    with pytest.raises(ConfigError, match="MyAdam"):
        rule_from_torch_optimizer(MyAdam(_model().parameters()), 2)


def test_builtin_rules_from_torch_optimizers():
    m = _model()
    assert rule_from_torch_optimizer(torch.optim.Adam(m.parameters()), 2).adamw is False
    assert rule_from_torch_optimizer(torch.optim.AdamW(m.parameters()), 2).adamw is True
    assert rule_from_torch_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), 1).kind == "sgd"
    ams = torch.optim.Adam(m.parameters(), amsgrad=True)
    assert rule_from_torch_optimizer(ams, 2).kind == "torch"   # element-wise, not fused


def test_config_rules_follow_deepspeed_adam_w_mode():
    from zero_core.config import parse_config
    cfg = lambda o: parse_config({"train_micro_batch_size_per_gpu": 1, "optimizer": o}).optimizer  # noqa: E731
    assert rule_from_config(cfg({"type": "Adam", "params": {"lr": 1e-3}})).adamw is True
    assert rule_from_config(cfg({"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}})).adamw is False
    sgd = rule_from_config(cfg({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}))
    assert sgd.kind == "sgd" and sgd.default_dict()["momentum"] == 0.9


def test_param_groups_are_validated():
    m = _model()
    p0, p1 = list(m[0].parameters()), list(m[1].parameters())
    groups = collect_param_groups(m, [{"params": p0, "lr": 0.1}, {"params": p1}], None)
    assert [len(g["params"]) for g in groups] == [2, 2] and groups[0]["lr"] == 0.1
    with pytest.raises(ConfigError, match="appears in param groups 0 and 1"):
        collect_param_groups(m, [{"params": p0}, {"params": p0[:1]}], None)
    with pytest.raises(ConfigError, match="not a parameter of the model"):
        collect_param_groups(m, [torch.nn.Parameter(torch.zeros(3))], None)
    with pytest.raises(ConfigError, match="not a mix"):
        collect_param_groups(m, [p0[0], {"params": p1}], None)
