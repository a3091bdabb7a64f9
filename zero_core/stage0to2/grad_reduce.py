"""Gradient reduction driven by backward hooks, one bucket at a time.

Every trainable parameter gets a ``post_accumulate_grad`` hook. When all parameters of a
bucket have their gradient for this backward, the bucket is reduced — asynchronously when
``overlap_comm`` — while backward goes on producing the next buckets:

- stage 0: all_reduce of the bucket's gradient, in place (every rank keeps everything);
- stage 1: reduce_scatter of the bucket into this rank's slice, only in the backward of
  the gradient-accumulation boundary (before that, gradients accumulate locally);
- stage 2: every backward copies each gradient into a bucket buffer taken from a small
  pool, frees ``.grad``, and reduce_scatters the bucket into the partition accumulator;
  the full gradient never persists.

Dtypes (DeepSpeed's ``communication_data_type`` and ``data_types.grad_accum_dtype``):
every collective carries the gradient in the communication dtype (default: the compute
dtype). Where the gradient is in another dtype, it is converted on its way into a pooled
bucket buffer — at stage 2 by the copy the hook makes anyway, at stages 0/1 by one copy of
the bucket before the collective — so the extra memory is bounded by the pool, not by the
model. Under ``torch_autocast`` (stages 1-2) each parameter's gradient travels in the dtype
engine/autocast.py marked it with (the pools then hold the compute dtype); a bucket mixing
dtypes is reduce-scattered as one collective per dtype (``MixedReduction``). The reduced
result lands in the accumulator's dtype (``grad_dtype`` of the buffers): directly when the
dtypes agree, otherwise through a pooled output buffer and one copy (or add). At stage 1
with an fp32 accumulator under bf16/fp16 (the buffers' ``grad_views`` false) each
micro-step's ``.grad`` is added into the fp32 accumulator and dropped.

Collectives must be issued in the same order on every rank, whatever order backward
delivers gradients in on each rank: buckets are launched strictly in one fixed order
(latest-registered parameters first, the order backward usually produces them); a bucket
that is ready early waits for its predecessors.

Gradients arrive pre-multiplied by 1/world_size (the engine folds it into the loss
scale), so a sum-reduction yields the average without another pass over the data.

Hook: ``on_reduced`` (None: nothing is called, nothing is spent), when set, is called with
``reduced_grad_bucket(k)`` of a bucket's group buffers once that bucket's reduction of this
backward has landed there (its collective retired). SuperOffload
(offload/speculative.py) starts the host steps of complete sub-groups from it.

What the engine calls is :class:`~zero_core.interfaces.engine_parts.GradReducerProtocol`;
what this reducer needs of each group's buffers is
:class:`~zero_core.interfaces.engine_parts.BucketBuffersProtocol`.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from zero_core.config.precision import comm_dtype_for
from zero_core.engine.autocast import DtypePools, mixed_reduction, reducer_dtype
from zero_core.partitioning.buffer_pool import BufferPool
from zero_core.interfaces.communicator import Communicator
from zero_core.interfaces.engine_parts import BucketBuffersProtocol, GradReducerProtocol


class GradReducer(GradReducerProtocol):
    """Reduces gradients of *groups* bucket by bucket, as backward produces them.

    *should_reduce()* says whether the backward now starting must reduce (stages 0/1:
    only at the gradient-accumulation boundary; stage 2: always). *registration_index*
    maps id(param) to its position in the model, to order the buckets. *comm_dtype*: the
    dtype collectives carry gradients in (None: the compute dtype).
    """

    def __init__(self, groups: list[BucketBuffersProtocol], comm: Communicator, stage: int,
                 overlap: bool, registration_index: dict[int, int],
                 should_reduce: Callable[[], bool], on_allocate=None, max_inflight: int = 4,
                 comm_dtype: torch.dtype | None = None):
        self.groups, self.comm, self.stage, self.overlap = groups, comm, stage, overlap
        self.should_reduce = should_reduce
        self.max_inflight = max_inflight
        # one fixed launch order over (group, bucket), identical on every rank
        keys = []
        for g, gb in enumerate(groups):
            for k in range(gb.num_buckets):
                latest = max(registration_index[id(gb.params[s.param])]
                             for s in gb.layout.segments_of_bucket(k))
                keys.append((-latest, g, k))
        self.order = [(g, k) for _, g, k in sorted(keys)]
        self._pos = {gk: i for i, gk in enumerate(self.order)}
        self._segments = {gk: gk_segs for gk, gk_segs in
                          (((g, k), groups[g].layout.segments_of_bucket(k)) for g, k in self.order)}
        self._param_info = {}
        for g, gb in enumerate(groups):
            for i, p in enumerate(gb.params):
                self._param_info[id(p)] = (g, i, gb.layout.segments_of_param(i))
        max_bucket = max((max(gb.layout.bucket_sizes) for gb in groups if gb.num_buckets),
                         default=0)
        dtype = groups[0].param_buf.dtype if groups else torch.float32
        device = groups[0].param_buf.data.device if groups else torch.device("cpu")
        params = [p for gb in groups for p in gb.params]
        self.comm_dtype = comm_dtype_for(comm, reducer_dtype(params, comm_dtype or dtype, dtype),
                                         "all_reduce" if stage == 0 else "reduce_scatter")
        ws = comm.world_size
        # collectives' outputs, and the buckets they read when the gradient is in another
        # dtype than the communication dtype (stage 2: always, it is where hooks copy into)
        self._out_pool = BufferPool(max(max_bucket // ws, 1), self.comm_dtype, device,
                                    on_allocate)
        self._grad_pool = BufferPool(max(max_bucket, 1), self.comm_dtype, device, on_allocate)
        # torch_autocast (engine/autocast.py): buckets whose parameters are reduced in other
        # dtypes than comm_dtype, one collective per dtype
        self._mixed = self._mixed_buckets(comm)
        self._pools = DtypePools(max_bucket, device, on_allocate, self._finish_oldest)
        self._inflight: deque = deque()
        #: called with a bucket's reduced gradient once its reduction landed (docstring)
        self.on_reduced: Callable[[torch.Tensor], None] | None = None
        # stage 2: accumulator slices that the next reduction overwrites instead of adds to
        self._fresh = {gk: True for gk in self.order}
        self._bucket_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._hooks = []
        self._round_open = False
        self._reset_round()

    def _mixed_buckets(self, comm) -> dict:
        mixed = {}
        for g, k in self.order:
            gb = self.groups[g]
            spans = [(s.bucket_lo, s.numel, gb.params[s.param]) for s in self._segments[(g, k)]]
            plan = mixed_reduction(comm, spans, gb.layout.bucket_sizes[k], self.comm_dtype,
                                   gb.rank)
            if plan is not None:
                mixed[(g, k)] = plan
        if mixed and self.stage == 0:
            raise ValueError("per-parameter reduction dtypes at stage 0 (engine/autocast.py "
                             "marks none there)")
        return mixed

    # ---- hooks -------------------------------------------------------------------------
    def register_hooks(self) -> None:
        for gb in self.groups:
            for p in gb.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _reset_round(self):
        self._remaining = {gk: len(self._segments[gk]) for gk in self.order}
        self._delivered: set[int] = set()
        self._ready = [False] * len(self.order)
        self._next = 0
        self._round_open = False
        self._reducing = False

    def _open_round(self):
        self._round_open = True
        self._reducing = self.stage == 2 or self.should_reduce()

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._round_open:
            self._open_round()
        elif id(p) in self._delivered:
            # a second backward began without engine.backward()/step() closing the first
            self.flush()
            self._open_round()
        self._delivered.add(id(p))
        g, i, segs = self._param_info[id(p)]
        gb = self.groups[g]
        if self.stage < 2 and not gb.grad_views:
            # stage 1, fp32 accumulator: add this micro-step's gradient, drop .grad
            gb.grad_view(i).add_(p.grad)
            p.grad = None
            if not self._reducing:
                return
        elif self.stage < 2:
            view = gb.grad_view(i)
            if p.grad.data_ptr() != view.data_ptr():
                # someone replaced .grad (e.g. model.zero_grad(set_to_none=True)): what the
                # user sees in .grad is the truth; put it back into the flat buffer
                view.copy_(p.grad)
                p.grad = view
            if not self._reducing:
                return
        else:
            flat = p.grad.reshape(-1)
            for s in segs:
                buf = self._bucket_grad(g, s.bucket)
                buf[s.bucket_lo:s.bucket_lo + s.numel].copy_(flat[s.param_lo:s.param_hi])
            p.grad = None
        for s in segs:
            gk = (g, s.bucket)
            self._remaining[gk] -= 1
            if self._remaining[gk] == 0:
                self._ready[self._pos[gk]] = True
        self._launch_ready()

    # ---- launching -----------------------------------------------------------------------
    def _bucket_grad(self, g: int, k: int) -> torch.Tensor:
        """Stage 2: the pooled buffer collecting bucket (g, k)'s gradients this backward."""
        buf = self._bucket_grads.get((g, k))
        if buf is None:
            lay = self.groups[g].layout
            buf = self._grad_pool.take(lay.bucket_sizes[k], self._finish_oldest)
            used = min(lay.numel - lay.bucket_starts[k], lay.bucket_sizes[k])
            buf[used:].zero_()  # tail padding must reduce to zero
            self._bucket_grads[(g, k)] = buf
        return buf

    def _launch_ready(self):
        while self._next < len(self.order) and self._ready[self._next]:
            self._launch(*self.order[self._next])
            self._next += 1

    def _launch(self, g: int, k: int) -> None:
        gb = self.groups[g]
        comm = self.comm
        if self.stage == 0:
            bucket = gb.grad_buf.bucket(k)
            send = self._in_comm_dtype(bucket)
            handle = comm.all_reduce(send, "sum", async_op=True)
            done = None if send is bucket else self._copy_back(send, bucket)
        elif (g, k) in self._mixed:
            handle, done = self._launch_mixed(g, k)
        elif self.stage == 1:
            bucket = gb.grad_buf.bucket(k)
            send = self._in_comm_dtype(bucket)
            out = self._out_pool.take(gb.layout.shard_size(k), self._finish_oldest)
            handle = comm.reduce_scatter(out, send, "sum", async_op=True)

            def done(out=out, dst=gb.grad_buf.shard(k), send=send, bucket=bucket):
                dst.copy_(out)
                self._out_pool.release(out)
                if send is not bucket:
                    self._grad_pool.release(send)
        else:
            src = self._bucket_grads.pop((g, k), None)
            if src is None or self._remaining[(g, k)]:
                src = self._fill_missing(g, k, src)
            acc = gb.grad_part.bucket(k)
            fresh = self._fresh[(g, k)]
            self._fresh[(g, k)] = False
            if fresh and acc.dtype == src.dtype:
                # first reduction since the last step: write the accumulator directly
                handle = comm.reduce_scatter(acc, src, "sum", async_op=True)

                def done(src=src):
                    self._grad_pool.release(src)
            else:
                out = self._out_pool.take(gb.layout.shard_size(k), self._finish_oldest)
                handle = comm.reduce_scatter(out, src, "sum", async_op=True)

                def done(src=src, out=out, acc=acc, fresh=fresh):
                    # into the accumulator's dtype: overwrite after a step, else add
                    acc.copy_(out) if fresh else acc.add_(out)
                    self._out_pool.release(out)
                    self._grad_pool.release(src)
        if not self.overlap:
            handle.wait()
            if done is not None:
                done()
            self._landed((g, k))
            return
        self._inflight.append((handle, done, (g, k)))
        while len(self._inflight) > self.max_inflight:
            self._finish_oldest()

    def _launch_mixed(self, g: int, k: int):
        """Stages 1/2, a bucket with parameters reduced in several dtypes (torch_autocast)."""
        gb = self.groups[g]
        plan = self._mixed[(g, k)]
        if self.stage == 1:
            return plan.launch(self.comm, gb.grad_buf.bucket(k), gb.grad_buf.shard(k), False,
                               self._pools.take, self._pools.release)
        src = self._bucket_grads.pop((g, k), None)
        if src is None or self._remaining[(g, k)]:
            src = self._fill_missing(g, k, src)
        fresh = self._fresh[(g, k)]
        self._fresh[(g, k)] = False
        handle, finish = plan.launch(self.comm, src, gb.grad_part.bucket(k), not fresh,
                                     self._pools.take, self._pools.release)

        def done(src=src):
            finish()
            self._grad_pool.release(src)
        return handle, done

    def _in_comm_dtype(self, bucket: torch.Tensor) -> torch.Tensor:
        """Stages 0/1: *bucket* itself when it is in the communication dtype, else a pooled
        copy converted to it."""
        if bucket.dtype == self.comm_dtype:
            return bucket
        buf = self._grad_pool.take(bucket.numel(), self._finish_oldest)
        buf.copy_(bucket)
        return buf

    def _copy_back(self, send: torch.Tensor, bucket: torch.Tensor):
        """Stage 0, converted bucket: what to run once its all-reduce has landed."""
        def done():
            bucket.copy_(send)
            self._grad_pool.release(send)
        return done

    def _fill_missing(self, g, k, buf):
        """Stage 2, bucket flushed before all its parameters delivered a gradient (unused
        parameters): zero the parts nobody wrote."""
        if buf is None:
            buf = self._bucket_grad(g, k)
            self._bucket_grads.pop((g, k))
        gb = self.groups[g]
        for s in self._segments[(g, k)]:
            if id(gb.params[s.param]) not in self._delivered:
                buf[s.bucket_lo:s.bucket_lo + s.numel].zero_()
        return buf

    def _finish_oldest(self) -> bool:
        if not self._inflight:
            return False
        handle, done, gk = self._inflight.popleft()
        handle.wait()
        if done is not None:
            done()
        self._landed(gk)
        return True

    def _landed(self, gk) -> None:
        if self.on_reduced is not None:
            self.on_reduced(self.groups[gk[0]].reduced_grad_bucket(gk[1]))

    # ---- end of backward / step ----------------------------------------------------------
    def flush(self) -> None:
        """End of a backward: launch every bucket not launched yet (in order)."""
        if self._round_open and self._reducing:
            for pos in range(self._next, len(self.order)):
                self._launch(*self.order[pos])
        self._reset_round()

    def wait_all(self) -> None:
        """Block until every launched reduction has landed in its destination."""
        while self._finish_oldest():
            pass

    def mark_fresh(self) -> None:
        """After a step (or zero_grad): the next stage-2 reduction overwrites the
        accumulator instead of adding to it."""
        for gk in self._fresh:
            self._fresh[gk] = True

    @property
    def communication_buffers(self) -> int:
        """Pooled buffers allocated so far (count)."""
        return self._out_pool.allocated + self._grad_pool.allocated + self._pools.allocated
