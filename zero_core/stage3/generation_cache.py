"""Which fetch units stay gathered from one forward pass without autograd to the next.

Decoding runs the model's forward once per new token, in the same module order every time,
and nothing changes the partitions in between (no optimizer step). Training's rule — release
a unit once the pass no longer needs it — would gather the whole model again for every
token. In a pass without autograd (``torch.no_grad``, ``inference_mode``: decode steps,
sampling loops, evaluation) the coordinator therefore asks :meth:`GenerationCache.keeps`
before it releases a unit the pass does not use again: a unit already kept stays, and a
new one is kept while it fits the capacity, first-fit in first-use order::

    capacity = B                   when all non-persistent units together fit in B
             = B - largest unit    otherwise (room to stream the others one at a time)

with ``B = generation.max_live_parameters`` elements (default:
``stage3_max_live_parameters``). Within a generation pass the live window (what the
prefetcher and the in-pass reuse rules may hold) is B, or the largest unit when B is
smaller: B = 0 streams one unit at a time. The kept set is membership, not gathered state: a kept
unit that something else released is gathered again at its next use and stays. It fills
during the first pass and is fixed afterwards, so every later pass gathers exactly the
units outside it: all-gather elements per pass = the padded elements of the non-kept units
the pass uses (0 when the model fits).

The kept units are dropped (released) when a pass with autograd starts, at
``engine.train()``, at the optimizer step and when ``engine.generate`` returns: training
runs within its own live window again.

Ranks in step: while some units stream, each pass issues all-gathers that every rank must
join. A rank whose decode loop stopped earlier (another ``max_new_tokens``, an early EOS
without ``synced_gpus``) would leave the others waiting in a collective, or pair their
gathers with its next unrelated collective. :func:`agree_on_generation` is one small
all-reduce at the start of every pass that follows a streaming pass (and where
``engine.generate`` returns): all ranks generating, or none, else every rank raises
:class:`GenerationDivergedError`.
"""
from __future__ import annotations

import torch

from zero_core.errors import ZeroCoreError


class GenerationDivergedError(ZeroCoreError):
    """Ranks ran different numbers of stage-3 decode passes while parameters streamed."""


class GenerationCache:
    """The kept set of the running generation (see the module docstring). *units*: the
    engine's fetch units; *budget*: B in elements."""

    def __init__(self, units, budget: int):
        sizes = [u.padded_numel for u in units if not u.persistent] or [0]
        self.budget = budget
        self.model_numel = sum(sizes)
        self.capacity = budget if self.model_numel <= budget else max(0, budget - max(sizes))
        # the live window of a generation pass: the budget, but never below one unit (a
        # unit shared by consecutive modules stays for the next one; one unit prefetches)
        self.window = max(budget, max(sizes))
        self.kept: set[int] = set()
        self.kept_numel = 0
        # a generation pass released a unit it had gathered: passes must stay in step
        self.streaming = False
        self.passes = 0  # generation passes since the last pass with autograd (messages)

    def keeps(self, u) -> bool:
        """Should *u* (gathered, not needed again in this pass) stay gathered?"""
        if u.index in self.kept:
            return True
        if self.kept_numel + u.padded_numel <= self.capacity:
            self.hold(u)
            return True
        return False

    def hold(self, u) -> None:
        """Keep *u* (whatever the capacity: engine.generate gathered the whole model and
        keeps it until training resumes)."""
        if not u.persistent and u.index not in self.kept:
            self.kept.add(u.index)
            self.kept_numel += u.padded_numel

    def drop(self, units, gatherer) -> None:
        """Release the kept units nothing else holds; the next generation starts empty."""
        for idx in self.kept:
            u = units[idx]
            if u.releasable and not u.released:
                gatherer.release(u)
        self.kept.clear()
        self.kept_numel = 0
        self.streaming = False
        self.passes = 0


def agree_on_generation(cache: GenerationCache, comm, device, generating: bool) -> None:
    """Collective: every rank says whether it starts another generation pass (False: it
    left the decode loop). Raises GenerationDivergedError on every rank when they differ."""
    flag = torch.tensor([1.0 if generating else 0.0], dtype=torch.float32, device=device)
    comm.all_reduce(flag)
    still = int(round(float(flag.item())))
    if 0 < still < comm.world_size:
        mine = ("starts decode pass" if generating else "had stopped after decode pass")
        raise GenerationDivergedError(
            f"stage-3 generation: ranks left the decode loop at different steps ({still} of "
            f"{comm.world_size} ranks went on; rank {comm.rank} {mine} {cache.passes}). With "
            f"fewer parameters kept gathered than the model has (generation.max_live_parameters "
            f"budget {cache.budget} elements, model {cache.model_numel}), every decode step "
            f"gathers parameters in collectives all ranks must join. Pass synced_gpus=True to "
            f"generate (engine.generate does when torch.distributed is initialized), give "
            f"every rank the same max_new_tokens and stopping rule, or raise "
            f"generation.max_live_parameters to hold the whole model")
