"""The ranks a ZeRO partition is spread over, seen by the stages as a communicator.

Every stage partitions its model states over "the world" of the communicator it is given
(``BuildContext.comm``): rank ``i`` of ``world_size`` owns slice ``i``. This module decides
what that world is — the one place where MiCS and node-aware collectives live — and hands the
stages a :class:`PartitionComm` whose ``rank``, ``world_size`` and default group are it:

- **plain**: every rank, in rank order; collectives go over the communicator's world group.
- **MiCS** (``mics_shard_size`` G, DeepSpeed's key): the G consecutive ranks of this rank's
  *shard group*; the N/G shard groups each hold a whole copy of the model states. Parameters
  are gathered and gradients reduce-scattered inside the shard group; the engine then
  all-reduces each rank's reduced gradient partition over its *replica group* (the ranks
  with the same index in every shard group) at the accumulation boundary.
- **node-aware** (``node_aware_collectives``, and ``mics_hierarchical_params_gather`` for a
  shard group spanning nodes): the partition group spans K nodes of L ranks. Its ranks are
  numbered local-rank-major — partition index ``l·K + n`` for local rank l on node n — so
  that an all-gather is two steps with no reordering: first across nodes among the K ranks
  of equal local rank (each sends its slice once over the slow link), then inside the node
  (each forwards the K slices it holds). A reduce-scatter runs in reverse: inside the node,
  then across nodes. Per rank, for a payload of P elements of b bytes (N = K·L):

      all-gather      inter (K-1)·P·b/N    intra (L-1)·P·b/L
      reduce-scatter  intra (L-1)·P·b/L    inter (K-1)·P·b/N

  against (N-1)·P·b/N for the flat collective on a group spanning nodes, all of it counted
  inter-node by the ledger.

Two-hop progress: a node-aware collective (and MiCS's reduce-scatter followed by its
all-reduce across the copies) returns a :class:`TwoHops` handle. When its second hop starts
depends on what the backend needs of the order of collectives across groups
(``Communicator.collective_order``):

- ``"per_group"`` (gloo): as soon as the first hop has landed, checked whenever the partition
  communicator is called or waited on, so a prefetched gather or a reduce-scatter launched
  during backward runs both hops behind compute. "Landed" is seen at different moments on
  different ranks, so each hop kind has its own group (all-gathers: ``across`` then
  ``inside``; reduce-scatters: ``inside_rs`` then ``across_rs``; MiCS: the replica group) and
  second hops start strictly in call order: each group sees the same sequence on every rank.
- ``"global"`` (MPI, oneCCL: one worker thread runs every collective in submission order):
  at once, right behind the first — the worker runs them in that order, the same on every
  rank — unless tensors are staged through host buffers (their copies happen at submission
  and completion, so the second hop must wait for the first): then as below.
- otherwise (NCCL and plugins until measured): when the handle is waited for, in call order.

What is refused, and why: shard sizes that are neither a divisor nor a multiple of the ranks
per node (a shard group must be whole nodes or lie inside one); MiCS with qgZ or hpZ
(config/parser.py says why). Node-aware collectives fall back to the flat ones — with a log
line — under qgZ (its own two-hop reduction assumes rank-ordered chunks) and on communicators
whose groups are costly to create (``Communicator.cheap_groups`` false: oneCCL). Group-
creating calls (``new_group``, ``split``, ``intra_node_group``...) and every call given an
explicit *group* go to the underlying communicator unchanged: they speak global ranks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from collections import deque
from typing import Callable

from zero_core.errors import CommError, ConfigError
from zero_core.interfaces.communicator import Communicator, Group

log = logging.getLogger("zero_core.runtime")


@dataclass(frozen=True)
class PartitionPlan:
    """Which ranks partition together, in which order, and how they gather (pure numbers:
    the same on every rank, tested without a communicator)."""

    groups: tuple[tuple[int, ...], ...]      # each partition group's ranks, by partition index
    hierarchical: bool                       # node-aware two-step collectives
    nodes_per_group: int                     # K: nodes one partition group spans
    ranks_per_node: int                      # L

    @property
    def size(self) -> int:
        return len(self.groups[0])

    @property
    def replicas(self) -> int:
        """How many copies of the model states the job holds (N / partition size)."""
        return len(self.groups)

    def group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.groups if rank in g)

    def replica_partition(self) -> list[list[int]]:
        """The replica groups: for each partition index, that index's rank in every group."""
        return [[g[i] for g in self.groups] for i in range(self.size)]

    def across_partition(self) -> list[list[int]]:
        """Hierarchical: the ranks of equal local rank on the nodes of one partition group."""
        out = []
        for g in self.groups:
            k = self.nodes_per_group
            out += [list(g[i * k:(i + 1) * k]) for i in range(len(g) // k)]
        return out


def plan_partition(world_size: int, ranks_per_node: int, shard_size: int = -1,
                   node_aware: bool = True) -> PartitionPlan:
    """The partition groups of a job (module docstring). *shard_size* -1: every rank (plain);
    *node_aware*: number a group spanning several nodes local-rank-major and gather in two
    steps (for MiCS: ``mics_hierarchical_params_gather``)."""
    L = ranks_per_node
    G = world_size if shard_size == -1 else shard_size
    if G < 1 or world_size % G:
        raise ConfigError(f"zero_optimization.mics_shard_size = {shard_size} must divide the "
                          f"world size {world_size}")
    if G > L and G % L:
        raise ConfigError(
            f"zero_optimization.mics_shard_size = {G}: a shard group must lie inside one node "
            f"or be whole nodes, and this job has {L} ranks per node; use a divisor or a "
            f"multiple of {L} (normally {L})")
    K = max(1, G // L)
    hierarchical = node_aware and K > 1 and L > 1
    groups = []
    for start in range(0, world_size, G):
        if hierarchical:
            # partition index l·K + n: local rank l on the group's node n
            groups.append(tuple(start + n * L + l for l in range(L) for n in range(K)))
        else:
            groups.append(tuple(range(start, start + G)))
    return PartitionPlan(tuple(groups), hierarchical, K, L)


@dataclass(frozen=True)
class HopGroups:
    """The four groups of node-aware collectives (module docstring: one per hop kind)."""

    across: Group        # all-gather, first hop: same local rank on the group's nodes
    inside: Group        # all-gather, second hop: this node's ranks
    inside_rs: Group     # reduce-scatter, first hop
    across_rs: Group     # reduce-scatter, second hop


class TwoHops:
    """A node-aware collective in flight: its first hop's handle and how to start the
    second (*start_second*, which returns the second hop's handle)."""

    def __init__(self, queue: "_HopQueue", first, start_second: Callable[[], object]):
        self.queue, self.first, self.start_second = queue, first, start_second
        self.second = None

    def advance(self, block: bool) -> bool:
        """Start the second hop if the first has landed (waiting for it when *block*)."""
        if self.second is None:
            if not block and not self.first.is_completed():
                return False
            self.first.wait()        # also runs its finishing work (staging copies)
            self.second = self.start_second()
        return True

    def wait(self) -> None:
        self.queue.start_through(self)
        self.first.wait()            # done already, unless both were started at once
        self.second.wait()

    def is_completed(self) -> bool:
        self.queue.progress()
        return self.second is not None and self.second.is_completed()


#: when a second hop starts (module docstring): on landing, at once, or when waited for
HOP_MODES = ("on_landing", "at_once", "when_waited")


def hop_mode(comm: Communicator) -> str:
    """The second-hop mode *comm*'s collective order allows (module docstring)."""
    order = getattr(comm, "collective_order", "unknown")
    if order == "per_group":
        return "on_landing"
    if order == "global" and getattr(comm, "staging", None) is None:
        return "at_once"
    return "when_waited"


class _HopQueue:
    """Two-hop collectives of one kind whose second hop has not started, in call order."""

    def __init__(self, mode: str = "on_landing"):
        if mode not in HOP_MODES:
            raise ValueError(f"second-hop mode {mode!r}: expected one of {HOP_MODES}")
        self.mode = mode
        self.pending: deque[TwoHops] = deque()

    def launch(self, first, start_second) -> TwoHops:
        hops = TwoHops(self, first, start_second)
        if self.mode == "at_once":
            hops.second = start_second()   # the backend runs it right after the first
        else:
            self.pending.append(hops)
        return hops

    def progress(self) -> None:
        """On landing: start the second hops whose first hop has landed, oldest first,
        stopping at the first that has not (later ones must not overtake it)."""
        if self.mode != "on_landing":
            return
        while self.pending and self.pending[0].advance(block=False):
            self.pending.popleft()

    def start_through(self, hops: TwoHops) -> None:
        """Start every second hop up to and including *hops*' (waiting for first hops)."""
        while hops.second is None:
            self.pending.popleft().advance(block=True)


class PartitionComm:
    """A communicator whose world is one partition group (module docstring). Collectives
    without an explicit *group* run over the partition group, in partition-index order;
    everything else is the underlying communicator's."""

    def __init__(self, base: Communicator, plan: PartitionPlan, world: Group,
                 hops: HopGroups | None = None, replicas: Group | None = None):
        self.base, self.plan = base, plan
        self.order = plan.group_of(base.rank)
        self.rank = self.order.index(base.rank)
        self.world_size = len(self.order)
        self.world = world
        self.hops = hops
        # MiCS, when each accumulation window reduces once: a reduce-scatter's result is
        # all-reduced over the replica group as its last hop (Sharding.replicas_in_reduce)
        self.replicas = replicas
        mode = hop_mode(base)
        self._gathers, self._reductions, self._replica_sums = (
            _HopQueue(mode), _HopQueue(mode), _HopQueue(mode))

    def __getattr__(self, name):
        # ledger, name, timeout, topology, supports, device_types, staging, new_group, ...
        return getattr(self.base, name)

    @property
    def hierarchical(self) -> bool:
        return self.hops is not None

    def _progress(self) -> None:
        self._gathers.progress()
        self._reductions.progress()
        self._replica_sums.progress()

    def _own(self, group) -> bool:
        return group is None or group is self.world

    def all_gather_into(self, output, input, group: Group | None = None, async_op: bool = False):
        if not self._own(group):
            return self.base.all_gather_into(output, input, group, async_op)
        if not self.hierarchical:
            return self.base.all_gather_into(output, input, self.world, async_op)
        self._progress()
        hops = self.hops
        mine = output.new_empty(input.numel() * hops.across.size)   # my local rank's
        first = self.base.all_gather_into(mine, input, hops.across, async_op=True)  # slices
        handle = self._gathers.launch(first, lambda: self.base.all_gather_into(
            output, mine, hops.inside, async_op=True))
        return _finish(handle, async_op)

    def reduce_scatter(self, output, input, op: str = "sum", group: Group | None = None,
                       async_op: bool = False):
        if not self._own(group):
            return self.base.reduce_scatter(output, input, op, group, async_op)
        if self.replicas is not None:
            if op != "sum":
                raise CommError(f"reduce_scatter: op {op!r} over MiCS shard groups whose "
                                f"results are summed across the copies; use 'sum'")
            self._progress()
            inner = self._reduce_scatter_in_group(output, input, op)
            handle = self._replica_sums.launch(inner, lambda: self.base.all_reduce(
                output, op, self.replicas, async_op=True))
            return _finish(handle, async_op)
        return _finish(self._reduce_scatter_in_group(output, input, op), async_op)

    def _reduce_scatter_in_group(self, output, input, op: str):
        """The reduce-scatter over the partition group, in flight."""
        if not self.hierarchical:
            return self.base.reduce_scatter(output, input, op, self.world, async_op=True)
        if op == "avg":
            raise CommError("reduce_scatter: op 'avg' is not supported by the node-aware "
                            "reduce-scatter (its two steps would average twice); use 'sum'")
        if input.numel() != output.numel() * self.world_size:
            raise CommError(f"reduce_scatter over the partition group: input has "
                            f"{input.numel()} elements but needs output.numel() * "
                            f"{self.world_size} = {output.numel() * self.world_size}")
        self._progress()
        hops = self.hops
        node_sum = output.new_empty(output.numel() * hops.across_rs.size)
        first = self.base.reduce_scatter(node_sum, input, op, hops.inside_rs, async_op=True)
        return self._reductions.launch(first, lambda: self.base.reduce_scatter(
            output, node_sum, op, hops.across_rs, async_op=True))

    def all_reduce(self, tensor, op: str = "sum", group: Group | None = None,
                   async_op: bool = False):
        return self.base.all_reduce(tensor, op, self.world if self._own(group) else group,
                                    async_op)

    def broadcast(self, tensor, src: int = 0, group: Group | None = None,
                  async_op: bool = False):
        if self._own(group):
            # src is a partition index; the group speaks its own (sorted) rank order
            src, group = self.world.ranks.index(self.order[src]), self.world
        return self.base.broadcast(tensor, src, group, async_op)

    def all_to_all_single(self, output, input, group: Group | None = None,
                          async_op: bool = False):
        if self._own(group) and self.hierarchical:
            raise CommError("all_to_all_single over a node-aware partition group is not "
                            "supported (its chunks follow partition order, not the group's); "
                            "pass an explicit group")
        return self.base.all_to_all_single(output, input,
                                           self.world if self._own(group) else group, async_op)

    def barrier(self, group: Group | None = None) -> None:
        self.base.barrier(self.world if self._own(group) else group)

    def describe(self) -> str:
        how = "node-aware, " if self.hierarchical else ""
        return (f"partition index {self.rank} of {self.world_size} ({how}"
                f"{self.plan.replicas} cop{'y' if self.plan.replicas == 1 else 'ies'}) over "
                f"{self.base.describe()}")


def _finish(handle, async_op: bool):
    if async_op:
        return handle
    handle.wait()
    return None


@dataclass(frozen=True)
class Sharding:
    """What the engine needs to know about its partitioning: the stages' communicator and,
    with MiCS, the group its gradient partitions are all-reduced over — by the partition
    communicator's reduce-scatters themselves (``replicas_in_reduce``), or by the engine
    once per step."""

    comm: PartitionComm | Communicator     # the stages' world
    replicas: Group | None                  # MiCS: this rank's replica group, else None
    num_replicas: int
    replicas_in_reduce: bool = False

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size


_CACHE: dict = {}


def build_sharding(comm: Communicator, zero_config, stage: int, uses_qgz: bool = False,
                   reduces_once_per_step: bool = False) -> Sharding:
    """Collective on first use per setting: the partition groups of *zero_config* over
    *comm* (cached, so that the engine and ``zero_core.Init`` share their groups).

    *reduces_once_per_step*: the stage reduce-scatters each gradient once per accumulation
    window (stage 1, or one micro-step per window). MiCS's all-reduce across the copies then
    rides as the last hop of each reduce-scatter, overlapping backward; otherwise the
    engine all-reduces the accumulated partitions once at the step (summing every micro-step
    across the copies would multiply the inter-node bytes by the accumulation steps)."""
    mics = zero_config.mics_shard_size if stage >= 1 else -1
    node_aware = (zero_config.mics_hierarchical_params_gather if mics > 0
                  else zero_config.node_aware_collectives and stage >= 1)
    if node_aware and uses_qgz:
        node_aware = False
        _log_once(comm, "node-aware collectives are off: ZeRO++ qgZ reduces gradients in "
                        "its own two hops")
    if node_aware and not getattr(comm, "cheap_groups", True):
        node_aware = False
        _log_once(comm, f"node-aware collectives are off: creating the groups they need is "
                        f"costly on the {comm.name} communicator; its flat collectives are "
                        f"used")
    key = (comm, mics, node_aware)      # communicators hash by identity
    if key not in _CACHE:
        _CACHE[key] = _build_groups(comm, zero_config, mics, node_aware)
    plan, world, hops, replicas = _CACHE[key]
    if world is None:
        return Sharding(comm, None, 1)
    in_reduce = replicas is not None and reduces_once_per_step
    pc = PartitionComm(comm, plan, world, hops, replicas if in_reduce else None)
    return Sharding(pc, replicas, plan.replicas, in_reduce)


def _build_groups(comm: Communicator, zero_config, mics: int, node_aware: bool):
    """Collective: (plan, partition group, hop groups, replica group); the group is None
    when the partition is the plain world."""
    topo = comm.topology
    plan = plan_partition(comm.world_size, topo.ranks_per_node, mics, node_aware)
    if mics > 0 and zero_config.mics_hierarchical_params_gather and not plan.hierarchical:
        _log_once(comm, f"mics_hierarchical_params_gather has no effect: each shard group "
                        f"of {mics} ranks lies inside one node ({topo.ranks_per_node} ranks)")
    if plan.replicas == 1 and not plan.hierarchical:
        return plan, None, None, None
    world = (comm.world if plan.replicas == 1
             else comm.split([sorted(g) for g in plan.groups], "mics_shard"))
    hops = None
    if plan.hierarchical:
        across, nodes = plan.across_partition(), topo.intra_node_partition()
        hops = HopGroups(comm.split(across, "gather_across_nodes"),
                         comm.split(nodes, "gather_inside_node"),
                         comm.split(nodes, "reduce_inside_node"),
                         comm.split(across, "reduce_across_nodes"))
    replicas = (comm.split(plan.replica_partition(), "mics_replica")
                if plan.replicas > 1 else None)
    if comm.rank == 0:
        log.info("partitioning: %s", PartitionComm(comm, plan, world, hops).describe())
    return plan, world, hops, replicas


def forget(comm: Communicator) -> None:
    """Drop the partition groups built over *comm* (the runtime shuts it down)."""
    for key in [k for k in _CACHE if k[0] is comm]:
        del _CACHE[key]


def _log_once(comm, message: str) -> None:
    if comm.rank == 0 and message not in _LOGGED:
        _LOGGED.add(message)
        log.info(message)


_LOGGED: set = set()
