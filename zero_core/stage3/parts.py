"""Stage 3 as the engine's :class:`~zero_core.engine.contract.StageParts`: parameters
partitioned too.

What it builds (``build``, one method per part, in this order): the fetch units (units.py:
which parameters are gathered together, by optimizer group, FROZEN for the untrained ones),
the parameter offload store (``offload_param``: zero_core/offload/params.py — the only
place stage 3 imports offload/, which imports nothing of stage 3), each group's flat
partitions (buffers.py), ZeRO++ (zero_core/zeropp), the gatherer (gather.py), the
gather/prefetch/release policy (coordinator.py) and the module hooks that gather around each
module's forward and backward (module_hooks.py). Gradients are reduce-scattered per unit
straight into the partitions (grad_reduce.py).

Model-state bytes per rank: 16Ψ/N (ARCHITECTURE §4) plus padding, plus the persistent units
(gathered copies of small parameters, kept between uses) and the live window of gathered
units (bounded by ``stage3_max_live_parameters`` plus the units of the module running);
``memory_report()["stage3"]`` shows both.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from zero_core.checkpoint.engine_state import group_layouts, restore_unit_params, unit_fragments
from zero_core.config.precision import torch_dtype
from zero_core.engine.contract import StageParts
from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.engine.model_sync import broadcast_buffers, check_parameters_match
from zero_core.placement import move_module, move_parameter
from zero_core.stage3 import partitioned_params as pp
from zero_core.stage3.buffers import OffloadedStage3GroupBuffers, Stage3GroupBuffers
from zero_core.stage3.coordinator import ParamCoordinator
from zero_core.stage3.gather import UnitGatherer
from zero_core.stage3.grad_reduce import Stage3GradReducer
from zero_core.stage3.init_context import gather_own, partition_own
from zero_core.stage3.module_hooks import ModuleHooks
from zero_core.stage3.state_dict import consolidated_state_dict
from zero_core.stage3.units import FROZEN, coalesce_numel, plan_units

log = logging.getLogger("zero_core.stage3")


class Stage3Parts(StageParts):
    """Fetch units gathered around each module's use (see module docstring). After
    ``build``: ``units``, ``frozen_buffers``, ``param_store`` (``offload_param``), ``zeropp``,
    ``gatherer``, ``coordinator``, ``module_hooks``."""

    # ---- construction --------------------------------------------------------------------------
    def prepare_model(self, model):
        ctx = self.ctx
        move_module(model, ctx.device, parameters=False)
        broadcast_buffers(model, ctx.world_comm)
        plain = [p for p in model.parameters() if not pp.is_partitioned(p)]
        if plain and len(plain) == len(list(model.parameters())):
            # built without Init: verify as stages 0-2 do (Init verified its own)
            check_parameters_match(model, ctx.world_comm)
        for p in plain:
            move_parameter(p, ctx.device)

    def build(self, model, groups):
        self._check_init_dtypes(model)
        self.units, module_units = self._plan_fetch_units(model, groups)
        self.param_store = self._build_param_store()
        self.buffers, self.frozen_buffers = self._build_group_buffers(len(groups))
        self._cast_model_buffers(model)
        self.zeropp = self._build_zeropp()
        self.gatherer = self._build_gatherer()
        self.coordinator = self._build_coordinator()
        self._module_units = module_units
        self.module_hooks = self._build_module_hooks(model)
        units = self.units
        log.info("stage 3: %d parameters in %d fetch units (%d persistent)",
                 sum(u.numel for u in units), len(units), sum(u.persistent for u in units))

    def _check_init_dtypes(self, model) -> None:
        """A model built under ``zero_core.Init(dtype=...)`` without a config (Init checks
        it against the config when it has one): the dtype must be fp32 or the compute
        dtype — another 16-bit format would have rounded the values for nothing."""
        compute = self.ctx.compute_dtype
        for name, p in model.named_parameters():
            want = pp.meta_of(p).extra.get("init_dtype") if pp.is_partitioned(p) else None
            if want is not None and want not in (torch.float32, compute):
                raise ConfigError(
                    f"parameter '{name}' was built under zero_core.Init(dtype={want}) but the "
                    f"config trains in {compute}: the values were rounded to {want} for "
                    f"nothing. Build with dtype={compute}, torch.float32 or None")

    def _plan_fetch_units(self, model, groups):
        """The fetch units of every parameter (units.py: by optimizer group, FROZEN for
        the untrained ones) and the units each module's forward needs."""
        group_of = {id(p): FROZEN for p in model.parameters()}
        for g, group in enumerate(groups):
            for p in group["params"]:
                if p.requires_grad:
                    group_of[id(p)] = g
        zc = self.ctx.config.zero_optimization
        target = coalesce_numel(zc.stage3_prefetch_bucket_size, zc.reduce_bucket_size)
        return plan_units(model, group_of, zc.stage3_param_persistence_threshold, target)

    def _build_param_store(self):
        """offload_param (zero_core/offload/params.py): the store of the parameter
        partitions in host memory or files, or None. The only import of offload/ in
        stage 3: it is composed here with the buffers, gatherer and optimizer."""
        from zero_core.offload.params import build_param_offload
        return build_param_offload(self.ctx)

    def _build_group_buffers(self, num_groups: int):
        """The flat partitions of each trainable group (None for a group without units),
        and of the frozen units (or None)."""
        buffers = []
        for g in range(num_groups):
            mine = [u for u in self.units if u.group == g]
            buffers.append(self._group_buffers(mine, True) if mine else None)
        frozen = [u for u in self.units if u.group == FROZEN]
        return buffers, (self._group_buffers(frozen, False) if frozen else None)

    def _group_buffers(self, units, trainable: bool):
        ctx = self.ctx
        args = (units, trainable, ctx.compute_dtype, ctx.device, ctx.rank, ctx.world_size,
                ctx.memory_ledger, self._unit_values)
        grad_dtype = torch_dtype(ctx.config.grad_accum_dtype_name)
        if self.param_store is None:
            return Stage3GroupBuffers(*args, grad_dtype=grad_dtype, master_dtype=ctx.master_dtype)
        # offload_param alone: the optimizer, and so the master, stays on the device
        on_device = not ctx.config.zero_optimization.offload_optimizer.enabled
        return OffloadedStage3GroupBuffers(*args, store=self.param_store, grad_dtype=grad_dtype,
                                           master_dtype=ctx.master_dtype,
                                           values_in_compute_dtype=self._built_in_compute_dtype(units),
                                           master_on_device=on_device)

    def _built_in_compute_dtype(self, units) -> bool:
        """True when every parameter of *units* holds its values in the compute dtype
        already (built so, e.g. in bf16 under Init): casting loses nothing."""
        def source_dtype(p):
            if pp.is_partitioned(p) and pp.meta_of(p).own_part is not None:
                return pp.meta_of(p).own_part.dtype
            return p.dtype
        return all(source_dtype(p) == self.ctx.compute_dtype for u in units for p in u.params)

    def _unit_values(self, u):
        """The unit's padded flat values in fp32; its parameters are released afterwards,
        so that building never holds more than the model once plus one unit."""
        ctx = self.ctx
        dtype = ctx.compute_dtype
        flat = torch.zeros(u.padded_numel, dtype=torch.float32, device=ctx.device)
        for p, off, name in zip(u.params, u.offsets, u.names):
            n = p.numel()
            if pp.is_partitioned(p):
                src = gather_own(p).narrow(0, 0, n)
            else:
                src = p.data.reshape(-1)
            flat.narrow(0, off, n).copy_(src)
            meta = pp.mark_partitioned(p, name)
            meta.name, meta.unit, meta.offset, meta.dtype = name, u, off, dtype
            meta.own_part = None
            meta.available = True   # its own values (or Init's gathered ones) until here
            pp.release(p, dtype=dtype, device=ctx.device)
        return flat

    def _cast_model_buffers(self, model) -> None:
        """The model's floating buffers in the compute dtype, counted by the ledger."""
        dtype = self.ctx.compute_dtype
        if dtype != torch.float32:
            for m in model.modules():
                for key, b in m._buffers.items():
                    if b is not None and b.is_floating_point():
                        m._buffers[key] = b.to(dtype)
        for b in model.buffers():
            self.ctx.memory_ledger.track("buffers", b)

    def _build_zeropp(self):
        """ZeRO++ (zero_core/zeropp): how units are gathered and reduced, or None."""
        from zero_core.zeropp import build_zeropp
        return build_zeropp(self.ctx, self.units, self.param_store)

    def _build_gatherer(self) -> UnitGatherer:
        ctx = self.ctx
        return UnitGatherer(ctx.comm, ctx.compute_dtype, ctx.device,
                            strategy=self.zeropp.fetch if self.zeropp else None,
                            part_source=self.param_store)

    def _build_coordinator(self) -> ParamCoordinator:
        """The gather/prefetch/release policy (it adopts the units and their parameters);
        the parameter offload reads ahead along its recorded order."""
        zc = self.ctx.config.zero_optimization
        coordinator = ParamCoordinator(
            self.units, self.gatherer, zc.stage3_prefetch_bucket_size,
            zc.stage3_max_live_parameters, zc.stage3_max_reuse_distance,
            generation_budget=self.ctx.config.generation.max_live_parameters)
        if self.param_store is not None:
            self.param_store.attach(coordinator)
        return coordinator

    def _build_module_hooks(self, model) -> ModuleHooks:
        unit_by_param = {id(p): u for u in self.units for p in u.params}
        names = {m: (n or type(model).__name__) for n, m in model.named_modules()}
        return ModuleHooks(model, self.coordinator, self._module_units,
                           lambda p: unit_by_param.get(id(p)), names)

    def build_reducer(self, is_boundary):
        ctx = self.ctx
        return Stage3GradReducer(
            self.units, ctx.comm, self.coordinator, ctx.config.zero_optimization.overlap_comm,
            ctx.device, on_allocate=lambda t: ctx.memory_ledger.track("communication_buffers", t),
            reduce_unit=self.zeropp.reduce_unit if self.zeropp else None,
            comm_dtype=torch_dtype(ctx.config.comm_dtype_name))

    # ---- the step --------------------------------------------------------------------------------
    def after_update(self):
        self.coordinator.release_all()  # gathered copies are stale after the update
        if self.zeropp is not None:
            self.zeropp.partitions_changed()  # and so are hpZ's secondary partitions

    def train(self, mode):
        if mode:  # training resumes: the units kept gathered for generation are released
            self.coordinator.end_generation()

    # ---- generation (the kept units: generation_cache.py) ------------------------------------------
    @contextlib.contextmanager
    def gathered_model(self, module, keep=False):
        """The whole model gathered (exact values, compute dtype) with the module hooks
        off, for a generate call that runs as fast as the plain model; the hooks come back
        on exit and the units are released, or with *keep* stay gathered until training
        resumes (the generation cache's kept set)."""
        coord = self.coordinator
        coord.pin(self.units)
        self.module_hooks.remove()
        try:
            yield module
        finally:
            self.module_hooks = self._build_module_hooks(module)
            if keep:
                coord.keep_for_generation(self.units)
            else:
                coord.unpin(self.units, keep_for_backward=False)

    def awaiting_backward(self):
        return self.coordinator.awaiting_backward

    def generation_streams(self):
        gen = self.coordinator.generation
        return gen.capacity < gen.model_numel

    def end_generation(self):
        self.coordinator.end_generation()

    # ---- checkpoints -------------------------------------------------------------------------------
    def checkpoint_fragments(self, purpose, module, flat_state):
        return unit_fragments(module, self.buffers, self.frozen_buffers, flat_state,
                              self.ctx.rank)

    def checkpoint_restored(self):
        restore_unit_params(self.buffers)
        self.coordinator.release_all()   # the next forward gathers the loaded values
        if self.zeropp is not None:
            self.zeropp.partitions_changed()

    def checkpoint_layout(self, module):
        return group_layouts(module, [*self.buffers, self.frozen_buffers], fetch_units=True)

    # ---- the model, whole ----------------------------------------------------------------------------
    def state_dict(self, module, rank0_only, exclude_frozen):
        # "rank 0" is the job's (MiCS: not each shard group's partition index 0)
        return consolidated_state_dict(module, self.units, self.gatherer,
                                       self.ctx.world_comm.rank, rank0_only, exclude_frozen)

    def hand_back_model(self, module):
        """Return *module* partitioned the way ``zero_core.Init`` leaves a model, so that
        ``zero_core.initialize`` can build a new engine on it (a second training run on the
        same model, training after an evaluation engine). Collective.

        Every parameter becomes a released PartitionedParameter whose own partition is
        this rank's slice of its values (``init_context.partition_own``), one fetch unit
        at a time: a rank never holds more than one unit gathered, plus its new partitions
        (Ψ/N elements in all). The values are the fp32 master's when the group keeps one
        (mixed precision: a bf16 run loses nothing), else the partitions themselves (fp32
        training, frozen units). Refused while a unit is in use."""
        busy = [u.index for u in self.units if u.in_use]
        if busy:
            raise ZeroCoreError(
                f"hand_back_model: fetch units {busy} are in use (a forward is running or a "
                f"GatheredParameters block is open); call it after they finished")
        self.destroy()
        ctx = self.ctx
        for u in self.units:          # anything destroy's release left gathered
            if not u.released:
                self.gatherer.release(u)
        with torch.no_grad():
            for u in self.units:
                full = self._handed_back_values(u)
                for p, off, name in zip(u.params, u.offsets, u.names):
                    pp.attach(p, full.narrow(0, off, pp.meta_of(p).numel))
                    del p.__dict__["_zc"]   # the engine's bookkeeping goes with the engine
                    p.grad = None
                    partition_own(p, name, ctx.comm, ctx.device)
                del full
        self.units = []
        return module

    def _handed_back_values(self, u) -> torch.Tensor:
        """Unit *u*'s padded flat values for :meth:`hand_back_model`: its master gathered
        (in the master's dtype) when its group keeps one, else its partitions gathered
        exactly (never ZeRO++'s quantized copy)."""
        gb = self.buffers[u.group] if u.trainable else None
        if gb is None or gb.master is None:
            self.gatherer.wait(u)
            full = u.full
            self.gatherer.release(u)
            return full
        ctx = self.ctx
        mine = gb.master.bucket(u.bucket).to(ctx.device)
        full = torch.empty(u.padded_numel, dtype=mine.dtype, device=ctx.device)
        if ctx.world_size == 1:
            full.copy_(mine)
        else:
            ctx.comm.all_gather_into(full, mine)
        return full

    def parameter_numel(self, module):
        return sum(u.numel for u in self.units)

    # ---- reports and the end ---------------------------------------------------------------------
    def memory_report(self):
        """``stage3``: bytes of persistent parameters (full copies kept gathered), of the
        live window now and at its peak, and its bound (stage3_max_live_parameters
        elements); ``zeropp`` with ZeRO++."""
        elem = torch.empty((), dtype=self.ctx.compute_dtype).element_size()
        g = self.gatherer
        persistent = sum(u.padded_numel for u in self.units if u.persistent)
        rep = {"stage3": {
            "persistent_parameters": persistent * elem,
            "persistent_parameters_gathered_now": g.persistent_numel * elem,
            "live_window_now": g.live_numel * elem,
            "live_window_peak": g.peak_live_numel * elem,
            "max_live_parameters":
                self.ctx.config.zero_optimization.stage3_max_live_parameters * elem,
            "largest_unit": max(u.padded_numel for u in self.units) * elem,
            "fetch_units": len(self.units),
            "persistent_units": sum(u.persistent for u in self.units),
            "trainable_units": sum(u.trainable for u in self.units),
            "gathers": g.gathers,
            "prefetched": self.coordinator.prefetched,
            "trace_rerecorded": self.coordinator.trace.rerecorded,
        }}
        if self.zeropp is not None:
            rep["zeropp"] = self.zeropp.memory_report()
        return rep

    def destroy(self):
        """Remove the hooks; parameters stay partitioned (gather them with
        GatheredParameters)."""
        self.coordinator.release_all()
        self.module_hooks.remove()
