"""Optimizer states in swap files (``offload_optimizer.device: nvme``), ZeRO-Infinity style.

Files: one :class:`~zero_core.offload.swap_file.SwapFile` per (parameter group, state
name) — ``master``, ``exp_avg``, ``exp_avg_sq`` for Adam — covering this rank's
partition, with one region per sub-group; they live in this rank's swap directory
(cleanup.py).

Host memory: ``buffer_count`` *slots*, each holding one sub-group of every state, plus one
fp32 gradient buffer of a sub-group: ``(buffer_count × states + 1) × largest sub-group ×
4`` bytes, whatever the model size (:attr:`NvmeStateStore.host_bytes`).

Pipeline, during a step over the sub-groups in order: ``acquire(s)`` waits for the read
of ``s`` (started earlier) and hands its slot to the caller; meanwhile a reader thread
fills every free slot with the next sub-groups (read-ahead, in cyclic order, so the
first sub-groups of the next step are read during forward and backward); ``release(s)``
queues the slot for a writer thread (write-behind), which frees it when the write is done.
A read of a sub-group whose write is still queued waits for that write, so a read never
sees stale bytes. Disk and CPU work overlap as long as ``buffer_count >= 3`` (one slot
computing, one being written, one or more being read).

Errors in the worker threads (full disk, truncated or corrupted file) are raised in the
training thread at the next ``acquire``/``finish``, as :class:`OffloadError`.

Checkpoints see each state as a :class:`SwappedFlatBuffer`, whose ``data`` is a memory
map of the file (so saving and loading do not need the states in RAM); the CRCs are
recomputed from the files before the next step reads them (``reseal``).
"""
from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zero_core.partitioning.flat_buffer import FlatBuffer
from zero_core.partitioning.layout import GroupLayout
from zero_core.offload.cleanup import unique_prefix
from zero_core.offload.errors import OffloadError
from zero_core.offload.subgroups import SubGroup
from zero_core.offload.swap_file import SwapFile, aligned_empty, io_totals, waiting


class SwappedFlatBuffer(FlatBuffer):
    """A partition FlatBuffer whose ``data`` is the memory-mapped swap file of one state
    (checkpoints read and write through it; the store reseals before the next step)."""

    def __init__(self, layout: GroupLayout, rank: int, store: "NvmeStateStore", key):
        # no FlatBuffer.__init__: the values live in the file, not in a tensor
        self.layout, self.kind, self.rank = layout, "partition", rank
        self._store, self._key = store, key

    @property
    def data(self) -> torch.Tensor:
        return self._store.mapped(self._key)


class NvmeStateStore:
    """States *names* of every group of *layouts* in swap files under *directory*, cut
    into *subgroups*, streamed through *buffer_count* slots (see module docstring)."""

    #: its tensors are host memory by design (zero_core.testing.device_audit)
    TENSOR_HOME = "host"

    kind = "nvme"

    def __init__(self, layouts: list[GroupLayout | None], names: tuple[str, ...], rank: int,
                 subgroups: list[SubGroup], directory: str, buffer_count: int,
                 accelerator=None, pin: bool = False, direct: bool = True):
        if buffer_count < 2:
            raise ValueError(f"buffer_count={buffer_count}: the NVMe store needs >= 2 slots")
        self.names, self.rank, self.directory = names, rank, directory
        self.layouts = layouts
        self.files: dict[tuple[int, str], SwapFile] = {}
        prefix = unique_prefix("optimizer")
        try:
            for j, lay in enumerate(layouts):
                if lay is None:
                    continue
                bounds = [(sg.lo, sg.numel) for sg in subgroups if sg.group == j]
                for name in names:
                    path = os.path.join(directory, f"{prefix}group{j}.{name}.swap")
                    self.files[(j, name)] = SwapFile(path, torch.float32, lay.partition_numel,
                                                     bounds, direct)
        except BaseException:
            self.close()
            raise
        self.max_numel = max((sg.numel for sg in subgroups), default=1)
        self.slots = [{name: self._buffer(accelerator, pin) for name in names}
                      for _ in range(buffer_count)]
        self._grad = self._buffer(accelerator, pin)
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(buffer_count))
        self._reads: dict[tuple, tuple[int, Future]] = {}   # key -> (slot, future)
        self._writes: dict[tuple, Future] = {}
        self._held: dict[tuple, int] = {}
        self._order: list[tuple] = []
        self._position: dict[tuple, int] = {}
        self._last = -1
        self._error: BaseException | None = None
        self._closed = False
        self._mapped: set = set()
        self._waiting = False   # the training thread waits for a slot: no read-ahead now
        self.wait_s = 0.0       # the training thread's time blocked on the disk (reports)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="zero-core-swap-in")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="zero-core-swap-out")

    def _buffer(self, accelerator, pin: bool) -> torch.Tensor:
        t = aligned_empty(self.max_numel, torch.float32)
        if pin and accelerator is not None:
            t = accelerator.pin_memory(t)
        return t

    @staticmethod
    def key(sg: SubGroup) -> tuple[int, int]:
        return (sg.group, sg.index)

    # ---- initial values ---------------------------------------------------------------------
    def write_initial(self, sg: SubGroup, name: str, fill) -> None:
        """Write state *name* of *sg* synchronously: *fill(tensor)* fills a host buffer of
        ``sg.numel`` elements (used once, for the master weights; other states start as the
        files' zeros)."""
        buf = self.slots[0][name]
        fill(buf.narrow(0, 0, sg.numel))
        self.files[(sg.group, name)].write(sg.index, buf)

    # ---- the step pipeline ------------------------------------------------------------------
    def begin(self, order: list[SubGroup]) -> None:
        """A pass over *order* starts (the same order every step: read-ahead wraps around)."""
        self._check()
        self._reseal()
        keys = [self.key(sg) for sg in order]
        if keys != self._order:
            self._drop_reads()
            with self._lock:
                self._order = keys
                self._position = {k: i for i, k in enumerate(keys)}
                self._last = -1
        with self._lock:
            self._pump_locked()

    def acquire(self, sg: SubGroup) -> dict[str, torch.Tensor]:
        """The sub-group's states in host memory (waits for its read), by name."""
        self._check()
        self._reseal()
        key = self.key(sg)
        with self._lock:
            if key in self._held:
                raise RuntimeError(f"sub-group {key} acquired twice")
            self._last = self._position.get(key, self._last)
            entry = self._reads.pop(key, None)
            # reserved from here on: a pump (the writer thread's too) must not start a
            # second, soon stale, read of this sub-group
            self._held[key] = -1
        try:
            with waiting(self):
                if entry is None:
                    slot = self._take_slot()
                    entry = (slot, self._reader.submit(self._read, key, slot))
                slot, future = entry
                try:
                    future.result()
                except BaseException:
                    with self._lock:
                        self._free.append(slot)
                    raise
        except BaseException:
            with self._lock:
                self._held.pop(key, None)
            raise
        with self._lock:
            self._held[key] = slot
            self._pump_locked()
        return {name: self.slots[slot][name].narrow(0, 0, sg.numel) for name in self.names}

    def release(self, sg: SubGroup, write: bool = True) -> None:
        """Queue the sub-group's (updated) states for writing; its slot is reused after.
        *write* false: the states were only read (the file holds them): free the slot."""
        key = self.key(sg)
        with self._lock:
            slot = self._held.pop(key)
            if not write:
                self._free.append(slot)
                self._pump_locked()
                return
            self._writes[key] = self._writer.submit(self._write, key, slot)

    def finish(self) -> None:
        """End of a step: wait until every write is on disk (raises a worker's error)."""
        with waiting(self):
            while True:
                with self._lock:
                    pending = list(self._writes.values())
                if not pending:
                    break
                for f in pending:
                    try:
                        f.result()
                    except BaseException:
                        pass  # recorded in self._error by _write
        self._check()

    def grad_buffer(self, n: int) -> torch.Tensor:
        """The host fp32 scratch tensor for one sub-group's gradient (*n* elements)."""
        return self._grad.narrow(0, 0, n)

    # ---- worker-thread tasks ----------------------------------------------------------------
    def _read(self, key, slot: int) -> None:
        with self._lock:
            pending = self._writes.get(key)
        if pending is not None:
            pending.result()   # the newest values must be on disk before reading them
        group, index = key
        for name in self.names:
            self.files[(group, name)].read(index, self.slots[slot][name])

    def _write(self, key, slot: int) -> None:
        group, index = key
        try:
            for name in self.names:
                self.files[(group, name)].write(index, self.slots[slot][name])
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc
            raise
        finally:
            with self._lock:
                if self._writes.get(key) is not None and self._writes[key].running():
                    del self._writes[key]
                self._free.append(slot)
                self._pump_locked()

    # ---- slots --------------------------------------------------------------------------------
    def _pump_locked(self) -> None:
        """Start reads of the next sub-groups (cyclic order) into free slots. Lock held."""
        if (self._closed or not self._order or self._error is not None or self._mapped
                or self._waiting):
            return   # (a sub-group waiting for a slot gets the next free one)
        n = len(self._order)
        for step in range(1, n + 1):
            if not self._free:
                return
            key = self._order[(self._last + step) % n]
            if key in self._reads or key in self._held:
                continue
            slot = self._free.popleft()
            self._reads[key] = (slot, self._reader.submit(self._read, key, slot))

    def _take_slot(self) -> int:
        """A free slot for a read the pipeline did not foresee: wait for a write to end,
        or give up the read-ahead that is needed last."""
        with self._lock:
            self._waiting = True
        try:
            return self._wait_for_slot()
        finally:
            with self._lock:
                self._waiting = False

    def _wait_for_slot(self) -> int:
        while True:
            with self._lock:
                if self._free:
                    return self._free.popleft()
                writes = list(self._writes.values())
                victim = None
                if not writes and self._reads:
                    n = max(len(self._order), 1)
                    victim = max(self._reads, key=lambda k: (self._position.get(k, 0)
                                                             - self._last) % n)
                    slot, future = self._reads.pop(victim)
            if victim is not None:
                try:
                    future.result()
                except BaseException:
                    pass
                return slot
            if not writes:
                raise RuntimeError("offload: no swap slot free and nothing in flight "
                                   "(more sub-groups acquired at once than buffer_count)")
            try:
                writes[0].result()
            except BaseException:
                self._check()

    def _drop_reads(self) -> None:
        """Wait for every read-ahead and give its slot back (their data may be stale)."""
        with self._lock:
            reads = list(self._reads.values())
            self._reads.clear()
        for slot, future in reads:
            try:
                future.result()
            except BaseException:
                pass
            with self._lock:
                self._free.append(slot)

    def _check(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, OffloadError):
                raise OffloadError(str(err)) from err
            raise OffloadError(f"offload: a swap worker failed: {type(err).__name__}: "
                               f"{err}") from err

    # ---- writes outside the step (GatheredParameters modifying a stage-3 unit) ---------------
    def write_range(self, group: int, name: str, lo: int, values: torch.Tensor,
                    subgroups: list[SubGroup]) -> None:
        """Overwrite partition elements ``[lo, lo + n)`` of state *name* of *group* with
        *values* (read-modify-write of the sub-groups they touch, synchronously)."""
        self.finish()
        self._reseal()
        self._drop_reads()
        hi = lo + values.numel()
        slot = self._take_slot()
        try:
            buf = self.slots[slot][name]
            for sg in subgroups:
                if sg.group != group or sg.hi <= lo or sg.lo >= hi:
                    continue
                f = self.files[(group, name)]
                f.read(sg.index, buf)
                a, b = max(lo, sg.lo), min(hi, sg.hi)
                buf.narrow(0, a - sg.lo, b - a).copy_(values.narrow(0, a - lo, b - a))
                f.write(sg.index, buf)
        finally:
            with self._lock:
                self._free.append(slot)


    # ---- checkpoints --------------------------------------------------------------------------
    def flat(self, group: int, name: str) -> SwappedFlatBuffer:
        """The state *name* of *group* as a FlatBuffer backed by its swap file."""
        return SwappedFlatBuffer(self.layouts[group], self.rank, self, (group, name))

    def mapped(self, key) -> torch.Tensor:
        """The whole state *key* = (group, name) memory-mapped (nothing else in flight)."""
        if key not in self._mapped:
            self.finish()
            with self._lock:
                self._mapped.add(key)   # stops read-ahead until resealed
            self._drop_reads()
        return self.files[key].mapped()

    def _reseal(self) -> None:
        if not self._mapped:
            return
        for key in list(self._mapped):
            self.files[key].reseal()
        with self._lock:
            self._mapped.clear()

    # ---- reports ------------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Host memory this store holds: the slots and the gradient buffer, in bytes."""
        per = self.max_numel * 4
        return (len(self.slots) * len(self.names) + 1) * per

    @property
    def disk_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files.values())

    def report(self) -> dict:
        return {"device": "nvme", "directory": self.directory, "host_bytes": self.host_bytes,
                "disk_bytes": self.disk_bytes, "buffer_count": len(self.slots),
                "subgroup_numel": self.max_numel,
                "direct_io": all(f.direct for f in self.files.values()) if self.files else False,
                **io_totals(self.files.values()), "wait_s": self.wait_s}

    def close(self) -> None:
        """Finish the writes, stop the workers and close the files."""
        if getattr(self, "_closed", True) is False:
            self._closed = True
            try:
                self.finish()
            except OffloadError:
                pass
            self._drop_reads()
            self._reader.shutdown(wait=True)
            self._writer.shutdown(wait=True)
        for f in self.files.values():
            f.close()


class MasterWriteThrough:
    """Stands in for a stage-3 unit's ``master_part`` when the master is on NVMe: the
    gatherer's write-back (``u.master_part.copy_(values)``, GatheredParameters with a
    modifier) goes to the swap file instead of being lost."""

    def __init__(self, store: "NvmeStateStore", group: int, lo: int, numel: int,
                 subgroups: list[SubGroup]):
        self.store, self.group, self.lo, self.numel = store, group, lo, numel
        self.subgroups = subgroups

    def copy_(self, values: torch.Tensor):
        if values.numel() != self.numel:
            raise ValueError(f"master write of {values.numel()} elements into {self.numel}")
        self.store.write_range(self.group, "master", self.lo, values.float().reshape(-1),
                               self.subgroups)
        return self
