"""The Communicator interface: the collectives ZeRO needs, on flat tensors.

Backends subclass :class:`Communicator` and implement the ``_``-prefixed methods. The
public methods here validate arguments (before anything is sent), record every call in
the :class:`~zero_core.interfaces.ledger.CommLedger` and wrap the backend's in-flight work in a
:class:`Handle` whose ``wait()`` raises :class:`CommTimeoutError` naming the collective
and the group instead of hanging when a peer dies.

Conventions:
- every tensor is contiguous; input and output of one call share a dtype and device;
- ``src`` of ``broadcast`` is a rank *within the group*;
- group creation is collective: every rank of the world calls it with the same arguments;
- a tensor on a device the backend cannot carry (``device_types``) is staged — device
  tensors through pinned host buffers, host tensors through device buffers — once the
  runtime has enabled staging (:meth:`Communicator.enable_staging`,
  :mod:`zero_core.interfaces.staging`); the copies are counted in the ledger as
  ``staged_bytes`` / ``staging_s``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch

from zero_core.interfaces.staging import StagedCall, Staging
from zero_core.errors import CommError, CommTimeoutError
from zero_core.interfaces.ledger import CommLedger, LedgerEntry, sent_bytes

REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass(eq=False)
class Group:
    """A set of global ranks that run collectives together."""

    name: str
    ranks: tuple[int, ...]
    rank: int                # this process's index in ``ranks``; -1 if not a member
    spans_nodes: bool        # ranks on more than one node: traffic counts as inter-node
    handle: Any = field(default=None, repr=False)  # the backend's own group object

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_member(self) -> bool:
        return self.rank >= 0


class Handle:
    """An in-flight collective. ``wait()`` blocks until done or raises on timeout.

    *wait_fn(timeout_s) -> bool* is the backend's wait; it returns False when the
    deadline passed. *finish* runs once after completion (copies out of staging buffers).

    A backend that carries a collective through a different one (e.g. an all-gather done
    as an all-reduce because that is faster on gloo) sets *wire_op* and
    *wire_payload_bytes*, so that the ledger counts what really went over the wire.
    """

    wire_op: str | None = None
    wire_payload_bytes: int | None = None

    def __init__(self, op: str, group: Group, timeout: float,
                 wait_fn: Callable[[float], bool], finish: Callable[[], None] | None = None,
                 test_fn: Callable[[], bool] | None = None):
        self.op, self.group, self.timeout = op, group, timeout
        self._wait_fn, self._finish, self._test_fn = wait_fn, finish, test_fn
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        try:
            finished = self._wait_fn(self.timeout)
        except CommError:
            raise
        except Exception as exc:  # backends report dead peers in their own words
            raise CommError(f"{self.op} on group '{self.group.name}' "
                            f"(ranks {list(self.group.ranks)}) failed: {exc}") from exc
        if not finished:
            raise CommTimeoutError(
                f"{self.op} on group '{self.group.name}' (ranks {list(self.group.ranks)}) did "
                f"not finish within {self.timeout:g} s: a peer rank has probably died or "
                f"stopped calling collectives. Raise the timeout with the 'comm_timeout' "
                f"config key or ZERO_CORE_COMM_TIMEOUT if the peers are just slow.")
        self._done = True
        if self._finish is not None:
            self._finish()

    def is_completed(self) -> bool:
        if self._done:
            return True
        return bool(self._test_fn()) if self._test_fn else False


def _finish_staging_after(handle: Handle, staged: StagedCall, record) -> None:
    """Make *handle*'s completion copy the staged results back to the device (after the
    backend's own finishing work), return the buffers, then *record* the staging cost."""
    before = handle._finish

    def finish():
        try:
            if before is not None:
                before()
        finally:
            staged.finish()
        record()

    handle._finish = finish


class Communicator(ABC):
    """Base class of communication backends. See the module docstring for conventions."""

    #: name used in config ``"comm_backend"`` and ``ZERO_CORE_COMM``
    name: ClassVar[str] = ""
    #: the accelerator device types this backend can move tensors of
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    #: False when every new group costs much (seconds) or is unreliable: the runtime then
    #: keeps to the world group where it can (node-aware collectives fall back to flat ones)
    cheap_groups: ClassVar[bool] = True
    #: what this backend needs of the order collectives are issued in, across groups:
    #: "per_group" — each group's collectives in the same order on every rank, groups progress
    #: independently (gloo: its own threads and connections per group); "global" — every
    #: collective of every group runs in submission order on one queue, so ranks must issue
    #: them all in the same order (MPI, oneCCL: one worker thread); "unknown" — assume both
    #: (the node-aware collectives of runtime/partition_comm.py then start a second hop only
    #: when it is waited for)
    collective_order: ClassVar[str] = "unknown"

    @classmethod
    @abstractmethod
    def availability(cls) -> tuple[bool, str]:
        """(True, "") when usable in this process, else (False, why and how to fix)."""

    @classmethod
    def start_torch_distributed(cls, launch, timeout: float) -> None:
        """Initialize torch.distributed's default process group with this backend over
        *launch*'s rendezvous, unless it is already initialized.

        Only communicators that run over torch.distributed can; the others refuse. The
        runtime asks the registry's ``gloo`` communicator, so that user code calling
        ``torch.distributed`` works whatever communicator carries ZeRO's traffic — the
        start-up itself belongs to that backend, which the engine does not import.
        """
        raise NotImplementedError(f"communicator {cls.name!r} does not run over "
                                  f"torch.distributed, so it cannot start it")

    def __init__(self, launch, topology, timeout: float = 300.0):
        """*launch* is where this process sits in the job (``rank``, ``world_size``,
        ``local_rank``, ``local_world_size``, ``launcher``, ``is_mpi``: a
        ``zero_core.runtime.launch.LaunchInfo``); *topology* is which ranks share a node
        (``spans_nodes``, ``intra_node_partition``, ``inter_node_partition``, ``num_nodes``,
        ``ranks_per_node``: a ``zero_core.runtime.topology.Topology``). Both are values the
        runtime builds; they are named here by the attributes backends may use, so that the
        interface imports nothing from the runtime."""
        self.launch = launch
        self.topology = topology
        self.timeout = float(timeout)
        self.rank = launch.rank
        self.world_size = launch.world_size
        self.ledger = CommLedger()
        self._groups: dict[str, Group] = {}
        self._made: list[Group] = []   # every group new_group returned (release_groups)
        self._group_counter = 0  # before _init_world: a backend may make groups there
        self.staging: Staging | None = None
        self.world: Group = self._init_world()

    def enable_staging(self, accelerator, device) -> None:
        """Carry the tensors this backend cannot reach — *accelerator*'s device tensors when
        it carries host memory only, host tensors when it carries device memory only —
        through stand-in buffers on the other side. Called by the runtime."""
        staging = Staging(accelerator, device, self.device_types)
        self.staging = staging if (staging.via_host or staging.via_device) else None

    # ---- backend hooks -------------------------------------------------------------
    @abstractmethod
    def _init_world(self) -> Group:
        """Connect to the peers; return the world group."""

    @abstractmethod
    def _new_group(self, ranks: tuple[int, ...], name: str) -> Any:
        """Collective over the world: create the backend group object for *ranks*
        (return None on ranks that are not members if the backend allows)."""

    @abstractmethod
    def _all_gather_into(self, output, input, group) -> Handle: ...

    @abstractmethod
    def _reduce_scatter(self, output, input, op, group) -> Handle: ...

    @abstractmethod
    def _all_reduce(self, tensor, op, group) -> Handle: ...

    @abstractmethod
    def _all_to_all_single(self, output, input, group) -> Handle: ...

    @abstractmethod
    def _broadcast(self, tensor, src, group) -> Handle: ...

    @abstractmethod
    def _barrier(self, group) -> Handle: ...

    def supports(self, op: str, dtype: torch.dtype) -> bool:
        """Whether this backend can carry *dtype* for *op*. Backends override to narrow."""
        return dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                         torch.int8, torch.uint8, torch.int32, torch.int64)

    def shutdown(self) -> None:
        """Release backend resources. Safe to call twice."""

    def release_groups(self) -> None:
        """After :meth:`shutdown`: drop the backend's group objects held by this
        communicator's groups, so that they are destroyed now, while the interpreter is
        whole. Left to interpreter finalization, a gloo group's worker threads can abort the
        process at exit ("terminate called without an active exception")."""
        for group in (self.world, *self._made):
            group.handle = None
        self._groups.clear()

    # ---- groups ----------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int], name: str | None = None) -> Group:
        """Collective over the world: a group of *ranks* (global). Every rank calls it."""
        ranks = tuple(sorted(int(r) for r in ranks))
        if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= self.world_size:
            raise CommError(f"group ranks {list(ranks)} must be distinct ranks in "
                            f"[0, {self.world_size})")
        self._group_counter += 1
        name = name or f"group{self._group_counter}:{','.join(map(str, ranks))}"
        handle = self._new_group(ranks, name)
        rank = ranks.index(self.rank) if self.rank in ranks else -1
        group = Group(name, ranks, rank, self.topology.spans_nodes(ranks), handle)
        self._made.append(group)
        return group

    def split(self, partition: Sequence[Sequence[int]], name: str) -> Group:
        """Collective over the world: create one group per list in *partition* (which must
        cover every rank once) and return the group this rank belongs to."""
        flat = sorted(r for part in partition for r in part)
        if flat != list(range(self.world_size)):
            raise CommError(f"split '{name}': the partition {partition} must list every rank "
                            f"0..{self.world_size - 1} exactly once")
        mine = None
        for i, part in enumerate(partition):
            g = self.new_group(part, name=f"{name}[{i}]")
            if g.is_member:
                mine = g
        return mine

    def intra_node_group(self) -> Group:
        """The ranks on this rank's node (cached; first call is collective)."""
        if "intra_node" not in self._groups:
            self._groups["intra_node"] = self.split(self.topology.intra_node_partition(), "intra_node")
        return self._groups["intra_node"]

    def inter_node_group(self) -> Group:
        """The ranks with this rank's local rank on every node (cached; first call is collective)."""
        if "inter_node" not in self._groups:
            self._groups["inter_node"] = self.split(self.topology.inter_node_partition(), "inter_node")
        return self._groups["inter_node"]

    # ---- collectives -----------------------------------------------------------------
    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor,
                        group: Group | None = None, async_op: bool = False):
        """Concatenate every rank's *input* (same numel on all) into *output*, in group order."""
        group = self._check_group(group, "all_gather_into")
        self._check_pair("all_gather_into", output, input)
        if output.numel() != input.numel() * group.size:
            raise CommError(f"all_gather_into on '{group.name}': output has {output.numel()} "
                            f"elements but needs input.numel() * group size = {input.numel()} "
                            f"* {group.size} = {input.numel() * group.size}")
        staged = self._stage(input, output)
        if staged:
            input, output = staged.stand_in(input), staged.stand_in(output, read=False, written=True)
        return self._run("all_gather_into", group, input, async_op,
                         lambda: self._all_gather_into(output, input, group), staged=staged)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       group: Group | None = None, async_op: bool = False):
        """Reduce *input* element-wise across ranks; rank i keeps chunk i in *output*."""
        group = self._check_group(group, "reduce_scatter")
        self._check_pair("reduce_scatter", output, input)
        self._check_op("reduce_scatter", op)
        if input.numel() != output.numel() * group.size:
            raise CommError(f"reduce_scatter on '{group.name}': input has {input.numel()} "
                            f"elements but needs output.numel() * group size = "
                            f"{output.numel()} * {group.size} = {output.numel() * group.size}")
        staged = self._stage(input, output)
        if staged:
            input, output = staged.stand_in(input), staged.stand_in(output, read=False, written=True)
        return self._run("reduce_scatter", group, input, async_op,
                         lambda: self._reduce_scatter(output, input, op, group), staged=staged)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Group | None = None,
                   async_op: bool = False):
        """Reduce *tensor* element-wise across ranks, in place."""
        group = self._check_group(group, "all_reduce")
        self._check_tensor("all_reduce", tensor)
        self._check_op("all_reduce", op)
        staged = self._stage(tensor)
        if staged:
            tensor = staged.stand_in(tensor, written=True)
        return self._run("all_reduce", group, tensor, async_op,
                         lambda: self._all_reduce(tensor, op, group), staged=staged)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          group: Group | None = None, async_op: bool = False):
        """Chunk j of *input* goes to rank j, which stores it as its chunk i (i = sender)."""
        group = self._check_group(group, "all_to_all_single")
        self._check_pair("all_to_all_single", output, input)
        if input.numel() != output.numel() or input.numel() % group.size:
            raise CommError(f"all_to_all_single on '{group.name}': input ({input.numel()}) and "
                            f"output ({output.numel()}) must have the same number of elements, "
                            f"divisible by the group size {group.size}")
        staged = self._stage(input, output)
        if staged:
            input, output = staged.stand_in(input), staged.stand_in(output, read=False, written=True)
        return self._run("all_to_all_single", group, input, async_op,
                         lambda: self._all_to_all_single(output, input, group), staged=staged)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: Group | None = None,
                  async_op: bool = False):
        """Copy *tensor* from group rank *src* to every rank of the group, in place."""
        group = self._check_group(group, "broadcast")
        self._check_tensor("broadcast", tensor)
        if not 0 <= src < group.size:
            raise CommError(f"broadcast on '{group.name}': src={src} is not a rank of the "
                            f"group (0..{group.size - 1}; src is the rank within the group)")
        is_source = group.rank == src
        staged = self._stage(tensor)
        if staged:  # only the source's bytes go out, only the others' come back
            tensor = staged.stand_in(tensor, read=is_source, written=not is_source)
        return self._run("broadcast", group, tensor, async_op,
                         lambda: self._broadcast(tensor, src, group), is_source=is_source,
                         staged=staged)

    def barrier(self, group: Group | None = None) -> None:
        """Block until every rank of the group has reached the barrier (or time out)."""
        group = self._check_group(group, "barrier")
        self._run("barrier", group, None, False, lambda: self._barrier(group))

    # ---- helpers ---------------------------------------------------------------------
    def _stage(self, *tensors) -> StagedCall | None:
        """A StagedCall when the tensors are where the backend cannot reach, else None."""
        if self.staging is not None and self.staging.handles(tensors[0]):
            return StagedCall(self.staging)
        return None

    def _run(self, op, group, payload, async_op, launch, is_source=False, staged=None):
        nbytes = payload.numel() * payload.element_size() if payload is not None else 0
        handle = launch()
        if staged is not None:
            _finish_staging_after(handle, staged, lambda: self.ledger.record_staging(
                handle.wire_op or op, staged.bytes, staged.seconds))
        wire_op = handle.wire_op or op
        if handle.wire_payload_bytes is not None:
            nbytes = handle.wire_payload_bytes
        self.ledger.record(LedgerEntry(
            op=wire_op, group=group.name,
            dtype=str(payload.dtype).replace("torch.", "") if payload is not None else "",
            payload_bytes=nbytes, sent_bytes=sent_bytes(wire_op, group.size, nbytes, is_source),
            inter_node=group.spans_nodes))
        if async_op:
            return handle
        handle.wait()
        return None

    def _check_group(self, group, op) -> Group:
        group = self.world if group is None else group
        if not group.is_member:
            raise CommError(f"{op}: this rank ({self.rank}) is not a member of group "
                            f"'{group.name}' (ranks {list(group.ranks)})")
        return group

    def _check_op(self, name, op):
        if op not in REDUCE_OPS:
            raise CommError(f"{name}: reduce op {op!r} is not supported; use one of {REDUCE_OPS}")

    def _check_tensor(self, op, t):
        if not isinstance(t, torch.Tensor):
            raise CommError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise CommError(f"{op}: tensor of shape {tuple(t.shape)} is not contiguous; "
                            f"call .contiguous() or pass a flat buffer")
        if t.device.type not in self.device_types and not (
                self.staging is not None and self.staging.handles(t)):
            raise CommError(f"{op}: the {self.name} communicator carries tensors on "
                            f"{self.device_types}, not on '{t.device}'")
        if not self.supports(op, t.dtype):
            raise CommError(f"{op}: the {self.name} communicator cannot carry dtype "
                            f"{t.dtype} for this collective; convert the tensor first")

    def _check_pair(self, op, output, input):
        self._check_tensor(op, input)
        self._check_tensor(op, output)
        if output.dtype != input.dtype:
            raise CommError(f"{op}: input dtype {input.dtype} and output dtype {output.dtype} differ")
        if output.device != input.device:
            raise CommError(f"{op}: input on {input.device} and output on {output.device} differ")

    def describe(self) -> str:
        return (f"{self.name} rank {self.rank}/{self.world_size} "
                f"({self.topology.num_nodes} node(s) x {self.topology.ranks_per_node})")


def all_gather_bytes(comm: Communicator, data: bytes) -> list[bytes]:
    """Every rank's *data* (small: a few KiB of JSON), in rank order: two all-gathers, the
    lengths and then the bytes padded to the longest (host tensors; staged where needed)."""
    n = comm.world_size
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = torch.empty(n, dtype=torch.int64)
    comm.all_gather_into(lengths, length)
    width = max(1, int(lengths.max()))
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = torch.empty(width * n, dtype=torch.uint8)
    comm.all_gather_into(everyone, mine)
    rows = everyone.view(n, width)
    return [bytes(rows[r, :int(lengths[r])].numpy().tobytes()) for r in range(n)]
