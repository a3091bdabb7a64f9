"""ZenFlow at ZeRO stage 3 (``zero_optimization.zenflow`` with ``stage: 3`` and
``offload_optimizer.device: cpu``): the rules of offload/zenflow.py's docstring, unchanged,
over stage 3's partitions.

Why it is a small subclass. Stage 3 lays out each group by fetch units
(stage3/units.py ``unit_layout``: bucket k = unit k, this rank's slice of it = its
partition), the same ``GroupLayout`` arithmetic stages 1-2 use for buckets. What differs:

* the parameters a rank updates are its partitions themselves (``param_buf.bucket(k)``),
  not its shard of a full replicated buffer; nothing is all-gathered after the step — the
  next forward gathers the units, and the engine drops the stale gathered copies after
  every step (``StageParts.after_update``);
* so a host update applied *outside* a step (``flush()``, and the save that flushes
  first) must drop them too: persistent units keep their gathered copy between steps.
  The engine's ``after_update`` is handed in as *partitions_changed*.

How partitions map to columns, and what all ranks agree on. A fetch unit is the row-major
flat values of its parameters, cut into N equal contiguous slices; element e of a 2-D
weight (rows × columns, ``torch.nn.Linear``'s (out, in)) belongs to column e mod columns.
At a selection each rank adds |g| of the elements of its partition into per-column sums
(the gradient is already reduce-scattered: each element's is the global mean), one
all-reduce (sum) per group gives every rank the whole column's Σ_rows |g|, and every rank
takes the same top max(1, int(columns × ``topk_ratio``)) columns; each then keeps the
indices of the selected elements its partition holds. The device step, the host window and
the host step are per element, on this rank's partition only.

DeepSpeed 0.19.8 (runtime/zenflow/engine_stage3.py, read): it stores every non-1-D
parameter transposed, so that a column of the weight is contiguous in its flat partition;
each rank sums |g| over the columns *wholly inside* its partition of that one parameter,
all-gathers those sums, and takes the top int(k × ``topk_ratio``) of the k whole columns;
a column cut by a partition boundary is never selected. On one rank (and whenever no
column is cut) that is the rule above. Here parameters keep their layout (the model, its
state_dict and checkpoints are unchanged), a column is spread over the whole parameter,
so "wholly inside one partition" would exclude almost every column on 2+ ranks; the whole
column's sum is all-reduced instead, every column is a candidate, and the selection does
not depend on the world size. DeepSpeed also fails on a parameter of 3+ dimensions (it
transposes with ``.t()``); here such a parameter is selected whole, like a bias, as at
stages 1-2. The other differences are those of stages 1-2 (offload/zenflow.py).

Measured against DeepSpeed 0.19.8's own stage-3 ZenFlow (tests/fixtures/
deepspeed_zenflow_stage3.json; it runs on the cpu only with its literal ``device='cuda'``
mapped to the cpu, see ci/tools/make_zenflow_stage3_fixture.py; fp32, ``overlap_step``
false, ``gradient_clipping`` 0): equal within 1.5e-6 (float32 rounding) on 1 and 2 ranks
with ``update_interval`` 2 and 3, with one difference seen on 2 ranks only: right after a
host update DeepSpeed's parameters hold the host's values in the selected elements (columns
and 1-D parameters) until its next device step puts the device's back, so the forward of
that next step computes with them; its 1-rank run, and this module on any number of ranks,
keep the device's values (the rule). Clipping differs by construction: DeepSpeed (default
``gradient_clipping`` 1.0 in 0.19.8, as in zero-core) clips the host step's window mean by
that mean's norm and steps the selected columns on the unclipped gradient; here every step's
gradient is clipped by its own norm (``grad_factor``) for both.

Checkpoints: as at stages 1-2 (per-element columns beside the master and moments, saved
per parameter fragment by stage 3's ``unit_fragments``), so a checkpoint resumes bit for
bit on the same world size, and on another (or at stage 1-2) as the moments do:
tests/test_zenflow_stage3.py.

With ``offload_param`` (offload/params.py's ``ParamOffload``: the partitions in host
memory, ``device: cpu``, or in swap files, ``nvme``) every update of the partitions goes
through the store's write path, as the plain offloaded optimizer's does: the host update
(master, the selected elements' device values over it) as whole partitions through
``write_piece``; the device step's selected elements into the host partition in place
(cpu; the indices and values are copied to the host) or, with ``nvme``, into a host copy
of the partition read from the store and written back whole through ``write_piece``; the
store's ``flush`` ends each step (and ``flush()``), then the gathered copies are dropped as
without it. Training is bit-identical to ZenFlow at stage 3 without ``offload_param``
(tests/test_zenflow_stage3.py).
"""
from __future__ import annotations

from typing import Callable

from zero_core.offload.params import TRANSFER as PARAM_TRANSFER
from zero_core.offload.zenflow import ZenFlowOptimizer


class ZenFlowStage3Optimizer(ZenFlowOptimizer):
    """:class:`~zero_core.offload.zenflow.ZenFlowOptimizer` over stage-3 partitions (module
    docstring). *partitions_changed*: the stage's ``after_update`` (drop gathered copies)."""

    def __init__(self, *args, partitions_changed: Callable[[], None], **kwargs):
        super().__init__(*args, **kwargs)
        self._partitions_changed = partitions_changed

    def _param_shard(self, j, k):
        return self.buffers[j].param_buf.bucket(k)   # the partition is this rank's slice

    def step(self, closure=None):
        super().step(closure)
        if self.param_sink is not None:
            self.param_sink.flush()   # nvme: every unit's new values are on disk

    # ---- offload_param: the parameter store's write path (module docstring) -------------
    def _device_step(self) -> None:
        if self.param_sink is not None and self.param_sink.nvme:
            self.param_sink.flush()   # a host update written this step is read back whole
        super()._device_step()

    def _write_selected(self, key, w) -> None:
        store = self.param_sink
        if store is None:
            return super()._write_selected(key, w)
        gb, k, idx = self.buffers[key[0]], key[1], self.host.idx[key]
        if not store.nvme:
            part = gb.units[k].part
            values = w.to(part.device, part.dtype)
            part.index_copy_(0, idx.to(part.device), values)
            self.comm.ledger.record_copy(PARAM_TRANSFER, values, w)
            return
        part = store.read_partition(gb, k)
        values = w.to("cpu", part.dtype)
        self.comm.ledger.record_copy(PARAM_TRANSFER, values, w)
        part.index_copy_(0, idx, values)
        store.write_piece(gb, k, 0, part)

    def _write_applied(self, key, master) -> None:
        if self.param_sink is None:
            return super()._write_applied(key, master)
        values = master
        if key in self._w:
            values = master.clone()
            w = self._w[key].to("cpu", values.dtype)
            self.comm.ledger.record_copy(PARAM_TRANSFER, w, self._w[key])
            values.index_copy_(0, self.host.idx[key], w)
        self.param_sink.write_piece(self.buffers[key[0]], key[1], 0, values)

    def _gather(self) -> None:
        """Nothing: the next forward gathers the updated partitions (the engine releases
        the stale gathered copies after the step)."""

    def flush(self) -> None:
        """Apply the host update in flight now (``overlap_step``); the gathered copies of
        the changed partitions are dropped (collective: every rank calls it)."""
        if self._job is not None:
            self._wait_and_apply(self.t)
            if self.param_sink is not None:
                self.param_sink.flush()
            self._partitions_changed()


def build_zenflow_stage3(ctx, hyper_groups, rule, parts, zero_grad) -> ZenFlowStage3Optimizer:
    """The engine's optimizer for ZenFlow at stage 3 (*parts*: the engine's ``Stage3Parts``;
    engine/optimizer_choice.py decides)."""
    zc = ctx.config.zero_optimization
    return ZenFlowStage3Optimizer(
        hyper_groups, rule, parts.buffers, ctx.comm, ctx.memory_ledger, zero_grad,
        zc.offload_optimizer, zc.sub_group_size, ctx.accelerator, ctx.rank, zc.zenflow,
        ctx.kernels, ctx.device, param_sink=parts.param_store,
        partitions_changed=parts.after_update)
