"""When stage 3 gathers, prefetches and releases each fetch unit.

* forward: a module's pre-hook requests its units (gathered before it runs, then the
  next recorded units are prefetched); its post-hook releases each unit no running
  module uses, unless the unit is persistent, pinned, reused within
  ``stage3_max_reuse_distance`` elements while the live window allows, or one the
  prefetcher would gather again before its next use anyway (``_regathered_anyway``:
  within a prefetch bucket, with room in the live window for it and everything
  requested before). Releasing such a unit frees no memory the window would not fill
  again and costs one all-gather: at the end of a forward the units that open the
  backward are the ones it keeps, as DeepSpeed's coordinator does (issue 17 §2);
* backward: a hook on the module's outputs requests its units again before the module's
  backward; a unit is released as soon as every trainable parameter in it has delivered
  its gradient (the gradient reducer says so), and whatever is left at the end of
  backward is released;
* after the optimizer step every unit is released (the partitions changed), persistent
  ones included; they are gathered again at their first use;
* passes without autograd (decode steps, evaluation) also keep units across passes, within
  the generation budget (generation_cache.py); the live window of such a pass is that
  budget.

Prefetch never lets the live window (gathered or in-flight elements of non-persistent
units) exceed the pass's bound (``stage3_max_live_parameters``; in a pass without autograd
the generation budget), nor runs more than
``stage3_prefetch_bucket_size`` elements ahead of the request being served.

The coordinator is the only one that changes a unit's use counts (running forwards, pins,
the hold until backward; units.py) and it adopts its engine's units and parameters: it is
their ``owner``, which GatheredParameters finds through a unit and which answers a read of
a released parameter with the error naming this engine's running module.
"""
from __future__ import annotations

import torch

from zero_core.stage3 import partitioned_params as pp
from zero_core.stage3.gather import UnitGatherer
from zero_core.stage3.generation_cache import GenerationCache, agree_on_generation
from zero_core.stage3.prefetch import LOOKAHEAD, ExecutionTrace
from zero_core.stage3.units import FetchUnit


class ParamCoordinator:
    """Owns the gather/release decisions for *units* (see module docstring)."""

    def __init__(self, units: list[FetchUnit], gatherer: UnitGatherer, prefetch_bucket_size: int,
                 max_live_parameters: int, max_reuse_distance: int,
                 generation_budget: int | None = None):
        self.units = units
        for u in units:
            u.owner = self   # GatheredParameters finds the coordinator through its units
            for p in u.params:
                pp.meta_of(p).owner = self   # reads of released parameters ask this engine
        self.gatherer = gatherer
        self.prefetch_bucket_size = prefetch_bucket_size
        self.max_live = max_live_parameters
        self.max_reuse = max_reuse_distance
        # passes without autograd keep units across passes (generation_cache.py); their
        # live window is the generation budget instead of max_live
        self.generation = GenerationCache(
            units, max_live_parameters if generation_budget is None else generation_budget)
        self.generating = False
        self.window = max_live_parameters
        # a pass without autograd that finds every unit gathered and the whole model kept
        # needs no request, release or trace: the module hooks return at once (their
        # bookkeeping was most of stage-3 decoding's cost over the plain model)
        self.whole_model_kept = False
        self.trace = ExecutionTrace([u.padded_numel for u in units])
        # the prefetcher's scan (see _prefetch): recorded positions [pos, _scan_pos) were
        # started by an earlier scan of this pass; _ahead[i] = non-persistent elements
        # of the recording's first i requests
        self._scan_pos = 0
        self._ahead: list[int] = [0]
        self.module_stack: list[str] = []
        self.prefetched = 0
        # a forward with autograd on ran and its backward has not finished yet
        self.awaiting_backward = False
        # bumped whenever the partitions may have changed (release_all), so that values
        # saved for backward before that can tell they are stale (saved_views.py)
        self.partition_epoch = 0

    # ---- passes --------------------------------------------------------------------------
    def start_pass(self, key) -> None:
        """*key*: (module.training, autograd enabled) of the root forward starting."""
        generating = not key[1]
        gen = self.generation
        self._agree_if_streamed(generating)
        if generating:
            gen.passes += 1
        elif gen.kept or gen.passes:
            gen.drop(self.units, self.gatherer)   # training resumes in its own window
        self.generating = generating
        self.window = gen.window if generating else self.max_live
        self.whole_model_kept = (generating and gen.kept_numel == gen.model_numel
                                 and not any(u.released for u in self.units))
        self.trace.begin(key)
        self.awaiting_backward = bool(key[1])
        self._scan_pos = 0
        self.gatherer.released_since_scan.clear()
        if self.trace.following:
            ahead = [0]
            for idx in self.trace.recorded:
                u = self.units[idx]
                ahead.append(ahead[-1] + (0 if u.persistent else u.padded_numel))
            self._ahead = ahead

    @staticmethod
    def in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    # ---- the owner of the engine's parameters (partitioned_params.py) ----------------------
    def running_module(self) -> str | None:
        """The module whose forward is running in this engine (for error messages)."""
        return self.module_stack[-1] if self.module_stack else None

    def read_released(self, func, args, kwargs, released):
        """A torch function read a released parameter of this engine: the error names it
        and the module running."""
        raise pp.not_gathered_error(released[0], func)

    # ---- requests ------------------------------------------------------------------------
    def request(self, units: list[FetchUnit]) -> None:
        """Gather *units* now (they are about to be used) and prefetch what follows."""
        for u in units:
            self.trace.record(u.index)
        with self.gatherer.computing():
            self.gatherer.ensure(units)
            if self.trace.following and self.prefetch_bucket_size > 0:
                self._prefetch()

    def _prefetch(self) -> None:
        """Start the gathers of the recorded requests after the current one: persistent
        units always, the others while they stay within prefetch_bucket_size elements of
        the current request and the live window has room; stop at the first that does not.

        Each scan resumes where the previous scan of this pass stopped (_scan_pos): the
        requests in between were started then and are still gathered, unless released
        since (the gatherer lists those; then the scan restarts at pos). Scanning from pos
        every time cost LOOKAHEAD checks per module call, a quarter of stage 3's host
        overhead on small modules (ci/gpu/check.py --profile)."""
        t, g = self.trace, self.gatherer
        pos = t.pos
        scan = max(self._scan_pos, pos)
        if g.released_since_scan:
            for idx in g.released_since_scan:
                at = t.next_use(idx)
                if at is not None and at < scan:
                    scan = pos
                    break
            g.released_since_scan.clear()
        end = t.lookahead_end()
        rec, ahead, base = t.recorded, self._ahead, self._ahead[pos]
        while scan < end:
            u = self.units[rec[scan]]
            if not u.persistent:
                if ahead[scan + 1] - base > self.prefetch_bucket_size:
                    break
                if u.released:
                    if g.live_numel + u.padded_numel > self.window:
                        break
                    self.prefetched += 1
            g.start(u)
            scan += 1
        self._scan_pos = scan

    def before_forward(self, units: list[FetchUnit]) -> None:
        """A module's forward starts: its units are in use until ``after_forward``."""
        for u in units:
            u.enter_forward()
        self.request(units)

    # ---- releases ------------------------------------------------------------------------
    def after_forward(self, units: list[FetchUnit]) -> None:
        """A module's forward finished: release the units nobody needs soon."""
        for u in units:
            u.exit_forward()
            if not u.releasable or u.released:
                continue
            if self.generating and self.generation.keeps(u):
                continue
            at = self.trace.next_use(u.index)
            if at is not None and (
                    (self.trace.elements_until(at) <= self.max_reuse
                     and self.gatherer.live_numel <= self.window)
                    or self._regathered_anyway(at)):
                continue
            if self.generating:
                self.generation.streaming = True
            self.gatherer.release(u)

    def _regathered_anyway(self, at: int) -> bool:
        """Would the prefetcher gather a unit (gathered, not persistent) again before its
        next use, at recorded position *at*, if it were released now? True when that use
        is within prefetch_bucket_size elements (counted as _prefetch counts them) and the
        live window holds the unit together with every released unit requested before it,
        so that keeping it delays no nearer prefetch. The window check first takes every
        request in between as a new gather (O(1), enough unless the window is nearly
        full); only then, and only for a use within LOOKAHEAD requests, does it count the
        released units one by one."""
        t = self.trace
        if self.prefetch_bucket_size <= 0:
            return False
        ahead, pos = self._ahead, t.pos
        if ahead[at + 1] - ahead[pos] > self.prefetch_bucket_size:
            return False
        live = self.gatherer.live_numel
        if live + ahead[at] - ahead[pos] <= self.window:
            return True
        if at - pos > LOOKAHEAD:
            return False
        need, counted = live, set()
        for idx in t.recorded[pos:at]:
            v = self.units[idx]
            if v.released and not v.persistent and idx not in counted:
                counted.add(idx)
                need += v.padded_numel
        return need <= self.window

    def grads_done(self, u: FetchUnit) -> None:
        """Every trainable parameter of *u* delivered its gradient in this backward."""
        if u.releasable:
            self.gatherer.release(u)

    def end_backward(self) -> None:
        """Release every unit no forward, pin or persistence holds."""
        self.awaiting_backward = False
        for u in self.units:
            u.drop_backward_hold()
            if not u.released and u.releasable:
                self.gatherer.release(u)

    def end_generation(self) -> None:
        """engine.generate returned (or training resumes): every rank agrees it left the
        decode loop when parameters streamed, then the kept units are released."""
        self._agree_if_streamed(False)
        self.whole_model_kept = False
        self.generation.drop(self.units, self.gatherer)

    def _agree_if_streamed(self, generating: bool) -> None:
        """After a generation pass that streamed units, every rank must be at the same
        decode step (generation_cache.agree_on_generation)."""
        if self.generation.streaming and self.gatherer.comm.world_size > 1:
            agree_on_generation(self.generation, self.gatherer.comm, self.gatherer.device,
                                generating)

    def release_all(self) -> None:
        """After the optimizer step: every gathered copy is stale."""
        self.awaiting_backward = False
        self.partition_epoch += 1
        self.whole_model_kept = False
        self.generation.drop(self.units, self.gatherer)
        for u in self.units:
            u.drop_backward_hold()
            if not u.released and not u.in_use:
                self.gatherer.release(u)

    # ---- pins (GatheredParameters) -------------------------------------------------------
    def pin(self, units: list[FetchUnit]) -> None:
        for u in units:
            u.pin()
        self.gatherer.ensure(units)

    def keep_for_generation(self, units: list[FetchUnit]) -> None:
        """Unpin *units* but keep them gathered until training resumes (the generation
        cache's kept set, whatever its capacity: the caller gathered them all)."""
        for u in units:
            u.unpin()
            self.generation.hold(u)

    def unpin(self, units: list[FetchUnit], keep_for_backward: bool) -> None:
        for u in units:
            u.unpin()
            if keep_for_backward:
                u.hold_for_backward()
            elif (u.releasable and not u.released
                  and u.index not in self.generation.kept):   # kept ones go with the kept set
                self.gatherer.release(u)
