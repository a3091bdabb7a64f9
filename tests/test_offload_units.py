"""Offload building blocks on their own: sub-group and piece arithmetic, swap files
(round trips, O_DIRECT and buffered, CRC and truncation checks, memory maps), the NVMe
state store's pipeline against a plain in-memory model of the same states, and the
offload config keys."""
from __future__ import annotations

import os
import random

import pytest
import torch

from zero_core.config import parse_config
from zero_core.errors import ConfigError
from zero_core.offload import OffloadError
from zero_core.offload.nvme import NvmeStateStore
from zero_core.offload.subgroups import QUANTUM, pieces, plan_subgroups, subgroup_bounds
from zero_core.offload.swap_file import ALIGN, SwapFile, aligned_empty
from zero_core.partitioning.layout import plan_group_layout


# ---- sub-groups ------------------------------------------------------------------------------
@pytest.mark.parametrize("world,bucket,sub", [(1, 700, 1100), (2, 5000, 1024), (4, 333, 3000),
                                              (3, 10_000, 10**9)])
def test_pieces_cover_each_partition_element_once_in_order(world, bucket, sub):
    rng = random.Random(world * 7 + bucket)
    numels = [rng.randint(1, 900) for _ in range(25)]
    lay = plan_group_layout(numels, bucket, world, 16)
    subgroups = plan_subgroups([lay, None], sub)
    covered = []
    for sg in subgroups:
        assert sg.group == 0
        assert sg.lo % QUANTUM == 0 and sg.numel <= max(QUANTUM, sub)
        pos = 0
        for p in sg.pieces:
            assert p.sub_offset == pos and p.numel > 0
            assert p.shard_offset + p.numel <= lay.shard_size(p.bucket)
            # the piece's partition position is its bucket's slice start + offset
            covered.extend(range(lay.partition_start(p.bucket) + p.shard_offset,
                                 lay.partition_start(p.bucket) + p.shard_offset + p.numel))
            pos += p.numel
            assert p.shard_offset % 16 == 0 or p.sub_offset == 0   # aligned cuts
        assert pos == sg.numel
    assert covered == list(range(lay.partition_numel))


def test_subgroup_bounds():
    assert subgroup_bounds(5000, 2048) == [(0, 2048), (2048, 2048), (4096, 904)]
    assert subgroup_bounds(100, 10) == [(0, 100)]   # never below QUANTUM
    with pytest.raises(ValueError):
        subgroup_bounds(10, 0)


# ---- swap files ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,direct", [(torch.float32, True), (torch.float32, False),
                                          (torch.bfloat16, False)])
def test_swap_file_round_trip_and_initial_zeros(tmp_path, dtype, direct):
    bounds = [(0, 2048), (2048, 1024), (3072, 777)]
    f = SwapFile(str(tmp_path / "a.swap"), dtype, 3849, bounds, direct=direct)
    buf = aligned_empty(2048, dtype)
    assert buf.data_ptr() % ALIGN == 0
    for i, (_, n) in enumerate(bounds):   # sparse: zeros without any write
        assert torch.equal(f.read(i, buf), torch.zeros(n, dtype=dtype))
    values = {i: torch.randn(n).to(dtype) for i, (_, n) in enumerate(bounds)}
    for i in (2, 0, 1):
        buf.narrow(0, 0, bounds[i][1]).copy_(values[i])
        f.write(i, buf)
    for i in range(3):
        assert torch.equal(f.read(i, aligned_empty(2048, dtype)), values[i])
    if direct:
        assert f.direct
    whole = f.mapped()
    assert torch.equal(whole, torch.cat([values[0], values[1], values[2]]))
    whole[5] = 42   # a checkpoint load writes through the map ...
    f.reseal()      # ... and the CRCs follow
    assert float(f.read(0, buf)[5]) == 42
    assert f.bytes_written == sum(n for _, n in bounds) * buf.element_size()
    f.close()


def test_swap_file_detects_truncation_and_corruption(tmp_path):
    path = str(tmp_path / "b.swap")
    f = SwapFile(path, torch.float32, 4096, [(0, 2048), (2048, 2048)], direct=True)
    buf = aligned_empty(2048, torch.float32)
    buf.copy_(torch.arange(2048, dtype=torch.float32))
    f.write(0, buf)
    f.write(1, buf)
    with open(path, "r+b") as fh:
        fh.seek(4096 + 100)
        fh.write(b"\x01\x02\x03")
    with pytest.raises(OffloadError, match="corrupted") as err:
        f.read(0, buf)
    assert path in str(err.value)
    os.truncate(path, 4096 + 2048 * 4 + 10)
    with pytest.raises(OffloadError, match="truncated") as err:
        f.read(1, buf)
    assert path in str(err.value) and "checkpoint" in str(err.value)
    f.close()


# ---- the NVMe store against an in-memory model ------------------------------------------------
def test_nvme_store_pipeline_matches_in_memory_states(tmp_path):
    """Random sub-group updates through the store (read-ahead, write-behind, 3 slots,
    passes in the same and in a changed order) give what plain tensors give."""
    lay_a = plan_group_layout([3000, 2500], 1000, 1, 16)
    lay_b = plan_group_layout([1500], 700, 1, 16)
    layouts = [lay_a, None, lay_b]
    subs = plan_subgroups(layouts, 1024)
    names = ("master", "exp_avg")
    store = NvmeStateStore(layouts, names, 0, subs, str(tmp_path), 3)
    model = {(j, n): torch.zeros(lay.partition_numel) for j, lay in enumerate(layouts)
             if lay is not None for n in names}
    gen = torch.Generator().manual_seed(0)
    pass_bytes = sum(sg.numel for sg in subs) * 4 * len(names)
    for rnd in range(6):
        if rnd == 4:
            # each sub-group read once per pass, plus the read-ahead of the next pass
            # (at most the 3 slots): no read is wasted on a slot taken back
            assert store.report()["bytes_read"] <= 4 * pass_bytes + 3 * 1024 * 4 * len(names)
        order = list(subs) if rnd < 4 else list(reversed(subs))
        store.begin(order)
        for sg in order:
            got = store.acquire(sg)
            for n in names:
                want = model[(sg.group, n)].narrow(0, sg.lo, sg.numel)
                assert torch.equal(got[n], want), (rnd, sg, n)
                delta = torch.randn(sg.numel, generator=gen)
                got[n].add_(delta)
                want.add_(delta)
            store.release(sg)
        store.finish()
    for (j, n), want in model.items():
        assert torch.equal(store.flat(j, n).data, want)   # checkpoint view
    rep = store.report()
    assert rep["bytes_written"] == 6 * sum(v.numel() for v in model.values()) * 4
    assert rep["host_bytes"] == (3 * 2 + 1) * 1024 * 4
    store.close()


# ---- config --------------------------------------------------------------------------------------
def test_offload_config_keys():
    cfg = parse_config({"zero_optimization": {
        "stage": 3, "sub_group_size": 1e6,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "pin_memory": True,
                              "buffer_count": 5, "fast_init": True, "ratio": 1.0,
                              "pipeline_read": True, "pipeline_write": False},  # no effect
        "offload_param": {"device": "nvme", "nvme_path": "/y", "buffer_count": 6,
                          "buffer_size": 1e7, "max_in_cpu": 0}}}).zero_optimization
    assert cfg.sub_group_size == 1_000_000
    # DeepSpeed's 0 (a sub-group per parameter there): the smallest sub-groups here
    assert parse_config({"zero_optimization": {"stage": 3, "sub_group_size": 0}}) \
        .zero_optimization.sub_group_size == 1
    assert cfg.offload_optimizer.device == "nvme" and cfg.offload_optimizer.buffer_count == 5
    assert cfg.offload_param.buffer_size == 10_000_000 and cfg.offload_param.max_in_cpu == 0
    assert not parse_config({}).zero_optimization.offload_optimizer.enabled


@pytest.mark.parametrize("zo,words", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, ("stage", ">= 1")),
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, ("nvme_path",)),
    ({"stage": 2, "offload_optimizer": {"device": "disk"}}, ("'none', 'cpu', 'nvme'",)),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.2}}, ("ratio",)),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 2}}, ("buffer_count",)),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "bogus": 1}}, ("bogus",)),
    ({"stage": 2, "sub_group_size": -1}, ("sub_group_size",)),
])
def test_offload_config_errors(zo, words):
    with pytest.raises(ConfigError) as err:
        parse_config({"zero_optimization": zo})
    for w in words:
        assert w in str(err.value), str(err.value)
