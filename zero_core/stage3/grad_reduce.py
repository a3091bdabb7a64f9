"""Stage-3 gradient reduction: reduce-scatter each fetch unit's gradient straight into
this rank's partition accumulator, as backward produces it.

Every trainable parameter has a ``post_accumulate_grad`` hook. Its gradient (full shape,
compute dtype) is copied into the unit's slot of a pooled flat buffer and ``.grad`` is
dropped at once, so a full gradient lives only until its unit is complete. When every
parameter of the unit has delivered, the unit is reduce-scattered (asynchronously) into
``unit.grad_part`` — directly on the first reduction after a step, through a pooled
buffer and an add when accumulating micro-steps — and the coordinator may release the
unit's gathered parameters.

A parameter can deliver twice in one backward (activation checkpointing runs an inner
backward for the recompute; a tied weight used inside and outside the checkpoint
delivers in both): a second delivery after its unit was launched starts a new round of
that unit, which is launched at the end of backward and adds to the accumulator. Units
still incomplete at the end of backward (unused parameters) are launched with zeros in
the missing places, in unit order.

The collective itself is ``reduce_unit(u, output, input) -> handle`` (default: an async
``reduce_scatter`` sum over the world); ZeRO++'s qgZ (zero_core/zeropp/qgz.py) replaces it.

Dtypes (DeepSpeed's ``communication_data_type`` and ``data_types.grad_accum_dtype``): the
pooled unit buffer the hooks copy into is in the communication dtype, so that copy is the
conversion and the collective carries that dtype; the result lands in ``unit.grad_part``'s
dtype (the accumulator, fp32 when ``grad_accum_dtype`` says so) — directly when the two
agree, otherwise through a pooled output buffer and one copy or add. qgZ quantizes to int4
whatever it is given, so a communication dtype other than the compute dtype is refused with
it. A parameter delivering twice in one backward is added in the communication dtype. Under
``torch_autocast`` each parameter's gradient travels in the dtype engine/autocast.py marked it
with; a unit mixing dtypes is reduce-scattered as one collective per dtype.

Launch order is the order units complete, which is the same on every rank (same graph,
same deterministic autograd schedule).

Hook: ``on_reduced`` (None: nothing is called, nothing is spent), when set, is called with
``unit.grad_part`` once the unit's reduction of this round has landed there (at once on one
rank or without ``overlap_comm``, else when its collective is retired). SuperOffload
(offload/speculative.py) starts the host steps of complete sub-groups from it.
"""
from __future__ import annotations

from collections import deque

import torch

from zero_core.config.precision import comm_dtype_for, dtype_name
from zero_core.engine.autocast import DtypePools, mixed_reduction, reducer_dtype
from zero_core.errors import ConfigError
from zero_core.partitioning.buffer_pool import BufferPool
from zero_core.interfaces.communicator import Communicator
from zero_core.interfaces.engine_parts import GradReducerProtocol
from zero_core.stage3 import partitioned_params as pp
from zero_core.stage3.coordinator import ParamCoordinator
from zero_core.stage3.units import FetchUnit


class Stage3GradReducer(GradReducerProtocol):
    """The engine's gradient reducer at stage 3 (GradReducerProtocol: register_hooks,
    flush, wait_all, mark_fresh, remove_hooks, communication_buffers), over fetch units.
    *comm_dtype*: the dtype the collective carries gradients in (None: the compute dtype)."""

    def __init__(self, units: list[FetchUnit], comm: Communicator, coordinator: ParamCoordinator,
                 overlap: bool, device: torch.device, on_allocate=None, max_inflight: int = 4,
                 reduce_unit=None, comm_dtype: torch.dtype | None = None):
        self.units = [u for u in units if u.trainable]
        self.comm, self.coord, self.overlap = comm, coordinator, overlap
        self._reduce = reduce_unit or self._reduce_scatter
        self.max_inflight = max_inflight
        self._slot = {}
        for u in self.units:
            for i, p in enumerate(u.params):
                self._slot[id(p)] = (u, i)
        biggest = max((u.padded_numel for u in self.units), default=1)
        dtype = self.units[0].part.dtype if self.units else torch.float32
        params = [p for u in self.units for p in u.params]
        self.comm_dtype = comm_dtype_for(comm, reducer_dtype(params, comm_dtype or dtype, dtype),
                                         "reduce_scatter")
        if reduce_unit is not None and self.comm_dtype != dtype:
            raise ConfigError(
                f"communication_data_type {dtype_name(self.comm_dtype)} differs from the "
                f"compute dtype {dtype_name(dtype)}, but zero_optimization.zero_quantized_gradients (ZeRO++ "
                f"qgZ) sends gradients as int4, not in any float dtype; remove "
                f"communication_data_type or set zero_quantized_gradients to false")
        # where gradients are produced: the compute device, also when the partitions are
        # offloaded to host memory (offload_param)
        self._grad_pool = BufferPool(biggest, self.comm_dtype, device, on_allocate)
        self._out_pool = BufferPool(max(biggest // comm.world_size, 1), self.comm_dtype, device,
                                    on_allocate)
        # torch_autocast (engine/autocast.py): units whose parameters are reduced in other
        # dtypes than comm_dtype, one collective per dtype
        self._mixed = {}
        for u in self.units:
            plan = mixed_reduction(comm, [(u.offsets[i], pp.meta_of(p).numel, p)
                                          for i, p in enumerate(u.params)],
                                   u.padded_numel, self.comm_dtype, comm.rank)
            if plan is not None:
                if reduce_unit is not None:
                    raise ConfigError(
                        "torch_autocast reduces lower_precision_safe_modules' gradients in "
                        "the autocast dtype, but zero_optimization.zero_quantized_gradients "
                        "(ZeRO++ qgZ) sends gradients as int4; turn one of them off")
                self._mixed[u.index] = plan
        self._pools = DtypePools(biggest, device, on_allocate, self._finish_oldest)
        self._fresh = {u.index: True for u in self.units}
        self._bufs: dict[int, torch.Tensor] = {}
        self._delivered: dict[int, set] = {}
        self._inflight: deque = deque()
        self._hooks = []
        self.launches = 0
        #: called with a unit's ``grad_part`` once its reduction landed (docstring)
        self.on_reduced = None

    # ---- hooks -----------------------------------------------------------------------------
    def register_hooks(self) -> None:
        for u in self.units:
            for p in u.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _on_grad(self, p) -> None:
        u, slot = self._slot[id(p)]
        buf = self._bufs.get(u.index)
        if buf is None:
            buf = self._bufs[u.index] = self._grad_pool.take(u.padded_numel, self._finish_oldest)
            self._delivered[u.index] = set()
        delivered = self._delivered[u.index]
        n = pp.meta_of(p).numel
        dst = buf.narrow(0, u.offsets[slot], n)
        grad = p.grad.data.reshape(-1)
        if slot in delivered:
            dst.add_(grad)
        else:
            dst.copy_(grad)
            delivered.add(slot)
        p.grad = None
        if len(delivered) == len(u.params):
            self._launch(u)
            self.coord.grads_done(u)

    # ---- launching -------------------------------------------------------------------------
    def _launch(self, u: FetchUnit) -> None:
        buf = self._bufs.pop(u.index)
        delivered = self._delivered.pop(u.index)
        if len(delivered) < len(u.params):
            for slot, p in enumerate(u.params):
                if slot not in delivered:
                    buf.narrow(0, u.offsets[slot], pp.meta_of(p).numel).zero_()
        if u.padded_numel > u.numel:
            buf.narrow(0, u.numel, u.padded_numel - u.numel).zero_()  # padding reduces to 0
        self.launches += 1
        fresh = self._fresh[u.index]
        self._fresh[u.index] = False
        acc = u.grad_part
        plan = self._mixed.get(u.index)
        if plan is not None:
            handle, finish = plan.launch(self.comm, buf, acc, not fresh, self._pools.take,
                                         self._pools.release)

            def done(buf=buf):
                finish()
                self._grad_pool.release(buf)
        elif self.comm.world_size == 1:
            acc.copy_(buf) if fresh else acc.add_(buf)
            self._grad_pool.release(buf)
            self._landed(u)
            return
        elif fresh and acc.dtype == buf.dtype:
            handle = self._reduce(u, acc, buf)

            def done(buf=buf):
                self._grad_pool.release(buf)
        else:
            out = self._out_pool.take(acc.numel(), self._finish_oldest)
            handle = self._reduce(u, out, buf)

            def done(buf=buf, out=out, acc=acc, fresh=fresh):
                # into the accumulator's dtype: overwrite after a step, else add
                acc.copy_(out) if fresh else acc.add_(out)
                self._out_pool.release(out)
                self._grad_pool.release(buf)
        if not self.overlap:
            handle.wait()
            done()
            self._landed(u)
            return
        self._inflight.append((handle, done, u))
        while len(self._inflight) > self.max_inflight:
            self._finish_oldest()

    def _reduce_scatter(self, u: FetchUnit, output: torch.Tensor, input: torch.Tensor):
        return self.comm.reduce_scatter(output, input, "sum", async_op=True)

    def _finish_oldest(self) -> bool:
        if not self._inflight:
            return False
        handle, done, u = self._inflight.popleft()
        handle.wait()
        done()
        self._landed(u)
        return True

    def _landed(self, u: FetchUnit) -> None:
        if self.on_reduced is not None:
            self.on_reduced(u.grad_part)

    # ---- end of backward / step ------------------------------------------------------------
    def flush(self) -> None:
        """End of a backward: launch every unit still holding gradients (unit order), then
        release what the coordinator no longer needs."""
        for idx in sorted(self._bufs):
            self._launch(self.units_by_index(idx))
        self.coord.end_backward()

    def units_by_index(self, idx: int) -> FetchUnit:
        return self.coord.units[idx]

    def wait_all(self) -> None:
        while self._finish_oldest():
            pass

    def mark_fresh(self) -> None:
        for k in self._fresh:
            self._fresh[k] = True

    @property
    def communication_buffers(self) -> int:
        return self._grad_pool.allocated + self._out_pool.allocated + self._pools.allocated
