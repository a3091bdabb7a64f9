"""``offload_param`` for stage 3: parameter partitions in host memory or in swap files.

Stage 3 keeps, per rank, its partition of every fetch unit (stage3/units.py) in the
compute dtype and all-gathers a unit around each use. With parameter offload:

* ``device: cpu`` — the partitions live in host memory (pinned where the accelerator
  pins). On the CPU accelerator that is where they are anyway; on a device, every gather
  first copies the unit's partition to the device (:meth:`ParamOffload.fetch`).
* ``device: nvme`` — the partitions live in one swap file per parameter group (one region
  per unit, CRC-checked; swap_file.py). Units are read on demand into ``buffer_count``
  staging buffers of ``buffer_size`` elements, and *read ahead* along the execution order
  stage 3 recorded (stage3/prefetch.py), on a worker thread, so that the disk works while
  the previous modules compute. Up to ``max_in_cpu`` partition elements (the first units)
  are also kept in host memory and never read from disk. After the optimizer step, each
  unit's new values are written (write-behind) and read-aheads are dropped (stale).

:class:`ParamOffload` is the parameter store of
:class:`~zero_core.interfaces.engine_parts.ParamStoreProtocol`. The gatherer
(stage3/gather.py) calls ``fetch(u)`` for the partition to all-gather from, ``fetched(u)``
when that collective finished (the staging buffer is free again), and ``write_unit(u,
values)`` when GatheredParameters modified the unit. The stage-3 group buffers
(``OffloadedStage3GroupBuffers``, stage3/buffers.py) get each group's storage from
``place_group`` and store the first values with ``write_initial``. The optimizer calls
``write_piece`` with updated values and ``flush`` at the end of the step: the offloaded
optimizer (``offload_optimizer`` too: master and states on the host or NVMe) from host
memory, or, with ``offload_param`` alone, :class:`DeviceStepOptimizer` from the device —
the master weights and optimizer states stay where they would be without offload (the
device), are stepped by the engine's own kernels, and each unit's new values are copied
into the store after its update, as DeepSpeed's stage 3 copies each sub-group's fp32
partition into its offloaded low-precision one (or swaps it out). Either way training is
bit-identical to stage 3 without offload. Parameter offload is not combined with ZeRO++
(which gathers from ``u.part`` itself).

Which way the imports go: this module imports nothing of ``zero_core.stage3``; stage 3's
parts (stage3/parts.py) import it, build the store from the engine's ``BuildContext`` and
hand it to the group buffers, the gatherer and (through ``StageParts.param_store``) the
optimizer. offload/ is storage that every stage uses (the engine builds
offload/optimizer.py's optimizer the same way) and stage 3 decides when to
fetch, so the arrow points from the user to the storage; a fetch unit is used here only
through the members ParamSourceProtocol lists (``index``, ``part``, ``released``,
``wait_collective()``) and a group through UnitBuffersProtocol (``units``, ``layout``).

Checkpoints read and write ``param_buf`` as a memory map of the file (nvme), like the
optimizer states; the CRCs and host copies are refreshed before the next fetch.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zero_core.errors import ConfigError
from zero_core.interfaces.engine_parts import ParamStoreProtocol
from zero_core.partitioning.flat_buffer import FlatBuffer
from zero_core.optim.partitioned import PartitionedOptimizer
from zero_core.offload.cleanup import rank_directory, unique_prefix
from zero_core.offload.errors import io_failure
from zero_core.offload.swap_file import SwapFile, aligned_empty, io_totals, waiting

KEY = "zero_optimization.offload_param"


class _MappedParams(FlatBuffer):
    """A group's parameter partitions as a FlatBuffer backed by its swap file."""

    def __init__(self, layout, rank, store: "ParamOffload", group_id: int):
        self.layout, self.kind, self.rank = layout, "partition", rank
        self._store, self._group = store, group_id

    @property
    def data(self) -> torch.Tensor:
        return self._store.mapped(self._group)


#: the ledger's name for the partitions' host->device copies (CommLedger.record_copy)
TRANSFER = "offload_param"


class ParamOffload(ParamStoreProtocol):
    """Where stage 3's parameter partitions live when ``offload_param`` is on."""

    #: the attributes that hold host memory (zero_core.testing.device_audit); the others refer to
    #: the device-side fetch units
    HOST_ATTRS = ("partitions", "_cache", "_buffers", "_assembling")

    def __init__(self, cfg, compute_dtype: torch.dtype, device: torch.device, rank: int,
                 world_size: int, accelerator, ledger=None):
        self.cfg, self.dtype, self.device = cfg, compute_dtype, device
        self.rank, self.world_size, self.accelerator = rank, world_size, accelerator
        self.ledger = ledger   # counts the partitions fetched to the device (CommLedger)
        self.nvme = cfg.device == "nvme"
        self.directory = rank_directory(cfg.nvme_path, rank, f"{KEY}.nvme_path") if self.nvme else None
        self.files: list[SwapFile] = []
        self._prefix = unique_prefix("params")
        self._group_of: dict[int, tuple[int, int]] = {}   # id(unit) -> (file, region)
        self._cache: dict[int, torch.Tensor] = {}         # id(unit) -> host copy (max_in_cpu)
        self._cached_numel = 0
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._buffers: list[torch.Tensor] = []
        self._ready: OrderedDict = OrderedDict()          # unit index -> (buffer, future)
        self._inflight: OrderedDict = OrderedDict()       # unit index -> (unit, buffer)
        self._writes: dict[int, Future] = {}              # id(unit) -> future
        self._assembling: dict[int, torch.Tensor] = {}    # id(unit) -> staging buffer
        self._mapped: set[int] = set()
        self._stepping = False
        self.coordinator = None
        self.units_by_index: dict = {}
        self.partitions: list[torch.Tensor] = []          # host partition buffers (cpu)
        self.reads = self.read_ahead_hits = 0
        self.wait_s = 0.0   # the training thread's time blocked on the disk (reports)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="zero-core-param-swap") if self.nvme else None

    # ---- construction ---------------------------------------------------------------------
    def place_group(self, lay, units) -> tuple[FlatBuffer, list[torch.Tensor]]:
        """Create the storage of one group's partitions (*lay*: the group's unit layout,
        bucket k = ``units[k]``); returns its ``param_buf`` and each unit's ``part`` (a
        view of host memory, or an empty placeholder with the dtype and device when the
        values are in a file)."""
        for u in units:
            self.units_by_index[u.index] = u
        if not self.nvme:
            param_buf = FlatBuffer(lay, "partition", self.dtype, torch.device("cpu"), self.rank)
            if self.cfg.pin_memory:
                param_buf.data = self.accelerator.pin_memory(param_buf.data)
            self.partitions.append(param_buf.data)
            return param_buf, [param_buf.bucket(k) for k in range(len(units))]
        gid = len(self.files)
        bounds = [(lay.partition_start(k), lay.shard_size(k)) for k in range(lay.num_buckets)]
        path = f"{self.directory}/{self._prefix}group{gid}.swap"
        self.files.append(SwapFile(path, self.dtype, lay.partition_numel, bounds, direct=False))
        biggest = max(n for _, n in bounds)
        if biggest > self.cfg.buffer_size:
            raise ConfigError(
                f"config key '{KEY}.buffer_size' = {self.cfg.buffer_size}: a fetch unit's "
                f"partition has {biggest} elements and must fit in one staging buffer; raise "
                f"buffer_size to at least {biggest} (or lower stage3_prefetch_bucket_size / "
                f"reduce_bucket_size so that units are smaller)")
        while len(self._buffers) < self.cfg.buffer_count:
            t = aligned_empty(self.cfg.buffer_size, self.dtype)
            if self.cfg.pin_memory:
                t = self.accelerator.pin_memory(t)
            self._buffers.append(t)
            self._free.append(t)
        placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        for k, u in enumerate(units):
            self._group_of[id(u)] = (gid, k)
            if self._cached_numel + bounds[k][1] <= self.cfg.max_in_cpu:
                self._cache[id(u)] = torch.zeros(bounds[k][1], dtype=self.dtype)
                self._cached_numel += bounds[k][1]
        # the parts: dtype/device only, the values are in the file
        return _MappedParams(lay, self.rank, self, gid), [placeholder] * len(units)

    def write_initial(self, u, values: torch.Tensor) -> None:
        """Store unit *u*'s first partition values (any float dtype), synchronously."""
        if not self.nvme:
            u.part.copy_(values)
            return
        self._write_now(u, values)

    def read_partition(self, gb, k: int) -> torch.Tensor:
        """A host copy of unit *k*'s partition of group *gb* (read from its file, without
        mapping the whole file into this process)."""
        u = gb.units[k]
        if not self.nvme:
            return u.part.to("cpu", copy=True)
        cached = self._cache.get(id(u))
        if cached is not None:
            return cached.clone()
        self._reseal()
        buf = self._take_buffer()
        try:
            gid, region = self._group_of[id(u)]
            return self.files[gid].read(region, buf).clone()
        finally:
            self._free.append(buf)

    def attach(self, coordinator) -> None:
        """Read ahead along *coordinator*'s recorded execution order."""
        self.coordinator = coordinator

    # ---- the gather path ------------------------------------------------------------------
    def fetch(self, u) -> torch.Tensor:
        """Unit *u*'s partition on the device, to all-gather from; ``fetched(u)`` must
        follow once the collective is complete."""
        if not self.nvme:
            if u.part.device == self.device:
                return u.part
            return self._to_device(u.part, non_blocking=self.cfg.pin_memory)
        self._reseal()
        if self._stepping:
            self.flush()
        cached = self._cache.get(id(u))
        if cached is not None:
            return self._to_device(cached)
        entry = self._ready.pop(u.index, None)
        if entry is None:
            buf = self._take_buffer()
            entry = (buf, self._io.submit(self._read, u, buf))
        else:
            self.read_ahead_hits += 1
        buf, future = entry
        try:
            with waiting(self):
                part = future.result()
        except BaseException:
            self._free.append(buf)
            raise
        self._inflight[u.index] = (u, buf)
        self._read_ahead(u)
        return part if self.device.type == "cpu" else self._to_device(part)

    def _to_device(self, part: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        moved = part.to(self.device, non_blocking=non_blocking)
        if self.ledger is not None:
            self.ledger.record_copy(TRANSFER, moved, part)
        return moved

    def fetched(self, u) -> None:
        """The gather of *u* completed: its staging buffer is free again."""
        entry = self._inflight.pop(u.index, None)
        if entry is not None:
            self._free.append(entry[1])

    def write_unit(self, u, values: torch.Tensor) -> None:
        """GatheredParameters modified *u*: store this rank's new partition values."""
        if not self.nvme:
            u.part.copy_(values)
            return
        self._drop_ready()
        self._write_now(u, values)

    def _read(self, u, buf: torch.Tensor) -> torch.Tensor:
        pending = self._writes.get(id(u))
        if pending is not None:
            pending.result()
        gid, k = self._group_of[id(u)]
        self.reads += 1
        return self.files[gid].read(k, buf)

    def _read_ahead(self, current) -> None:
        """Fill free staging buffers with the next units of the recorded order."""
        coord = self.coordinator
        if coord is None or not self._free or self._mapped:
            return
        for idx in coord.trace.upcoming():
            if not self._free:
                break
            u = self.units_by_index.get(idx)
            if (u is None or idx in self._ready or idx in self._inflight or u is current
                    or id(u) in self._cache or id(u) not in self._group_of
                    or not u.released):
                continue
            buf = self._free.pop()
            self._ready[idx] = (buf, self._io.submit(self._read, u, buf))

    def _take_buffer(self) -> torch.Tensor:
        """A free staging buffer: drop the read-ahead needed last, or complete the oldest
        gather still holding one."""
        if self._free:
            return self._free.pop()
        with waiting(self):
            return self._wait_for_buffer()

    def _wait_for_buffer(self) -> torch.Tensor:
        while not self._free:
            if self._ready:
                _, (buf, future) = self._ready.popitem(last=True)
                try:
                    future.result()
                except BaseException:
                    pass
                self._free.append(buf)
            elif self._writes:
                try:   # the write task frees its buffer before the future completes
                    next(iter(self._writes.values())).result()
                except BaseException:
                    pass
                self._writes = {key: f for key, f in self._writes.items() if not f.done()}
            elif self._inflight:
                idx = next(iter(self._inflight))
                u = self._inflight[idx][0]
                u.wait_collective()   # the gatherer then sees the collective as done
                self.fetched(u)
            else:
                raise RuntimeError("offload_param: every staging buffer is busy and nothing "
                                   "can be completed; raise offload_param.buffer_count")
        return self._free.pop()

    def _drop_ready(self) -> None:
        while self._ready:
            _, (buf, future) = self._ready.popitem()
            try:
                future.result()
            except BaseException:
                pass
            self._free.append(buf)

    # ---- the optimizer's write path -------------------------------------------------------
    def write_piece(self, gb, k: int, offset: int, values: torch.Tensor) -> None:
        """Updated fp32 values for elements ``[offset, offset + n)`` of unit *k*'s
        partition in group *gb* (stored in the compute dtype, rounding as a copy does)."""
        u = gb.units[k]
        if not self.nvme:
            dst = u.part.narrow(0, offset, values.numel())
            dst.copy_(values)
            self._count_down(dst, values)
            return
        if not self._stepping:
            self._stepping = True
            self._drop_ready()   # the step makes every read-ahead stale
        buf = self._assembling.get(id(u))
        if buf is None:
            buf = self._assembling[id(u)] = self._take_buffer()
        dst = buf.narrow(0, offset, values.numel())
        dst.copy_(values)
        self._count_down(dst, values)
        size = gb.layout.shard_size(k)
        if offset + values.numel() == size:
            del self._assembling[id(u)]
            part = buf.narrow(0, 0, size)
            cached = self._cache.get(id(u))
            if cached is not None:
                cached.copy_(part)
            self._writes[id(u)] = self._io.submit(self._write_task, u, buf)

    def _count_down(self, dst: torch.Tensor, values: torch.Tensor) -> None:
        """Count a device->host write-back (the optimizer on the device) in the ledger."""
        if self.ledger is not None:
            self.ledger.record_copy(TRANSFER, dst, values)

    def _write_task(self, u, buf) -> None:
        gid, k = self._group_of[id(u)]
        try:
            self.files[gid].write(k, buf)
        finally:
            with self._lock:
                self._free.append(buf)

    def _write_now(self, u, values: torch.Tensor) -> None:
        buf = self._take_buffer()
        try:
            n = values.numel()
            buf.narrow(0, 0, n).copy_(values.reshape(-1))
            gid, k = self._group_of[id(u)]
            self.files[gid].write(k, buf)
            cached = self._cache.get(id(u))
            if cached is not None:
                cached.copy_(buf.narrow(0, 0, n))
        finally:
            self._free.append(buf)

    def flush(self) -> None:
        """End of the optimizer step: every unit's new values are on disk."""
        writes, self._writes = list(self._writes.values()), {}
        self._stepping = False
        with waiting(self):
            for f in writes:
                f.result()

    # ---- checkpoints -----------------------------------------------------------------------
    def mapped(self, gid: int) -> torch.Tensor:
        if gid not in self._mapped:
            self.flush()
            self._drop_ready()
            self._mapped.add(gid)
        return self.files[gid].mapped()

    def _reseal(self) -> None:
        if not self._mapped:
            return
        for gid in self._mapped:
            self.files[gid].reseal()
        self._mapped.clear()
        for key, cached in self._cache.items():   # the map may have been written
            gid, k = self._group_of[key]
            buf = self._take_buffer()
            cached.copy_(self.files[gid].read(k, buf))
            self._free.append(buf)

    # ---- reports ---------------------------------------------------------------------------
    def report(self) -> dict:
        rep = {"device": self.cfg.device}
        if self.nvme:
            elem = torch.empty((), dtype=self.dtype).element_size()
            rep.update(
                directory=self.directory,
                staging_bytes=len(self._buffers) * self.cfg.buffer_size * elem,
                cached_bytes=self._cached_numel * elem,
                disk_bytes=sum(f.data_bytes for f in self.files),
                **io_totals(self.files), wait_s=self.wait_s,
                reads=self.reads, read_ahead_hits=self.read_ahead_hits)
        return rep

    def close(self) -> None:
        if self._io is not None:
            self.flush()
            self._drop_ready()
            self._io.shutdown(wait=True)
        for f in self.files:
            f.close()


class _DeviceStepView:
    """A store-backed group as :class:`DeviceStepOptimizer` steps it: the group itself,
    except that its stepped values (``param_buf`` for the optimizer: where states, scratch
    and fp32 gradient copies go) are the device master, and ``mixed`` says whether the
    gradients need an fp32 copy (they are not fp32)."""

    def __init__(self, gb):
        self.group = gb
        self.param_buf = gb.master
        self.mixed = gb.grad_dtype != torch.float32

    def __getattr__(self, name):
        return getattr(self.group, name)


class DeviceStepOptimizer(PartitionedOptimizer):
    """``offload_param`` without ``offload_optimizer`` (DeepSpeed accepts it; HF accelerate
    and axolotl ship such configs): the parameter partitions (compute dtype) live in the
    store, the master weights and optimizer states stay on the device, where the engine's
    own kernels step them exactly as without offload; after each bucket (fetch unit) is
    updated, its new values are written into the store, rounded to the compute dtype by a
    copy as the kernels' ``param_lowp`` rounds them (DeepSpeed's stage 3 copies each
    sub-group's fp32 partition into its offloaded fp16/bf16 partition or swaps it out after
    the sub-group's step). So training is bit-identical to stage 3 without offload.

    Built by the engine instead of :class:`PartitionedOptimizer` when the stage has a
    parameter store; groups without one (stages 0-2, frozen units) are stepped as usual."""

    def __init__(self, hyper_groups, rule, buffers, *args, **kwargs):
        views = [_DeviceStepView(gb) if getattr(gb, "master_on_device", False) else gb
                 for gb in buffers]
        stores = {id(v.store): v.store for v in views if isinstance(v, _DeviceStepView)}
        self.param_stores = list(stores.values())
        super().__init__(hyper_groups, rule, views, *args, **kwargs)

    def step(self, closure=None):
        super().step(closure)
        for store in self.param_stores:
            store.flush()

    def _lowp_target(self, gb, k, send):
        if isinstance(gb, _DeviceStepView):
            return None   # the store's copy is written in _finish_bucket
        return super()._lowp_target(gb, k, send)

    def _finish_bucket(self, gb, k, send, inflight):
        if isinstance(gb, _DeviceStepView):
            gb.store.write_piece(gb.group, k, 0, gb.master.bucket(k))
            return
        super()._finish_bucket(gb, k, send, inflight)

    def _step_torch(self):
        super()._step_torch()
        for gb in self.buffers:
            if isinstance(gb, _DeviceStepView):
                for k in range(gb.num_buckets):
                    gb.store.write_piece(gb.group, k, 0, gb.master.bucket(k))

    def offload_report(self) -> dict:
        """``memory_report()["offload"]``: the optimizer on the device, the parameters'
        store report."""
        return {"device": "none",
                "params": self.param_stores[0].report() if self.param_stores else None}


class FileBackedPartitions:
    """``zero_core.Init(remote_device="nvme")``: each partition Init keeps while the model is
    built is a host tensor mapped from its own file in this rank's swap directory (under
    ``offload_param.nvme_path``). The file is preallocated (a full disk is an OffloadError
    naming it here, not a SIGBUS at the first write into a sparse mapping) and unlinked at
    once: the kernel writes the pages to the disk and drops them under memory pressure, so
    the partitions of a model larger than host memory fit, and the space returns when the
    engine, having copied them into its own swap files, drops the tensor."""

    def __init__(self, nvme_path: str, rank: int):
        self.directory = rank_directory(nvme_path, rank, f"{KEY}.nvme_path")
        self._prefix = unique_prefix("init")
        self._count = 0

    def __call__(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        path = f"{self.directory}/{self._prefix}{self._count}.part"
        self._count += 1
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
            part = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        except OSError as exc:
            raise io_failure(path, "allocating a parameter partition in", exc, nbytes) from None
        finally:
            if os.path.exists(path):
                os.unlink(path)
        return part


def device_step_class(cls: type) -> type:
    """The optimizer class the engine builds over a stage with a parameter store and no
    ``offload_optimizer`` (*cls*: the one it would build otherwise)."""
    return DeviceStepOptimizer if cls is PartitionedOptimizer else cls


def build_param_offload(ctx) -> ParamOffload | None:
    """Stage 3's parameter offload store (*ctx*: the engine's ``BuildContext``), or None
    when ``offload_param`` is off."""
    zc = ctx.config.zero_optimization
    cfg = zc.offload_param
    if not cfg.enabled:
        return None
    if zc.zeropp_enabled:
        raise ConfigError(f"config key '{KEY}.device' = {cfg.device!r} cannot be combined "
                          f"with ZeRO++ (zero_quantized_weights / zero_hpz_partition_size / "
                          f"zero_quantized_gradients) yet; switch one of them off")
    return ParamOffload(cfg, ctx.compute_dtype, ctx.device, ctx.rank, ctx.world_size,
                        ctx.accelerator, ctx.comm.ledger)
