"""The ZeRO stage-3 engine: the stage 0-2 engine with parameters partitioned too.

What it reuses unchanged from :class:`~zero_core.stage0to2.engine.ZeroEngine`: optimizer-rule
resolution, parameter groups, the loss scaling by ``1/(world_size · accumulation)``, the
global-norm all-reduce, fp16 overflow skipping and clipping, LR schedulers, and the
:class:`~zero_core.optim.partitioned.PartitionedOptimizer` with its fused kernels
(stage 3 steps the partitions in place; nothing is gathered after the step).

What it replaces: the buffers (every group is partitions only, laid out by fetch unit —
units.py, buffers.py), the gradient reducer (reduce-scatter per unit straight into the
partitions — grad_reduce.py), and model preparation (parameters become
:class:`~zero_core.stage3.partitioned_params.PartitionedParameter`\\ s, gathered around each
module's forward and backward by module_hooks.py, coordinator.py and prefetch.py).
``_build_buffers`` builds these parts one method each, and composes ZeRO++ and the
parameter offload with them (``offload_param``: the store of zero_core/offload/params.py,
handed to the group buffers, the gatherer and the optimizer — the only place stage 3
imports offload/, which imports nothing of stage 3).

Model-state bytes per rank: 16Ψ/N (ARCHITECTURE §4) plus padding, plus the persistent units
(gathered copies of small parameters, kept between uses) and the live window of gathered
units (bounded by ``stage3_max_live_parameters`` plus the units of the module running);
``memory_report()["stage3"]`` shows both.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from zero_core.config.schema import torch_dtype
from zero_core.errors import ConfigError
from zero_core.stage0to2.engine import ZeroEngine
from zero_core.model_sync import broadcast_buffers, check_parameters_match
from zero_core.placement import move_module, move_parameter
from zero_core.stage3 import partitioned_params as pp
from zero_core.stage3.buffers import OffloadedStage3GroupBuffers, Stage3GroupBuffers
from zero_core.stage3.coordinator import ParamCoordinator
from zero_core.stage3.gather import UnitGatherer
from zero_core.stage3.grad_reduce import Stage3GradReducer
from zero_core.stage3.init_context import gather_own
from zero_core.stage3.module_hooks import ModuleHooks
from zero_core.stage3.state_dict import consolidated_state_dict
from zero_core.stage3.units import FROZEN, coalesce_numel, plan_units

log = logging.getLogger("zero_core.stage3")


class Stage3Engine(ZeroEngine):
    """ZeRO stage 3; build it with ``zero_core.initialize`` and ``zero_optimization.stage: 3``."""

    # ---- construction (hook points of ZeroEngine) ------------------------------------------
    def _prepare_model(self, model):
        move_module(model, self.device, parameters=False)
        broadcast_buffers(model, self.comm)
        plain = [p for p in model.parameters() if not pp.is_partitioned(p)]
        if plain and len(plain) == len(list(model.parameters())):
            # built without Init: verify as stages 0-2 do (Init verified its own)
            check_parameters_match(model, self.comm)
        for p in plain:
            move_parameter(p, self.device)

    def _build_buffers(self, model, groups):
        """ZeroEngine's hook: everything stage 3 holds besides the optimizer and reducer,
        built in this order, each part by the method named after it."""
        self.units, module_units = self._plan_fetch_units(model, groups)
        self.param_offload = self._build_param_offload()
        self._buffers, self._frozen_buffers = self._build_group_buffers(len(groups))
        self._cast_model_buffers(model)
        self.zeropp = self._build_zeropp()
        self.gatherer = self._build_gatherer()
        self.coordinator = self._build_coordinator()
        self._module_units = module_units
        self.module_hooks = self._build_module_hooks(model, module_units)
        units = self.units
        log.info("stage 3: %d parameters in %d fetch units (%d persistent)",
                 sum(u.numel for u in units), len(units), sum(u.persistent for u in units))

    def _plan_fetch_units(self, model, groups):
        """The fetch units of every parameter (units.py: by optimizer group, FROZEN for
        the untrained ones) and the units each module's forward needs."""
        self._registration = {}
        for p in model.parameters():
            self._registration.setdefault(id(p), len(self._registration))
        group_of = {id(p): FROZEN for p in model.parameters()}
        for g, group in enumerate(groups):
            for p in group["params"]:
                if p.requires_grad:
                    group_of[id(p)] = g
        if all(g == FROZEN for g in group_of.values()) and not self.inference_only:
            raise ConfigError("no trainable parameters: every parameter passed has "
                              "requires_grad=False (or model_parameters is empty)")
        zc = self.config.zero_optimization
        target = coalesce_numel(zc.stage3_prefetch_bucket_size, zc.reduce_bucket_size)
        return plan_units(model, group_of, zc.stage3_param_persistence_threshold, target)

    def _build_param_offload(self):
        """offload_param (zero_core/offload/params.py): the store of the parameter
        partitions in host memory or files, or None. The only import of offload/ in
        stage 3: the engine composes the store with the buffers, gatherer and optimizer."""
        from zero_core.offload.params import build_param_offload
        return build_param_offload(self)

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
        args = (units, trainable, self.compute_dtype, self.device, self.global_rank,
                self.world_size, self.memory_ledger, self._unit_values)
        grad_dtype = torch_dtype(self.config.grad_accum_dtype_name)
        if self.param_offload is None:
            return Stage3GroupBuffers(*args, grad_dtype=grad_dtype, master_dtype=self.master_dtype)
        return OffloadedStage3GroupBuffers(*args, store=self.param_offload, grad_dtype=grad_dtype,
                                           master_dtype=self.master_dtype,
                                           values_in_compute_dtype=self._built_in_compute_dtype(units))

    def _built_in_compute_dtype(self, units) -> bool:
        """True when every parameter of *units* holds its values in the compute dtype
        already (built so, e.g. in bf16 under Init): casting loses nothing."""
        def source_dtype(p):
            if pp.is_partitioned(p) and pp.meta_of(p).own_part is not None:
                return pp.meta_of(p).own_part.dtype
            return p.dtype
        return all(source_dtype(p) == self.compute_dtype for u in units for p in u.params)

    def _unit_values(self, u):
        """The unit's padded flat values in fp32; its parameters are released afterwards,
        so that building never holds more than the model once plus one unit."""
        dtype = self.compute_dtype
        flat = torch.zeros(u.padded_numel, dtype=torch.float32, device=self.device)
        for p, off, name in zip(u.params, u.offsets, u.names):
            n = p.numel()
            if pp.is_partitioned(p):
                src = gather_own(p, self.comm).narrow(0, 0, n)
            else:
                src = p.data.reshape(-1)
            flat.narrow(0, off, n).copy_(src)
            meta = pp.mark_partitioned(p, name)
            meta.name, meta.unit, meta.offset, meta.dtype = name, u, off, dtype
            meta.own_part = None
            meta.available = True   # its own values (or Init's gathered ones) until here
            pp.release(p, dtype=dtype, device=self.device)
        return flat

    def _cast_model_buffers(self, model) -> None:
        """The model's floating buffers in the compute dtype, counted by the ledger."""
        dtype = self.compute_dtype
        if dtype != torch.float32:
            for m in model.modules():
                for key, b in m._buffers.items():
                    if b is not None and b.is_floating_point():
                        m._buffers[key] = b.to(dtype)
        for b in model.buffers():
            self.memory_ledger.track("buffers", b)

    def _build_zeropp(self):
        """ZeRO++ (zero_core/zeropp): how units are gathered and reduced, or None."""
        from zero_core.zeropp import build_zeropp
        return build_zeropp(self, self.units)

    def _build_gatherer(self) -> UnitGatherer:
        return UnitGatherer(self.comm, self.compute_dtype, self.device,
                            strategy=self.zeropp.fetch if self.zeropp else None,
                            part_source=self.param_offload)

    def _build_coordinator(self) -> ParamCoordinator:
        """The gather/prefetch/release policy (it adopts the units and their parameters);
        the parameter offload reads ahead along its recorded order."""
        zc = self.config.zero_optimization
        coordinator = ParamCoordinator(
            self.units, self.gatherer, zc.stage3_prefetch_bucket_size,
            zc.stage3_max_live_parameters, zc.stage3_max_reuse_distance,
            generation_budget=self.config.generation.max_live_parameters)
        if self.param_offload is not None:
            self.param_offload.attach(coordinator)
        return coordinator

    def _build_module_hooks(self, model, module_units) -> ModuleHooks:
        unit_by_param = {id(p): u for u in self.units for p in u.params}
        names = {m: (n or type(model).__name__) for n, m in model.named_modules()}
        return ModuleHooks(model, self.coordinator, module_units,
                           lambda p: unit_by_param.get(id(p)), names)

    def _build_reducer(self):
        return Stage3GradReducer(
            self.units, self.comm, self.coordinator, self.config.zero_optimization.overlap_comm,
            self.device, on_allocate=lambda t: self.memory_ledger.track("communication_buffers", t),
            reduce_unit=self.zeropp.reduce_unit if self.zeropp else None,
            comm_dtype=torch_dtype(self.config.comm_dtype_name))

    # ---- training ----------------------------------------------------------------------------
    def _optimizer_step(self):
        super()._optimizer_step()
        self.coordinator.release_all()  # gathered copies are stale after the update
        if self.zeropp is not None:
            self.zeropp.partitions_changed()  # and so are hpZ's secondary partitions

    # ---- generation (zero_core/generation; the kept units: stage3/generation_cache.py) ----------
    def train(self, mode: bool = True):
        """Training resumes: the units kept gathered for generation are released."""
        super().train(mode)
        if mode:
            self.coordinator.end_generation()
        return self

    @contextlib.contextmanager
    def _gathered_model(self, keep: bool = False):
        """The whole model gathered (exact values, compute dtype) with the module hooks
        off, for a generate call that runs as fast as the plain model; the hooks come back
        on exit and the units are released, or with *keep* stay gathered until training
        resumes (the generation cache's kept set)."""
        coord = self.coordinator
        coord.pin(self.units)
        self.module_hooks.remove()
        try:
            yield self.module
        finally:
            self.module_hooks = self._build_module_hooks(self.module, self._module_units)
            if keep:
                coord.keep_for_generation(self.units)
            else:
                coord.unpin(self.units, keep_for_backward=False)

    def destroy(self) -> None:
        """Remove hooks; parameters stay partitioned (gather them with GatheredParameters)."""
        super().destroy()
        self.coordinator.release_all()
        self.module_hooks.remove()

    def hand_back_model(self) -> torch.nn.Module:
        """Retire this engine and return its model partitioned the way ``zero_core.Init``
        leaves a model, so that ``zero_core.initialize`` can build a new engine on it (a
        second training run on the same model, training after an evaluation engine).
        Collective: every rank calls it.

        Every parameter becomes a released PartitionedParameter whose own partition is
        this rank's slice of its values (``init_context.partition_own``), one fetch unit
        at a time: a rank never holds more than one unit gathered, plus its new partitions
        (Ψ/N elements in all). The values are the fp32 master's when the engine keeps one
        (mixed precision: a bf16 run loses nothing), else the partitions themselves
        (fp32 training, frozen units). The engine's hooks are removed; do not use the
        engine afterwards."""
        from zero_core.errors import ZeroCoreError
        from zero_core.stage3.init_context import partition_own
        busy = [u.index for u in self.units if u.in_use]
        if busy:
            raise ZeroCoreError(
                f"hand_back_model: fetch units {busy} are in use (a forward is running or a "
                f"GatheredParameters block is open); call it after they finished")
        self.destroy()
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
                    partition_own(p, name, self.global_rank, self.world_size, self.device)
                del full
        self.units = []
        return self.module

    def _handed_back_values(self, u) -> torch.Tensor:
        """Unit *u*'s padded flat values for :meth:`hand_back_model`: its master gathered
        (in the master's dtype) when its group keeps one, else its partitions gathered
        exactly (never ZeRO++'s quantized copy)."""
        gb = self._buffers[u.group] if u.trainable else None
        if gb is None or gb.master is None:
            self.gatherer.wait(u)
            full = u.full
            self.gatherer.release(u)
            return full
        mine = gb.master.bucket(u.bucket).to(self.device)
        full = torch.empty(u.padded_numel, dtype=mine.dtype, device=self.device)
        if self.world_size == 1:
            full.copy_(mine)
        else:
            self.comm.all_gather_into(full, mine)
        return full

    # ---- saving --------------------------------------------------------------------------------
    def module_state_dict(self, rank0_only: bool = False) -> dict:
        """The model's full state dict (parameter values in the compute dtype, buffers),
        gathered one fetch unit at a time. With *rank0_only*, other ranks get ``{}`` and
        never hold more than one unit in full."""
        return consolidated_state_dict(self, rank0_only)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Gather the model and save its state dict with ``torch.save`` from rank 0 to
        *save_dir*/*save_filename*, as DeepSpeed does when
        ``stage3_gather_16bit_weights_on_model_save`` is true (values in the compute
        dtype: fp16/bf16, or fp32 in fp32 training). When that key is false nothing is
        saved and False is returned (DeepSpeed's behaviour), with a warning."""
        if not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            log.warning("save_16bit_model: not saved, because zero_optimization."
                        "stage3_gather_16bit_weights_on_model_save is false; set it to true to "
                        "gather the partitioned parameters on save")
            return False
        state = consolidated_state_dict(self, rank0_only=True,
                                        exclude_frozen=exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            tmp = path + ".tmp"
            torch.save(state, tmp)
            os.replace(tmp, path)
        if self.world_size > 1:
            self.comm.barrier()
        return True

    # ---- checkpoints (save_checkpoint/load_checkpoint are ZeroEngine's) -------------------------
    def _checkpoint_fragments(self, purpose):
        from zero_core.checkpoint.engine_state import stage3_fragments
        return stage3_fragments(self, purpose)

    def _checkpoint_restored(self):
        from zero_core.checkpoint.engine_state import stage3_restored
        stage3_restored(self)
        if self.zeropp is not None:
            self.zeropp.partitions_changed()

    def _checkpoint_layout(self):
        from zero_core.checkpoint.engine_state import stage3_layout
        return stage3_layout(self)

    # ---- reports -------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Stage 0-2's report plus ``stage3``: bytes of persistent parameters (full copies
        kept gathered), of the live window now and at its peak, and its bound
        (stage3_max_live_parameters elements)."""
        rep = super().memory_report()
        elem = torch.empty((), dtype=self.compute_dtype).element_size()
        g = self.gatherer
        persistent = sum(u.padded_numel for u in self.units if u.persistent)
        rep["stage3"] = {
            "persistent_parameters": persistent * elem,
            "persistent_parameters_gathered_now": g.persistent_numel * elem,
            "live_window_now": g.live_numel * elem,
            "live_window_peak": g.peak_live_numel * elem,
            "max_live_parameters": self.config.zero_optimization.stage3_max_live_parameters * elem,
            "largest_unit": max(u.padded_numel for u in self.units) * elem,
            "fetch_units": len(self.units),
            "persistent_units": sum(u.persistent for u in self.units),
            "trainable_units": sum(u.trainable for u in self.units),
            "gathers": g.gathers,
            "prefetched": self.coordinator.prefetched,
            "trace_rerecorded": self.coordinator.trace.rerecorded,
        }
        if self.zeropp is not None:
            rep["zeropp"] = self.zeropp.memory_report()
        return rep
