"""Stages 0, 1 and 2 as the engine's :class:`~zero_core.engine.contract.StageParts`.

The model's parameters become views into one flat buffer per optimizer group
(buffers.py: parameters, gradients, the fp32 master and this rank's slice of it), so the
model runs unchanged; backward hooks reduce each full bucket (grad_reduce.py: all-reduce at
stages 0-1, reduce-scatter at stage 2) while backward goes on. Nothing is gathered around
a forward, so generation, state dicts and handing the model back are the model itself.
"""
from __future__ import annotations

import contextlib

import torch

from zero_core.checkpoint.engine_state import (bucket_fragments, group_layouts,
                                               restore_bucket_params)
from zero_core.config.precision import torch_dtype
from zero_core.engine.contract import StageParts
from zero_core.engine.model_sync import broadcast_buffers, check_parameters_match
from zero_core.placement import move_module
from zero_core.stage0to2.buffers import GroupBuffers
from zero_core.stage0to2.grad_reduce import GradReducer


class Stage0to2Parts(StageParts):
    """Flat buffers per group, reduced bucket by bucket (see module docstring)."""

    def prepare_model(self, model):
        move_module(model, self.ctx.device)
        broadcast_buffers(model, self.ctx.world_comm)
        check_parameters_match(model, self.ctx.world_comm)

    def build(self, model, groups):
        ctx = self.ctx
        # registration order: the reducer fills buckets in the order backward produces
        # gradients, the reverse of it
        self._registration = {}
        for p in model.parameters():
            self._registration.setdefault(id(p), len(self._registration))
        trainable_ids = set()
        per_group = []
        for g in groups:
            ps = [p for p in g["params"] if p.requires_grad]
            ps.sort(key=lambda p: -self._registration[id(p)])
            per_group.append(ps)
            trainable_ids.update(id(p) for p in ps)
        values = [[p.detach().float() for p in ps] for ps in per_group]
        if ctx.compute_dtype != torch.float32:
            # frozen parameters and floating buffers compute in the low precision too
            model.to(ctx.compute_dtype)
        zc = ctx.config.zero_optimization
        self.buffers = [None if not ps else GroupBuffers(
            ps, ctx.stage, ctx.compute_dtype, ctx.device, ctx.rank, ctx.world_size,
            zc.reduce_bucket_size, ctx.memory_ledger, vals,
            grad_dtype=torch_dtype(ctx.config.grad_accum_dtype_name),
            master_dtype=ctx.master_dtype)
            for ps, vals in zip(per_group, values)]
        del values
        for p in model.parameters():
            if id(p) not in trainable_ids:
                ctx.memory_ledger.track("frozen_parameters", p.data)
        for b in model.buffers():
            ctx.memory_ledger.track("buffers", b)

    def build_reducer(self, is_boundary):
        ctx = self.ctx
        return GradReducer(
            [gb for gb in self.buffers if gb is not None], ctx.comm, ctx.stage,
            ctx.config.zero_optimization.overlap_comm, self._registration, is_boundary,
            on_allocate=lambda t: ctx.memory_ledger.track("communication_buffers", t),
            comm_dtype=torch_dtype(ctx.config.comm_dtype_name))

    @contextlib.contextmanager
    def gathered_model(self, module, keep=False):
        yield module

    def checkpoint_fragments(self, purpose, module, flat_state):
        return bucket_fragments(purpose, module, self.buffers, flat_state, self.ctx.stage,
                                self.ctx.rank, self.ctx.world_size)

    def checkpoint_restored(self):
        restore_bucket_params(self.buffers, self.ctx.stage, self.ctx.comm)

    def checkpoint_layout(self, module):
        return group_layouts(module, self.buffers)

    def state_dict(self, module, rank0_only, exclude_frozen):
        if rank0_only and self.ctx.world_comm.rank != 0:
            return {}
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        return {k: v.detach().clone() for k, v in module.state_dict().items()
                if not (exclude_frozen and k in frozen)}

    def hand_back_model(self, module):
        return module   # the parameters hold their values; the engine removed its hooks

    def parameter_numel(self, module):
        return sum(p.numel() for p in module.parameters())
