"""A consolidated (full) state dict of a stage-3 model, one fetch unit at a time.

Keys and order follow ``nn.Module.state_dict()`` (parameters then persistent buffers of
each module, recursively; a tied parameter under each of its names, one tensor). Values
of parameters are clones in the compute dtype. Each unit is gathered, copied out (on
rank 0 only with ``rank0_only``) and released again unless it was gathered already, so
no rank holds more than the model once plus one unit.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


def consolidated_state_dict(module, units, gatherer, rank: int, rank0_only: bool = False,
                            exclude_frozen: bool = False) -> dict:
    """Full state dict of *module*, partitioned in fetch *units* that *gatherer* gathers
    (see module docstring); ``{}`` on ranks other than 0 with *rank0_only*. Collective:
    every rank must call it."""
    keep = not rank0_only or rank == 0
    values: dict[int, torch.Tensor] = {}
    for u in units:
        if exclude_frozen and not u.trainable:
            continue
        was_released = u.released
        gatherer.wait(u)
        if keep:
            for p, off in zip(u.params, u.offsets):
                meta = p.__dict__["_zc"]
                values[id(p)] = u.full.narrow(0, off, meta.numel).view(meta.shape).clone()
        if was_released and not u.in_use:
            gatherer.release(u)
    if not keep:
        return {}
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()

    def walk(module, prefix):
        for name, p in module._parameters.items():
            if p is not None and id(p) in values:
                out[prefix + name] = values[id(p)]
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = b.detach().clone()
        for name, child in module._modules.items():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(module, "")
    return out
