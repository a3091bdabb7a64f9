"""Topology (zero_core.runtime.topology): node-major placement and the ranks-per-node override."""
import itertools

import pytest

from zero_core.errors import ConfigError
from zero_core.runtime.topology import Topology, resolve_ranks_per_node


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv("ZERO_CORE_RANKS_PER_NODE", raising=False)


@pytest.mark.parametrize("world, rpn", [(1, 1), (4, 1), (4, 2), (4, 4), (8, 2), (12, 3), (12, 4)])
def test_partitions_against_node_major_placement(world, rpn):
    topo = Topology(world, rpn)
    assert topo.num_nodes == world // rpn
    # independent description: rank r is the (r mod rpn)-th process of node r div rpn
    placement = {r: (r // rpn, r % rpn) for r in range(world)}
    for r, (node, local) in placement.items():
        assert topo.node_of(r) == node
        assert topo.local_rank_of(r) == local
    intra = topo.intra_node_partition()
    inter = topo.inter_node_partition()
    assert intra == [[r for r in range(world) if placement[r][0] == n] for n in range(world // rpn)]
    assert inter == [[r for r in range(world) if placement[r][1] == lr] for lr in range(rpn)]
    # both are partitions of the world
    for part in (intra, inter):
        assert sorted(itertools.chain.from_iterable(part)) == list(range(world))
    # an intra-node group and an inter-node group meet in exactly one rank
    for a in intra:
        for b in inter:
            assert len(set(a) & set(b)) == 1
    for n in range(topo.num_nodes):
        assert topo.node_ranks(n) == intra[n]


def test_spans_nodes():
    topo = Topology(8, 2)
    assert not topo.spans_nodes([0, 1])
    assert not topo.spans_nodes([7])
    assert not topo.spans_nodes((6, 7))
    assert topo.spans_nodes([1, 2])
    assert topo.spans_nodes([0, 2, 4, 6])
    assert topo.spans_nodes(range(8))
    one_node = Topology(4, 4)
    assert not one_node.spans_nodes(range(4))
    every_rank_a_node = Topology(4, 1)
    assert every_rank_a_node.spans_nodes([2, 3])
    assert all(not g for g in map(every_rank_a_node.spans_nodes, [[0], [1], [2], [3]]))


@pytest.mark.parametrize("world, rpn", [(4, 3), (4, 0), (4, -2), (4, 8), (6, 4)])
def test_bad_ranks_per_node(world, rpn):
    with pytest.raises(ConfigError) as err:
        Topology(world, rpn)
    msg = str(err.value)
    assert f"ranks_per_node={rpn}" in msg and str(world) in msg
    assert "ZERO_CORE_RANKS_PER_NODE" in msg  # says how to fix it


def test_resolve_from_launcher():
    assert resolve_ranks_per_node(8, 4) == Topology(8, 4)
    # a launcher that reports more local ranks than the job has (e.g. a Slurm node with
    # free slots): the job is on one node
    assert resolve_ranks_per_node(2, 8) == Topology(2, 2)


def test_resolve_env_override(monkeypatch):
    monkeypatch.setenv("ZERO_CORE_RANKS_PER_NODE", "2")
    assert resolve_ranks_per_node(4, 4) == Topology(4, 2)
    monkeypatch.setenv("ZERO_CORE_RANKS_PER_NODE", "")  # empty means unset
    assert resolve_ranks_per_node(4, 4) == Topology(4, 4)
    monkeypatch.setenv("ZERO_CORE_RANKS_PER_NODE", "two")
    with pytest.raises(ConfigError, match="ZERO_CORE_RANKS_PER_NODE='two' is not an integer"):
        resolve_ranks_per_node(4, 4)


def test_resolve_argument_beats_env(monkeypatch):
    monkeypatch.setenv("ZERO_CORE_RANKS_PER_NODE", "1")
    assert resolve_ranks_per_node(4, 4, override=2) == Topology(4, 2)
    # a bad environment value does not matter when the argument decides
    monkeypatch.setenv("ZERO_CORE_RANKS_PER_NODE", "two")
    assert resolve_ranks_per_node(4, 4, override=4) == Topology(4, 4)


@pytest.mark.parametrize("value, words", [
    ("two", ["ZERO_CORE_RANKS_PER_NODE", "'two'", "integer"]),
    ("2.5", ["ZERO_CORE_RANKS_PER_NODE", "'2.5'"]),
    ("3", ["ranks_per_node=3", "world size 4"]),
    ("0", ["ranks_per_node=0"]),
    ("-1", ["ranks_per_node=-1"]),
])
def test_resolve_bad_env(monkeypatch, value, words):
    monkeypatch.setenv("ZERO_CORE_RANKS_PER_NODE", value)
    with pytest.raises(ConfigError) as err:
        resolve_ranks_per_node(4, 4)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("override", [3, 0, -4, 5])
def test_resolve_bad_argument(override):
    with pytest.raises(ConfigError, match=f"ranks_per_node={override}"):
        resolve_ranks_per_node(4, 4, override=override)
