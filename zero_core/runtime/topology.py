"""Topology: which ranks share a node.

Ranks are placed in node-major blocks (rank = node * ranks_per_node + local_rank), as
torchrun, mpirun's default mapping and Slurm's block distribution do. The ranks per node
can be overridden (config ``"topology": {"ranks_per_node": N}`` or
``ZERO_CORE_RANKS_PER_NODE``) to run hierarchical algorithms on one machine as if on
several nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

from zero_core.errors import ConfigError
from zero_core.runtime.launch import env_setting


@dataclass(frozen=True)
class Topology:
    """The shape of the job: ``world_size`` ranks in ``num_nodes`` nodes of ``ranks_per_node``."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ConfigError(
                f"ranks_per_node={self.ranks_per_node} does not divide world size "
                f"{self.world_size}: pick a divisor of the world size "
                f"(topology.ranks_per_node or ZERO_CORE_RANKS_PER_NODE)")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Index of the node that holds global *rank*."""
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        """Rank of global *rank* inside its node."""
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks on *node*, in order."""
        start = node * self.ranks_per_node
        return list(range(start, start + self.ranks_per_node))

    def intra_node_partition(self) -> list[list[int]]:
        """One list per node with the ranks inside it."""
        return [self.node_ranks(n) for n in range(self.num_nodes)]

    def inter_node_partition(self) -> list[list[int]]:
        """One list per local rank: the ranks with that local rank on every node."""
        return [[n * self.ranks_per_node + lr for n in range(self.num_nodes)]
                for lr in range(self.ranks_per_node)]

    def spans_nodes(self, ranks) -> bool:
        """True when *ranks* are on more than one node (their traffic is inter-node)."""
        return len({self.node_of(r) for r in ranks}) > 1


def resolve_ranks_per_node(world_size: int, launcher_local_size: int,
                           override: int | None = None) -> Topology:
    """Build the topology from an explicit override, ``ZERO_CORE_RANKS_PER_NODE``, or the launcher."""
    if override is None:
        override = env_setting("ZERO_CORE_RANKS_PER_NODE", int, "an integer")
    rpn = override if override is not None else min(launcher_local_size, world_size)
    return Topology(world_size=world_size, ranks_per_node=rpn)
