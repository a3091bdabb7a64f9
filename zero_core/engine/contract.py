"""What a ZeRO stage contributes to the shared engine: the :class:`StageParts` contract.

The engine (core.py) runs the same step at every stage: forward, backward with the loss
scaled, the global-norm all-reduce, skip/clip, the optimizer over the partitions, reports,
checkpoints. What differs between stage 0-2 and stage 3 is *where the model states live and
how gradients travel*: flat buffers per group reduced bucket by bucket
(``zero_core/stage0to2/parts.py``), or partitions per fetch unit gathered around each module
and reduce-scattered per unit (``zero_core/stage3/parts.py``). A stage says so by
implementing every abstract member below and nothing else reaches into the engine: the
engine holds one ``StageParts`` object (``engine.parts``) and calls it at the points named
here. ``factory.STAGE_PARTS`` maps a stage number to its class.

A stage gets a :class:`~zero_core.interfaces.engine_parts.BuildContext` (the config, the
communicator, the device, dtypes, the memory ledger), never the engine.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, ContextManager

if TYPE_CHECKING:
    import torch

    from zero_core.interfaces.engine_parts import (BuildContext, GradReducerProtocol,
                                                   GroupBuffersProtocol, ParamStoreProtocol)


class StageParts(ABC):
    """One stage's model-state layout and gradient path (see module docstring).

    After :meth:`build`, ``buffers`` holds one entry per optimizer parameter group: its flat
    buffers (:class:`~zero_core.interfaces.engine_parts.GroupBuffersProtocol`), or None for a
    group without trainable parameters; ``param_store`` is the parameter offload store that
    the offloaded optimizer writes updated values to (stage 3 with ``offload_param``), else
    None.
    """

    buffers: list[GroupBuffersProtocol | None]
    param_store: ParamStoreProtocol | None = None

    def __init__(self, ctx: BuildContext):
        self.ctx = ctx
        self.buffers = []

    # ---- construction, in the order the engine calls it -------------------------------------
    @abstractmethod
    def prepare_model(self, model: torch.nn.Module) -> None:
        """Put *model* on the device and make every rank start from the same values."""

    @abstractmethod
    def build(self, model: torch.nn.Module, groups: list[dict]) -> None:
        """Build ``buffers`` for the optimizer's parameter *groups* (empty for an inference
        engine) and whatever else the stage holds; the model computes in the compute dtype
        afterwards."""

    @abstractmethod
    def build_reducer(self, is_boundary: Callable[[], bool]) -> GradReducerProtocol:
        """The gradient reducer over ``buffers`` (hooks not registered yet); *is_boundary*
        says whether the running backward ends an accumulation window."""

    # ---- the step ----------------------------------------------------------------------------
    def after_update(self) -> None:
        """After every optimizer step, applied or skipped: drop what the update made stale."""

    def train(self, mode: bool) -> None:
        """The engine switched to training (*mode* True) or evaluation."""

    # ---- generation (zero_core/generation) -----------------------------------------------------
    @abstractmethod
    def gathered_model(self, module: torch.nn.Module,
                       keep: bool = False) -> ContextManager[torch.nn.Module]:
        """*module* with every parameter holding its full value, for a generate call; with
        *keep* the gathered values stay until training resumes."""

    def awaiting_backward(self) -> bool:
        """True between a forward with autograd and its backward (generation would free
        what backward needs)."""
        return False

    def generation_streams(self) -> bool:
        """True when a decode step gathers parameters (ranks must stay in step)."""
        return False

    def end_generation(self) -> None:
        """Generation is over: release what was kept for it."""

    # ---- checkpoints (zero_core/checkpoint/engine_state.py defines fragments) -----------------
    @abstractmethod
    def checkpoint_fragments(self, purpose: str, module: torch.nn.Module,
                             flat_state: list) -> list:
        """The fragments this rank saves (*purpose* "save") or fills ("load"), as views into
        its live state; *flat_state*: the optimizer's per-group flat states."""

    @abstractmethod
    def checkpoint_restored(self) -> None:
        """Collective, after a load filled the fragments: rebuild what derives from them."""

    @abstractmethod
    def checkpoint_layout(self, module: torch.nn.Module) -> list:
        """A JSON-able description of the partition layout, for the metadata."""

    # ---- the model, whole ---------------------------------------------------------------------
    @abstractmethod
    def state_dict(self, module: torch.nn.Module, rank0_only: bool,
                   exclude_frozen: bool) -> dict:
        """The model's full state dict in the compute dtype (``{}`` on ranks other than 0
        with *rank0_only*)."""

    @abstractmethod
    def hand_back_model(self, module: torch.nn.Module) -> torch.nn.Module:
        """Let go of *module* so that a new engine can adopt it: refuse (before changing
        anything) when that cannot be done now, else remove the stage's hooks and leave the
        parameters as a new engine adopts them. Collective."""

    @abstractmethod
    def parameter_numel(self, module: torch.nn.Module) -> int:
        """Elements of every parameter of the model (an inference engine's memory formula)."""

    # ---- reports and the end ------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Stage-specific entries added to ``engine.memory_report()``."""
        return {}

    def destroy(self) -> None:
        """Remove what the stage installed on the model (hooks); the model keeps its values."""
