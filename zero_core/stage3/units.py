"""Fetch units: the parameters that stage 3 gathers (and reduces) with one collective.

Gathering every parameter on its own would cost one collective per bias and LayerNorm;
gathering the whole model at once would defeat partitioning. A *fetch unit* is the set of
parameters of one or more consecutive modules (registration order, which is close to
execution order), of one parameter group:

* parameters with fewer than ``stage3_param_persistence_threshold`` elements go to one
  *persistent* unit per group: gathered once per optimizer step and kept;
* the other parameters of a module form a unit, and consecutive modules are coalesced
  into the same unit until it holds at least :func:`coalesce_numel` elements, so that
  small modules do not each pay a collective's latency;
* a parameter shared by two modules (tied weights) belongs to the unit of the first
  module that registers it; the second module's forward gathers that unit too.

Each unit is one bucket of its group's flat layout (:func:`unit_layout`), padded to a
multiple of ``world_size × alignment`` so that every rank owns an equal, aligned slice:
rank *r*'s partition of a unit is slice *r* of that bucket, and the gathered unit is one
``all_gather_into`` of the slices.

A unit also owns its state (:class:`UnitState`: released, in flight, gathered; and who
uses it): the gatherer and the coordinator change it through the unit's methods only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from zero_core.partitioning.layout import GroupLayout, Segment, round_up

#: coalescing target: units grow until they hold this many elements (2**18 elements is
#: 1 MiB of fp32, enough to amortize a collective's latency on the backends here)
COALESCE_TARGET = 2 ** 18

FROZEN = -1  # group index of parameters that no optimizer group trains


def coalesce_numel(prefetch_bucket_size: int, reduce_bucket_size: int) -> int:
    """Elements a unit grows to before a new one starts: COALESCE_TARGET, but never more
    than the prefetch or reduce bucket sizes (so that tests can ask for small units)."""
    return max(1, min(COALESCE_TARGET, prefetch_bucket_size, reduce_bucket_size))


class UnitState(Enum):
    """Where a fetch unit's gathered values are (see :class:`FetchUnit`)."""

    RELEASED = "released"   # only the partitions exist; the parameters are empty
    INFLIGHT = "inflight"   # an all-gather into ``full`` was launched
    GATHERED = "gathered"   # ``full`` holds the values; the parameters are views of it


#: the transitions UnitGatherer makes (gather.py)
_TRANSITIONS = {(UnitState.RELEASED, UnitState.INFLIGHT), (UnitState.INFLIGHT, UnitState.GATHERED),
                (UnitState.INFLIGHT, UnitState.RELEASED), (UnitState.GATHERED, UnitState.RELEASED)}


@dataclass(eq=False)
class FetchUnit:
    """Parameters gathered together. ``offsets`` are element offsets in the gathered flat
    buffer of ``padded_numel`` elements; ``part`` (this rank's slice, compute dtype),
    ``grad_part`` and ``master_part`` are views into the group's flat partitions.

    The unit owns its gathering and use state. It is read through properties (``state``,
    ``full``, ``active``, ``pins``, ``pinned_for_backward``, ``released``, ``in_use``,
    ``releasable``) and changed only by the methods below: the gather transitions
    (``mark_inflight``, ``mark_gathered``, ``mark_released``, ``wait_collective``) by
    UnitGatherer (gather.py), the use counts (``enter_forward``/``exit_forward``,
    ``pin``/``unpin``, ``hold_for_backward``/``drop_backward_hold``) by ParamCoordinator
    (coordinator.py).
    """

    index: int
    group: int
    persistent: bool
    params: list = field(default_factory=list)
    names: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    numel: int = 0
    padded_numel: int = 0
    bucket: int = -1
    part: torch.Tensor | None = None
    grad_part: torch.Tensor | None = None
    master_part: torch.Tensor | None = None
    owner: object = None             # the engine's ParamCoordinator (it adopts its units)
    # gathering and use state: written only by the methods below
    _state: UnitState = field(default=UnitState.RELEASED, init=False, repr=False)
    _full: torch.Tensor | None = field(default=None, init=False, repr=False)
    _handle: object = field(default=None, init=False, repr=False)
    _active: int = field(default=0, init=False, repr=False)    # forward calls running
    _pins: int = field(default=0, init=False, repr=False)      # GatheredParameters holding it
    _pinned_for_backward: bool = field(default=False, init=False, repr=False)

    @property
    def trainable(self) -> bool:
        return self.group != FROZEN

    def add(self, p, name: str) -> None:
        self.params.append(p)
        self.names.append(name)
        self.offsets.append(self.numel)
        self.numel += p.numel()

    # ---- reading the state -------------------------------------------------------------
    @property
    def state(self) -> UnitState:
        return self._state

    @property
    def released(self) -> bool:
        return self._state is UnitState.RELEASED

    @property
    def full(self) -> torch.Tensor | None:
        """The gathered flat values (in flight or complete); None when released."""
        return self._full

    @property
    def active(self) -> int:
        """Forward calls running that use the unit."""
        return self._active

    @property
    def pins(self) -> int:
        """GatheredParameters contexts holding the unit."""
        return self._pins

    @property
    def pinned_for_backward(self) -> bool:
        """Read by GatheredParameters between a forward and its backward: kept until the
        backward ends."""
        return self._pinned_for_backward

    @property
    def in_use(self) -> bool:
        """A running forward or a GatheredParameters context needs the gathered values."""
        return bool(self._pins or self._active)

    @property
    def releasable(self) -> bool:
        """Nothing keeps the unit gathered: not persistent, pinned, running or held."""
        return not (self.persistent or self._pins or self._active or self._pinned_for_backward)

    # ---- gather transitions (UnitGatherer) ---------------------------------------------
    def _move(self, to: UnitState) -> None:
        if (self._state, to) not in _TRANSITIONS:
            raise RuntimeError(f"fetch unit {self.index}: no transition from "
                               f"{self._state.value} to {to.value}")
        self._state = to

    def mark_inflight(self, full: torch.Tensor, handle) -> None:
        """A gather into *full* was launched (*handle*: its collective, None if done)."""
        self._move(UnitState.INFLIGHT)
        self._full, self._handle = full, handle

    def wait_collective(self) -> None:
        """Complete the gather's collective, if one is still running."""
        if self._handle is not None:
            self._handle.wait()
            self._handle = None

    def mark_gathered(self) -> None:
        """``full`` holds the values (the collective completed)."""
        self.wait_collective()
        self._move(UnitState.GATHERED)

    def mark_released(self) -> None:
        """The gathered values are dropped (the collective completed first)."""
        self.wait_collective()
        self._move(UnitState.RELEASED)
        self._full = None

    # ---- use counts (ParamCoordinator) -------------------------------------------------
    def enter_forward(self) -> None:
        self._active += 1

    def exit_forward(self) -> None:
        self._active -= 1

    def pin(self) -> None:
        self._pins += 1

    def unpin(self) -> None:
        self._pins -= 1

    def hold_for_backward(self) -> None:
        self._pinned_for_backward = True

    def drop_backward_hold(self) -> None:
        self._pinned_for_backward = False


def plan_units(model: torch.nn.Module, group_of: dict[int, int], persistence_threshold: int,
               target: int) -> tuple[list[FetchUnit], dict[torch.nn.Module, list[FetchUnit]]]:
    """Split every parameter of *model* into fetch units (see module docstring).

    *group_of* maps id(param) to its optimizer group (FROZEN for parameters no group
    trains). Returns the units (ordered by group, then registration) and, for every module
    with direct parameters, the units its forward needs (in first-use order).
    """
    names = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        names[id(p)] = name
    unit_of: dict[int, FetchUnit] = {}
    open_units: dict[int, FetchUnit] = {}
    persistent: dict[int, FetchUnit] = {}
    created: list[FetchUnit] = []
    module_units: dict[torch.nn.Module, list[FetchUnit]] = {}

    def new_unit(group, is_persistent):
        u = FetchUnit(index=-1, group=group, persistent=is_persistent)
        created.append(u)
        return u

    for module in model.modules():
        direct = [p for p in module._parameters.values() if p is not None]
        if not direct:
            continue
        started: set[int] = set()
        for p in direct:
            if id(p) in unit_of:
                continue
            g = group_of[id(p)]
            if p.numel() < persistence_threshold:
                u = persistent.get(g)
                if u is None:
                    u = persistent[g] = new_unit(g, True)
            else:
                u = open_units.get(g)
                if u is None or (g not in started and u.numel >= target):
                    u = open_units[g] = new_unit(g, False)
                started.add(g)
            u.add(p, names[id(p)])
            unit_of[id(p)] = u
        needed = []
        for p in direct:
            u = unit_of[id(p)]
            if all(u is not v for v in needed):
                needed.append(u)
        module_units[module] = needed
    order = {id(u): i for i, u in enumerate(created)}
    ordered = sorted(created, key=lambda u: (u.group if u.group != FROZEN else 1 << 30,
                                             order[id(u)]))
    for i, u in enumerate(ordered):
        u.index = i
    return ordered, module_units


def unit_layout(units: list[FetchUnit], world_size: int, alignment: int) -> GroupLayout:
    """A GroupLayout whose bucket *k* is ``units[k]`` (padded to world_size × alignment),
    so that the partition machinery of stages 1-2 (FlatBuffer, the partitioned optimizer)
    works on stage-3 units unchanged. Sets each unit's ``bucket`` and ``padded_numel``."""
    quantum = world_size * alignment
    numels, offsets, starts, sizes, segments = [], [], [], [], []
    pos = 0
    for k, u in enumerate(units):
        u.bucket = k
        u.padded_numel = round_up(u.numel, quantum)
        starts.append(pos)
        sizes.append(u.padded_numel)
        for p, off in zip(u.params, u.offsets):
            i = len(numels)
            n = p.numel()
            numels.append(n)
            offsets.append(pos + off)
            segments.append(Segment(i, k, 0, n, off))
        pos += u.padded_numel
    return GroupLayout(tuple(numels), tuple(offsets), tuple(starts), tuple(sizes), world_size,
                       alignment, tuple(segments))
