"""What the engine's parts promise each other.

The engine (engine/core.py) and each stage's parts (stage0to2/parts.py, stage3/parts.py)
are assembled from parts that used to know each other only by duck typing. These
protocols say what each part offers, member by member, so that a new buffer layout,
reducer or parameter store can be written against them and the optimizer, the engine and
the checkpoints keep working unchanged:

* :class:`GroupBuffersProtocol` — one parameter group's flat buffers, as the optimizers
  (optim/partitioned.py, offload/optimizer.py), the engine and the checkpoint fragments
  (checkpoint/engine_state.py) use them; :class:`BucketBuffersProtocol` adds what stage
  0-2's gradient reducer needs, :class:`UnitBuffersProtocol` what stage 3 adds (fetch units);
* :class:`GradReducerProtocol` — what the engine calls on its gradient reducer;
* :class:`ParamSourceProtocol` — where stage 3's gatherer reads a fetch unit's partition
  from (device memory, or host memory / swap files under ``offload_param``), and
  :class:`ParamStoreProtocol`, the offloaded source that also holds the partitions;
* :class:`BuildContext` and :class:`CheckpointSubject` — the declared views that the parts
  below the engine get instead of the engine object (tests/test_architecture.py checks
  that no module below the engine takes or stores an engine).

Implementations declare conformance by subclassing (tests/test_engine_parts.py checks each
real implementation member by member): ``GroupBuffers`` (stage0to2/buffers.py),
``Stage3GroupBuffers`` and ``OffloadedStage3GroupBuffers`` (stage3/buffers.py),
``GradReducer`` (stage0to2/grad_reduce.py), ``Stage3GradReducer`` (stage3/grad_reduce.py),
``ResidentPartitions`` (stage3/gather.py) and ``ParamOffload`` (offload/params.py).

The protocols are ``runtime_checkable``. A stub method of a protocol is never a working
default: a class that subclasses one must define every member itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from zero_core.partitioning.flat_buffer import FlatBuffer
    from zero_core.partitioning.layout import GroupLayout


@runtime_checkable
class GroupBuffersProtocol(Protocol):
    """One parameter group's flat buffers, bucket *k* of ``layout`` at a time.

    ``state_kind`` and ``gathers_after_step`` are the buffers' answers to the two questions
    the optimizer used to answer by looking at the ZeRO stage:

    * ``state_kind`` — the FlatBuffer kind of the fp32 optimizer states (and of fp32
      gradient scratch): ``"full"`` when this rank updates every element of every bucket
      (stage 0; the optimizer may then hand whole parameters to a torch optimizer),
      ``"partition"`` when it updates its slice only (stages 1-3);
    * ``gathers_after_step`` — True when the updated slices must be all-gathered into
      ``param_buf`` after the step (stages 1-2: every rank keeps the full parameters);
      False when the step writes the low-precision values in place, into
      ``param_buf.bucket(k)`` (stage 0: the whole bucket; stage 3: the partition, gathered
      again at the next use).
    """

    params: list                   # the group's parameters, in layout order
    layout: GroupLayout
    param_buf: FlatBuffer          # low-precision parameters (full or this rank's partition)
    master: FlatBuffer | None      # fp32 master (mixed precision); the offloaded optimizer
    #                                replaces it with its store's (replace_master)
    mixed: bool                    # low-precision parameters with a separate fp32 master
    rank: int
    world_size: int
    state_kind: str                # "full" | "partition" (see above)
    gathers_after_step: bool       # see above

    @property
    def num_buckets(self) -> int: ...

    def master_bucket(self, k: int) -> torch.Tensor:
        """The fp32 values this rank updates for bucket *k*."""

    def reduced_grad_bucket(self, k: int) -> torch.Tensor:
        """This rank's reduced gradient for bucket *k* (compute dtype)."""

    def reduced_grad_tensors(self) -> list[torch.Tensor]:
        """Every reduced gradient element this rank owns (for the global norm)."""

    def zero_grads(self) -> None:
        """Clear accumulated gradients after a step."""

    def replace_master(self, master: FlatBuffer,
                       unit_master: Callable[[int], Any] | None) -> None:
        """The offloaded optimizer moved the fp32 master into its store: use *master*
        from now on (*unit_master(k)*: what receives stage 3's write-backs of unit *k*)."""


@runtime_checkable
class BucketBuffersProtocol(GroupBuffersProtocol, Protocol):
    """Stages 0-2: what GradReducer (stage0to2/grad_reduce.py) adds."""

    grad_buf: FlatBuffer | None    # full gradients, ``.grad`` views (stages 0-1)
    grad_part: FlatBuffer | None   # reduced-gradient accumulator (stage 2)

    def grad_view(self, i: int) -> torch.Tensor:
        """The ``.grad`` view of parameter *i* (stages 0-1)."""


@runtime_checkable
class UnitBuffersProtocol(GroupBuffersProtocol, Protocol):
    """Stage 3: a group laid out by fetch units (bucket *k* is ``units[k]``)."""

    units: list                    # FetchUnit, bucket order
    trainable: bool                # False for the frozen parameters' buffers
    grad_part: FlatBuffer | None   # reduced-gradient accumulator (trainable groups)


@runtime_checkable
class GradReducerProtocol(Protocol):
    """What the engine calls on its gradient reducer (built by ``_build_reducer``)."""

    def register_hooks(self) -> None:
        """Install the per-parameter gradient hooks."""

    def remove_hooks(self) -> None:
        """Uninstall them (``engine.destroy``)."""

    def flush(self) -> None:
        """End of a backward: launch every reduction not launched yet."""

    def wait_all(self) -> None:
        """Block until every launched reduction has landed."""

    def mark_fresh(self) -> None:
        """After a step: the next reduction overwrites the accumulators."""

    @property
    def communication_buffers(self) -> int:
        """Pooled communication buffers allocated so far (count)."""


@runtime_checkable
class ParamSourceProtocol(Protocol):
    """Where stage 3's UnitGatherer (stage3/gather.py) reads a fetch unit's partition.

    ``fetch(u)`` gives this rank's partition of *u* on the compute device, to all-gather
    from; ``fetched(u)`` follows once that collective completed (or the gather was
    dropped), so whatever ``fetch`` staged can be reused; ``write_unit(u, values)`` stores
    new partition values (GatheredParameters modified the unit). A source may read these
    members of a unit: ``index``, ``part``, ``released``, ``wait_collective()``.
    """

    def fetch(self, unit) -> torch.Tensor: ...

    def fetched(self, unit) -> None: ...

    def write_unit(self, unit, values: torch.Tensor) -> None: ...


@runtime_checkable
class ParamStoreProtocol(ParamSourceProtocol, Protocol):
    """A parameter source that holds the partitions itself (``offload_param``), as the
    stage-3 group buffers, the stage-3 engine and the offloaded optimizer use it."""

    def place_group(self, layout: GroupLayout, units: list) -> tuple[FlatBuffer, list]:
        """Storage for one group's partitions: its ``param_buf`` and each unit's ``part``."""

    def write_initial(self, unit, values: torch.Tensor) -> None:
        """Store *unit*'s first partition values (synchronously)."""

    def read_partition(self, group: UnitBuffersProtocol, k: int) -> torch.Tensor:
        """A host copy of unit *k*'s partition of *group*."""

    def write_piece(self, group: UnitBuffersProtocol, k: int, offset: int,
                    values: torch.Tensor) -> None:
        """Updated values for elements ``[offset, offset + n)`` of unit *k*'s partition."""

    def flush(self) -> None:
        """End of the optimizer step: every written value is stored."""

    def attach(self, coordinator) -> None:
        """Read ahead along *coordinator*'s recorded execution order (``trace.upcoming()``)."""

    def report(self) -> dict:
        """Where the partitions are and the bytes moved (``memory_report()['offload']``)."""


# ---- the views lower layers get instead of the engine ------------------------------------------
@dataclass(frozen=True)
class BuildContext:
    """What a stage (engine/contract.py), the offload stores, the offloaded optimizer and
    ZeRO++ need to build themselves: the engine's settings, never the engine. Built once
    by the engine (``engine.build_context``)."""

    config: Any                    # zero_core.config.Config
    comm: Any                      # the ranks the stage partitions over, as a Communicator
    #                                (every rank, or MiCS's shard group: runtime/partition_comm.py)
    world_comm: Any                # every rank: what the whole job must agree on (the model
    #                                it starts from)
    accelerator: Any               # the Accelerator
    kernels: Any                   # the KernelSet
    device: torch.device
    rank: int
    world_size: int
    stage: int
    compute_dtype: torch.dtype
    master_dtype: torch.dtype      # fp32, or bf16 with bf16.bf16_master_weights_and_grads
    state_dtype: torch.dtype       # optimizer states: fp32, or bf16 (bf16_optimizer_states)
    memory_ledger: Any             # zero_core.memory.MemoryLedger
    inference_only: bool           # built without an optimizer: every parameter frozen


@dataclass(frozen=True)
class CheckpointSubject:
    """What a checkpoint save or load (checkpoint/save_load.py, deepspeed_resume.py) sees
    of an engine; the engine builds one per call (``engine.checkpoint_subject()``).

    ``fragments(purpose)``, ``restored()`` and ``layout()`` are the stage's (see
    checkpoint/engine_state.py for what a fragment is); ``counters`` are the step counters
    at the call, and ``set_counters(global_steps, micro_steps, skipped_steps)`` writes them
    back on load."""

    module: Any                    # torch.nn.Module
    comm: Any
    device: torch.device
    rank: int
    world_size: int
    stage: int
    engine_name: str
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    state_dtype: torch.dtype
    gradient_accumulation_steps: int
    optimizer: Any                 # None for an inference engine
    lr_scheduler: Any
    loss_scaler: Any
    rule: Any                      # optim.rules.UpdateRule, or None
    counters: dict
    fragments: Callable[[str], list]
    restored: Callable[[], None]
    layout: Callable[[], list]
    set_counters: Callable[[int, int, int], None]
    #: train_batch_size, micro batch, accumulation steps (resume compares the global batch)
    batch: dict | None = None
    #: the engine's data position (zero_core.data.ResumableSampler's state) or None; saved
    #: in common.pt, handed back with ``restore_data(state)`` on load
    data_state: Callable[[], dict | None] | None = None
    restore_data: Callable[[dict], None] | None = None
