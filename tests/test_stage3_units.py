"""Single-process unit tests of stage 3's planning pieces: fetch units, their layout, the
execution trace, and the partitioned-parameter guard."""
from __future__ import annotations

import pytest
import torch

from zero_core.stage3 import partitioned_params as pp
from zero_core.stage3.prefetch import ExecutionTrace
from zero_core.stage3.units import FROZEN, coalesce_numel, plan_units, unit_layout


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)         # 80
        self.l1 = torch.nn.Linear(8, 8)              # 64 + 8
        self.l2 = torch.nn.Linear(8, 8)              # 64 + 8
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight


def test_units_coalesce_persist_and_share_tied_weights():
    m = Tied()
    group_of = {id(p): (0 if p.requires_grad else FROZEN) for p in m.parameters()}
    units, module_units = plan_units(m, group_of, persistence_threshold=10, target=100)
    params_in_units = [p for u in units for p in u.params]
    # every parameter exactly once (the tied weight too)
    assert len(params_in_units) == len(list(m.parameters()))
    assert len({id(p) for p in params_in_units}) == len(params_in_units)
    persistent = [u for u in units if u.persistent]
    assert {tuple(u.names) for u in persistent} == {("l1.bias", "l2.bias"), ("frozen.bias",)}
    # emb (80 < 100) coalesces with l1.weight; l2.weight starts a new unit (144 >= 100)
    names = [tuple(u.names) for u in units if not u.persistent]
    assert ("emb.weight", "l1.weight") in names and ("l2.weight",) in names
    assert ("frozen.weight",) in names
    # the head uses the embedding's unit; frozen units come last
    assert module_units[m.head] == [u for u in units if "emb.weight" in u.names]
    assert [u.group for u in units][-2:] == [FROZEN, FROZEN]
    assert [u.index for u in units] == list(range(len(units)))


def test_unit_layout_pads_each_unit_to_equal_aligned_slices():
    m = Tied()
    group_of = {id(p): 0 for p in m.parameters()}
    units, _ = plan_units(m, group_of, persistence_threshold=0, target=1)
    lay = unit_layout(units, world_size=4, alignment=16)
    assert lay.num_buckets == len(units)
    for k, u in enumerate(units):
        assert u.bucket == k and u.padded_numel % 64 == 0 and u.padded_numel - u.numel < 64
        assert lay.bucket_sizes[k] == u.padded_numel
    assert lay.numel == sum(p.numel() for p in m.parameters())
    assert lay.partition_numel * 4 == lay.padded_numel
    assert coalesce_numel(300, 10**9) == 300 and coalesce_numel(10**9, 10**9) == 2 ** 18


def test_trace_follows_records_and_rerecords_on_change():
    t = ExecutionTrace([10, 20, 30, 40])
    t.begin("train")
    for u in (0, 1, 2, 1, 3):
        t.record(u)
    assert not t.following and t.upcoming() == []
    t.begin("train")            # follows the recording
    assert t.following and t.upcoming() == [0, 1, 2, 1, 3]
    t.record(0)
    assert t.reuse_distance(1) == 0             # next request
    assert t.reuse_distance(3) == 20 + 30 + 20  # 1, 2, 1 come first
    assert t.reuse_distance(0) is None          # not used again
    t.record(2)                 # the order changed
    assert not t.following
    t.record(3)
    t.begin("train")
    assert t.rerecorded == 1 and t.upcoming() == [0, 2, 3]
    t.begin("eval")             # another kind of pass records its own
    assert not t.following


def test_released_parameter_errors_and_reports_its_full_shape():
    lin = torch.nn.Linear(4, 3)
    w = lin.weight
    meta = pp.mark_partitioned(w, "lin.weight")
    pp.release(w)
    assert tuple(w.shape) == (3, 4) and w.numel() == 12 and w.dim() == 2
    assert w.data.numel() == 0
    with pytest.raises(pp.ParameterNotGatheredError) as err:
        lin(torch.ones(2, 4))
    msg = str(err.value)
    assert "'lin.weight'" in msg and "torch.nn.functional.linear" in msg
    assert "register_external_parameter" in msg and "GatheredParameters" in msg
    pp.attach(w, torch.arange(12.0))
    assert meta.available and torch.equal(lin(torch.zeros(1, 4)), lin.bias.detach()[None])
    assert float(w.detach().sum()) == 66.0


class _Tagged(torch.nn.Parameter):
    """A parameter subclass of the user's (libraries have them)."""


def test_only_released_parameters_go_through_torch_function():
    lin = torch.nn.Linear(4, 3)
    lin.weight = _Tagged(lin.weight.detach().clone())
    w = lin.weight
    pp.mark_partitioned(w, "lin.weight")
    calls = []
    original = pp.PartitionedParameter.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls.append(getattr(func, "__name__", func))
        return original(cls, func, types, args, kwargs)

    pp.PartitionedParameter.__torch_function__ = classmethod(counting)
    try:
        for _ in range(2):
            assert type(w) is _Tagged and pp.is_partitioned(w)   # available: its own class
            lin(torch.ones(2, 4)).sum().backward()
            assert calls == [] and w.grad is not None
            w.grad = None
            pp.release(w)
            assert type(w) is pp.PartitionedParameter and pp.is_partitioned(w)
            assert tuple(w.shape) == (3, 4) and calls                # answered by the guard
            with pytest.raises(pp.ParameterNotGatheredError):
                lin(torch.ones(2, 4))
            pp.attach(w, torch.randn(12))
            calls.clear()
    finally:
        pp.PartitionedParameter.__torch_function__ = classmethod(original)
    assert type(w) is _Tagged and w is lin.weight


# ---- the prefetcher's resumed scan issues exactly the gathers of a scan from pos -------------
class _OneRank:
    world_size, rank = 1, 0


def _scan_from_pos(coord) -> None:
    """The prefetch rule, scanned from the current request every time (the specification
    coordinator._prefetch must match while resuming where its last scan stopped)."""
    ahead, g = 0, coord.gatherer
    for idx in coord.trace.upcoming():
        u = coord.units[idx]
        if u.persistent:
            g.start(u)
            continue
        ahead += u.padded_numel
        if ahead > coord.prefetch_bucket_size:
            break
        if u.released:
            if g.live_numel + u.padded_numel > coord.max_live:
                break
            g.start(u)
            coord.prefetched += 1


def _drive(seed: int, spec: bool) -> list:
    """Three passes of a random module-call sequence over random units; the order in which
    units start gathering, releases in between (reuse distance, live window, backward)."""
    import random

    from zero_core.stage3.coordinator import ParamCoordinator
    from zero_core.stage3.gather import UnitGatherer
    from zero_core.stage3.units import FetchUnit
    rng = random.Random(seed)
    units = []
    for i in range(rng.randint(3, 40)):
        u = FetchUnit(index=i, group=0, persistent=rng.random() < 0.2)
        u.padded_numel = u.numel = rng.choice([4, 8, 16, 64])
        u.part = torch.zeros(u.padded_numel)
        units.append(u)
    events = []

    class Logged(UnitGatherer):
        def start(self, u):
            if u.released:
                events.append(("start", u.index))
            super().start(u)

        def release(self, u):
            if not u.released:
                events.append(("release", u.index))
            super().release(u)

    coord = ParamCoordinator(units, Logged(_OneRank(), torch.float32, torch.device("cpu")),
                             prefetch_bucket_size=rng.choice([0, 8, 40, 10**9]),
                             max_live_parameters=rng.choice([16, 64, 10**9]),
                             max_reuse_distance=rng.choice([0, 32, 10**9]))
    if spec:
        coord._prefetch = lambda: _scan_from_pos(coord)
    calls = [rng.choice(units) for _ in range(rng.randint(5, 120))]
    for _ in range(3):
        coord.start_pass((True, True))
        for u in calls:
            coord.before_forward([u])
            coord.after_forward([u])
            if rng.random() < 0.1:          # a gradient-complete release out of order
                coord.grads_done(rng.choice(units))
        coord.end_backward()
        events.append(("prefetched", coord.prefetched))
    return events


@pytest.mark.parametrize("seed", range(40))
def test_resumed_prefetch_scan_matches_a_scan_from_the_current_request(seed):
    assert _drive(seed, spec=False) == _drive(seed, spec=True)
