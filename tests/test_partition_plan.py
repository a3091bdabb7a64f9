"""The partition groups of a job (zero_core/runtime/partition_comm.py: plain, MiCS, node-aware)
as numbers, and the config keys that ask for them: orders, replica groups, refusals with the
reason named, and the stated fallbacks. No ranks are started (tests/test_multinode.py runs
them)."""
from __future__ import annotations

import pytest

from zero_core.config import parse_config
from zero_core.config.schema import ZeroConfig
from zero_core.errors import ConfigError
from zero_core.runtime.partition_comm import build_sharding, plan_partition
from zero_core.runtime.topology import Topology


def test_plain_on_one_node_is_every_rank_in_order():
    plan = plan_partition(4, 4)
    assert plan.groups == ((0, 1, 2, 3),) and not plan.hierarchical and plan.replicas == 1


def test_node_aware_numbers_local_rank_major():
    # 3 nodes of 2: local rank l on node n has partition index l*3 + n
    plan = plan_partition(6, 2)
    assert plan.hierarchical and plan.groups == ((0, 2, 4, 1, 3, 5),)
    assert plan.across_partition() == [[0, 2, 4], [1, 3, 5]]
    for index, rank in enumerate(plan.groups[0]):
        assert index == (rank % 2) * 3 + rank // 2
    assert not plan_partition(6, 2, node_aware=False).hierarchical
    assert not plan_partition(4, 1).hierarchical      # one rank per node: nothing to fan out


def test_mics_shard_groups_and_replicas():
    plan = plan_partition(8, 2, shard_size=2)
    assert plan.groups == ((0, 1), (2, 3), (4, 5), (6, 7)) and plan.replicas == 4
    assert plan.replica_partition() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert not plan.hierarchical                       # a shard group inside one node


def test_mics_shard_group_spanning_nodes_gathers_node_aware():
    plan = plan_partition(8, 2, shard_size=4)          # 2 nodes per shard group
    assert plan.hierarchical and plan.groups == ((0, 2, 1, 3), (4, 6, 5, 7))
    assert plan.across_partition() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # the same index in every shard group is the same position in its block
    assert plan.replica_partition() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert not plan_partition(8, 2, shard_size=4, node_aware=False).hierarchical


@pytest.mark.parametrize("shard, why", [(5, "must divide the world size"),
                                        (6, "inside one node or be whole nodes")])
def test_shard_sizes_that_do_not_fit_the_nodes_are_refused(shard, why):
    with pytest.raises(ConfigError, match=why):
        plan_partition(12, 4, shard_size=shard)


def _parse(world=4, **zero):
    return parse_config({"train_micro_batch_size_per_gpu": 1,
                         "zero_optimization": {"stage": 3, **zero}}, world)


def test_config_keys_are_parsed_with_deepspeed_defaults():
    zc = _parse().zero_optimization
    assert (zc.mics_shard_size, zc.mics_hierarchical_params_gather,
            zc.node_aware_collectives) == (-1, False, True)
    zc = _parse(mics_shard_size=2, mics_hierarchical_params_gather=True,
                node_aware_collectives=False).zero_optimization
    assert (zc.mics_shard_size, zc.mics_hierarchical_params_gather,
            zc.node_aware_collectives) == (2, True, False)


@pytest.mark.parametrize("zero, why", [
    ({"mics_shard_size": 3}, "must divide the world size 4"),
    ({"mics_shard_size": 0}, "expected -1"),
    ({"stage": 0, "mics_shard_size": 2}, "stage 0 partitions nothing"),
    ({"mics_hierarchical_params_gather": True}, "MiCS is off"),
    ({"mics_shard_size": 2, "zero_quantized_gradients": True}, "qgZ"),
    ({"mics_shard_size": 2, "zero_hpz_partition_size": 2}, "hpZ"),
    ({"node_aware_collectives": "yes"}, "node_aware_collectives"),
])
def test_bad_many_node_settings_are_named(zero, why):
    with pytest.raises(ConfigError, match=why):
        _parse(**zero)


class _Comm:
    """Just enough of a communicator for build_sharding to decide without groups."""

    name = "stub"
    rank = 0
    world = "world"

    def __init__(self, world_size, ranks_per_node, cheap_groups=True):
        self.world_size = world_size
        self.topology = Topology(world_size, ranks_per_node)
        self.cheap_groups = cheap_groups

    def split(self, *a, **k):
        raise AssertionError("no group may be made here")

    intra_node_group = split


def test_node_aware_falls_back_to_flat_where_it_cannot_help_or_costs_groups():
    one_node = _Comm(4, 4)
    assert build_sharding(one_node, ZeroConfig(stage=3), 3).comm is one_node
    costly = _Comm(4, 2, cheap_groups=False)           # oneCCL: each group is seconds
    assert build_sharding(costly, ZeroConfig(stage=3), 3).comm is costly
    qgz = _Comm(4, 2)                                   # qgZ brings its own two hops
    assert build_sharding(qgz, ZeroConfig(stage=3), 3, uses_qgz=True).comm is qgz
    off = _Comm(4, 2)
    assert build_sharding(off, ZeroConfig(stage=3, node_aware_collectives=False), 3).comm is off
    stage0 = _Comm(4, 2)                                # stage 0 partitions nothing
    assert build_sharding(stage0, ZeroConfig(stage=0), 0).comm is stage0


class _Landing:
    """A first hop that has landed once *done* is set."""

    def __init__(self):
        self.done = False
        self.waited = False

    def is_completed(self):
        return self.done

    def wait(self):
        self.waited = True
        self.done = True


def test_second_hops_start_in_call_order_as_soon_as_their_first_landed():
    from zero_core.runtime.partition_comm import _HopQueue
    queue, started = _HopQueue(), []
    firsts = [_Landing() for _ in range(3)]
    hops = [queue.launch(f, lambda i=i: started.append(i) or _Landing())
            for i, f in enumerate(firsts)]
    firsts[1].done = True          # the second one landed first: it must not overtake
    queue.progress()
    assert started == []
    firsts[0].done = True
    queue.progress()
    assert started == [0, 1]
    hops[2].wait()                 # waiting starts it (after its first hop) and waits
    assert started == [0, 1, 2] and firsts[2].waited and hops[2].second.waited
    assert not queue.pending


def test_second_hops_of_serial_backends_start_at_once_and_of_unknown_ones_when_waited():
    from zero_core.runtime.partition_comm import _HopQueue, hop_mode
    started = []
    at_once = _HopQueue("at_once")
    first = _Landing()
    hops = at_once.launch(first, lambda: started.append("x") or _Landing())
    assert started == ["x"] and not at_once.pending     # queued right behind the first
    hops.wait()
    assert first.waited and hops.second.waited
    waited = _HopQueue("when_waited")
    first = _Landing()
    hops = waited.launch(first, lambda: started.append("y") or _Landing())
    first.done = True
    waited.progress()                                    # landing alone starts nothing
    assert started == ["x"]
    hops.wait()
    assert started == ["x", "y"]

    class Backend:
        staging = None

        def __init__(self, order):
            self.collective_order = order
    assert hop_mode(Backend("per_group")) == "on_landing"
    assert hop_mode(Backend("global")) == "at_once"
    assert hop_mode(Backend("unknown")) == "when_waited"
    staged = Backend("global")
    staged.staging = object()                            # copies at submission: must wait
    assert hop_mode(staged) == "when_waited"
