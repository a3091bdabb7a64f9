"""Activation checkpointing with ZeRO-R's partitioned, host-offloaded and contiguous
checkpoints (DeepSpeed's ``deepspeed.checkpointing`` API).

``checkpoint(fn, *args, **kwargs)`` runs ``fn`` without keeping its intermediate
activations: only the inputs are saved, and backward calls ``fn`` again on them, with the
random-number state (CPU and accelerator) and autocast settings of the first call, so
dropout draws the same masks. ``configure(...)`` chooses how the saved inputs are kept,
with DeepSpeed's ``activation_checkpointing`` config keys:

* ``partition_activations`` (argument ``partition_activations``): each rank of the
  model-parallel group keeps 1/mp of every saved tensor; backward all-gathers the whole
  before the recompute (one uint8 all-gather per checkpoint, through the Communicator);
* ``cpu_checkpointing`` (``checkpoint_in_cpu``): the saved inputs are kept in host memory
  (pinned through the accelerator where it pins) and copied back in backward;
* ``contiguous_memory_optimization`` (``contiguous_checkpointing``): the saved inputs of the
  k-th checkpoint of a forward pass are copied into buffer k of ``number_checkpoints``
  buffers allocated once and reused every step (``zero_core.activation.buffers``);
* ``number_checkpoints`` (``num_checkpoints``): that buffer count, i.e. the number of
  checkpointed calls in one forward pass; more live checkpoints than that is an error;
* ``synchronize_checkpoint_boundary`` (``synchronize``): ``accelerator.synchronize()``
  before and after each checkpoint's forward and backward;
* ``profile`` (``profile``): the time of each forward and backward (recompute included) is
  logged at INFO on the ``zero_core.checkpointing`` logger and summed in
  :func:`profile_summary`.

Differences from DeepSpeed: ``cpu_checkpointing`` and ``contiguous_memory_optimization``
also work without ``partition_activations`` (DeepSpeed ignores the first and refuses the
second then); the whole tensors are offloaded/defragmented instead of the partitions.

What is saved: with none of the three options, the tensor arguments as they are (no copy,
like torch's checkpoint). With any of them, every tensor argument (also inside lists,
tuples and dicts) is copied into the checkpoint's byte payload, except ``nn.Parameter``\\ s,
which the module keeps alive anyway, and tensors on another device than the first saved
one: those are saved by reference. With partitioning, **the saved tensors must be
identical on every rank of the model-parallel group** (as the input of a Megatron-style
tensor-parallel layer is): each rank keeps only its chunk.
Non-tensor arguments are passed to the recompute as they are.

Contract with hook-driven parameter gathering (ZeRO stage 3)
------------------------------------------------------------
The first forward runs ``fn`` under ``torch.no_grad()``. Backward calls the same ``fn``
again — the same Python callable on rebuilt inputs, never a replay of recorded results —
under ``torch.enable_grad()``, from inside the autograd engine's backward of this
checkpoint; :func:`is_recomputing` is True during the recompute and its backward. So, per
step:

* module forward pre-hooks and forward hooks inside ``fn`` fire twice: in the forward and
  in the recompute (a pre-hook that gathers a module's parameters gathers them again);
* the recomputed graph's backward runs right after the recompute, inside the same call,
  before this checkpoint's input gradients are returned: module backward hooks and
  parameter gradient hooks (``register_post_accumulate_grad_hook``) fire there;
* parameters a pre-hook gathers must still hold their data when the module's backward
  runs; a forward hook that releases them must be matched by a backward pre-hook that
  gathers them again (what stage 3 does anyway).

Backward must be started with ``.backward()`` (``torch.autograd.grad`` is refused: the
recompute's backward accumulates into ``.grad``). Under ``torch.no_grad()`` ``checkpoint``
just calls ``fn``.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from zero_core.activation import rng as activation_rng
from zero_core.activation.buffers import SlotBuffers
from zero_core.activation.layout import plan, read_all, write_part
from zero_core.activation.partition import ModelParallel, resolve_model_parallel
from zero_core.config import ActivationCheckpointingConfig, Config, parse_activation_checkpointing
from zero_core.errors import ConfigError, ZeroCoreError

__all__ = ["checkpoint", "configure", "is_configured", "reset", "deconfigure", "is_recomputing",
           "memory_stats", "profile_summary", "settings"]

log = logging.getLogger("zero_core.checkpointing")

HOST = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Process-wide configuration.
# ---------------------------------------------------------------------------------------------

@dataclass
class _State:
    settings: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    configured: bool = False
    mp: ModelParallel | None = None
    slots: SlotBuffers | None = None     # made at the first checkpoint (its device is known then)
    accelerator: Any = None              # resolved on first need
    # accounting of live checkpoints (bytes they store, by our own count)
    live: int = 0
    stored_bytes: int = 0
    peak_stored_bytes: int = 0
    calls: int = 0
    profile: dict = field(default_factory=lambda: {"forward": [0, 0.0], "recompute": [0, 0.0]})
    # re-entrant: a garbage collection inside a locked block may run _forget's finalizer
    lock: threading.RLock = field(default_factory=threading.RLock)


_STATE = _State()
_LOCAL = threading.local()  # .recomputing: depth of recomputes running on this thread


def _runtime_comm():
    from zero_core.runtime.context import get_runtime
    return get_runtime().comm


def _accelerator():
    """The runtime's accelerator, or (no runtime yet) the one the registry would pick."""
    if _STATE.accelerator is None:
        from zero_core.runtime import context as runtime
        rt = runtime._RUNTIME
        if rt is not None:
            _STATE.accelerator = rt.accelerator
        else:
            from zero_core.runtime import registry
            _STATE.accelerator = registry.load().accelerator_class()()
    return _STATE.accelerator


def _section_of(deepspeed_config) -> ActivationCheckpointingConfig:
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, Config):
        return deepspeed_config.activation_checkpointing
    if isinstance(deepspeed_config, (str, os.PathLike)):
        text = os.fspath(deepspeed_config)
        try:
            if isinstance(text, str) and text.lstrip().startswith("{"):
                data = json.loads(text)
            else:
                with open(text, encoding="utf-8") as fh:
                    data = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"activation checkpointing: cannot read deepspeed_config "
                              f"{text!r}: {exc}; pass a dict, a JSON file path or a "
                              f"Config") from None
        deepspeed_config = data
    if isinstance(deepspeed_config, Mapping):
        return parse_activation_checkpointing(deepspeed_config.get("activation_checkpointing"))
    raise ConfigError(f"activation checkpointing: deepspeed_config must be a dict, a path to a "
                      f"JSON file, JSON text, a zero_core Config or None, not "
                      f"{type(deepspeed_config).__name__}")


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"activation checkpointing: {name}={value!r} must be True or False")
    return value


def configure(mpu_=None, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None) -> None:
    """Set how :func:`checkpoint` keeps its saved inputs (DeepSpeed's signature).

    *mpu_*: the model-parallel unit, needed for *partition_activations* (what is accepted:
    see ``zero_core.activation.partition``). *deepspeed_config*: a DeepSpeed config (dict,
    JSON path or text, :class:`~zero_core.config.Config`) whose ``activation_checkpointing``
    section gives the defaults; the other arguments, when not None, override its keys:
    *partition_activations* (partition_activations), *contiguous_checkpointing*
    (contiguous_memory_optimization), *num_checkpoints* (number_checkpoints, an integer >=
    1), *checkpoint_in_cpu* (cpu_checkpointing), *synchronize*
    (synchronize_checkpoint_boundary), *profile* (profile).

    Every call replaces the whole configuration; checkpoints already taken keep the one they
    were taken with. Raises ConfigError for a value or combination that cannot work.
    """
    base = _section_of(deepspeed_config)
    overrides = {}
    for key, value in (("partition_activations", partition_activations),
                       ("contiguous_memory_optimization", contiguous_checkpointing),
                       ("cpu_checkpointing", checkpoint_in_cpu),
                       ("synchronize_checkpoint_boundary", synchronize), ("profile", profile)):
        if value is not None:
            overrides[key] = _flag(key, value)
    if num_checkpoints is not None:
        if isinstance(num_checkpoints, bool) or not isinstance(num_checkpoints, int) \
                or num_checkpoints < 1:
            raise ConfigError(f"activation checkpointing: num_checkpoints={num_checkpoints!r} must "
                              f"be an integer >= 1 (the number of checkpointed calls per forward "
                              f"pass)")
        overrides["number_checkpoints"] = num_checkpoints
    settings = replace(base, **overrides)
    if settings.contiguous_memory_optimization and settings.number_checkpoints is None:
        raise ConfigError("activation checkpointing: contiguous_memory_optimization needs "
                          "number_checkpoints (num_checkpoints=...), the number of checkpointed "
                          "calls in one forward pass, to size its buffers")
    if settings.partition_activations and mpu_ is None:
        raise ConfigError("activation checkpointing: partition_activations needs the "
                          "model-parallel group the activations are replicated across: call "
                          "configure(mpu_=...) with an object whose get_model_parallel_group() "
                          "returns a zero_core Group (comm.new_group(ranks)), or with the Group "
                          "itself; without model parallelism, leave partition_activations off")
    mp = resolve_model_parallel(mpu_, _runtime_comm) if mpu_ is not None else None
    global _STATE
    accelerator = _STATE.accelerator
    _STATE = _State(settings=settings, configured=True, mp=mp, accelerator=accelerator)


def is_configured() -> bool:
    """True once :func:`configure` has been called (and not undone by :func:`deconfigure`)."""
    return _STATE.configured


def settings() -> ActivationCheckpointingConfig:
    """The configuration :func:`checkpoint` uses now (all off when never configured)."""
    return _STATE.settings


def reset() -> None:
    """Free every contiguous buffer for reuse (DeepSpeed's ``reset``).

    Backward frees a checkpoint's buffer by itself; call this after forward passes that are
    never followed by backward while their outputs are still referenced (evaluation with
    gradients enabled). A checkpoint whose buffer was reused since refuses its backward.
    The buffers themselves stay allocated.
    """
    if _STATE.slots is not None:
        _STATE.slots.release_all()


def deconfigure() -> None:
    """Forget the configuration and drop the buffers (tests, or before configuring a new
    model); :func:`is_configured` is False again."""
    global _STATE
    _STATE = _State(accelerator=_STATE.accelerator)


def is_recomputing() -> bool:
    """True on this thread while a checkpoint's backward runs: during the recompute of its
    function and the backward of the recomputed graph (module hooks can tell these from the
    first forward and from the rest of the backward)."""
    return getattr(_LOCAL, "recomputing", 0) > 0


def memory_stats() -> dict:
    """What checkpoints hold now, by zero-core's own count, in bytes.

    ``live_checkpoints``: checkpoints whose backward has not run; ``stored_bytes`` /
    ``peak_stored_bytes``: bytes of the inputs they keep (payload chunks when partitioning,
    whole tensors otherwise; parameters kept by reference count 0);
    ``contiguous_buffers`` (index, nbytes, data_ptr, held), ``contiguous_buffer_bytes``,
    ``contiguous_allocations``, ``contiguous_reallocations``, ``buffer_device``.
    """
    s = _STATE
    slots = s.slots
    return {
        "live_checkpoints": s.live, "stored_bytes": s.stored_bytes,
        "peak_stored_bytes": s.peak_stored_bytes, "checkpoint_calls": s.calls,
        "contiguous_buffers": slots.describe() if slots else [],
        "contiguous_buffer_bytes": slots.total_bytes if slots else 0,
        "contiguous_allocations": slots.allocations if slots else 0,
        "contiguous_reallocations": slots.reallocations if slots else 0,
        "buffer_device": str(slots.device) if slots else None,
    }


def profile_summary() -> dict:
    """With ``profile`` on: ``{"forward": {"calls", "seconds"}, "recompute": {...}}``; the
    recompute time includes the gather of partitioned inputs and the inner backward."""
    return {phase: {"calls": calls, "seconds": seconds}
            for phase, (calls, seconds) in _STATE.profile.items()}


# ---------------------------------------------------------------------------------------------
# Argument trees: tensors may sit inside tuples, lists and dicts.
# ---------------------------------------------------------------------------------------------

def _flatten(obj, leaves: list) -> Any:
    """Append the leaves of *obj* to *leaves*; return the spec :func:`_unflatten` needs."""
    if isinstance(obj, (tuple, list)):
        specs = [_flatten(x, leaves) for x in obj]
        return (type(obj), specs)
    if isinstance(obj, dict):
        return (type(obj), list(obj.keys()), [_flatten(v, leaves) for v in obj.values()])
    leaves.append(obj)
    return None


def _unflatten(spec, leaves_iter) -> Any:
    if spec is None:
        return next(leaves_iter)
    if len(spec) == 3:
        kind, keys, specs = spec
        return kind(zip(keys, (_unflatten(s, leaves_iter) for s in specs)))
    kind, specs = spec
    items = [_unflatten(s, leaves_iter) for s in specs]
    if kind is tuple or kind is list:
        return kind(items)
    if hasattr(kind, "_fields"):  # namedtuple
        return kind(*items)
    return kind(items)


# ---------------------------------------------------------------------------------------------
# The autograd function.
# ---------------------------------------------------------------------------------------------

class _Account:
    """One checkpoint's share of the live accounting."""

    __slots__ = ("stored", "live")

    def __init__(self):
        self.stored = 0
        self.live = False  # counted in _State.live until backward or the graph's end


class _Token:
    """Lives exactly as long as one checkpoint's autograd node (only the node's context
    refers to it): the claim on its contiguous buffer, and the trigger that removes it from
    the live accounting if the graph is dropped without a backward."""

    __slots__ = ("__weakref__", "account")

    def __init__(self):
        self.account = _Account()


def _forget(state: _State, account: _Account) -> None:
    """Remove a checkpoint from the live accounting, once (after its backward, or when its
    graph was dropped without one)."""
    with state.lock:
        if not account.live:
            return
        account.live = False
        state.live -= 1
        state.stored_bytes -= account.stored


@dataclass
class _Call:
    """Everything one checkpointed call needs in backward besides the saved tensors."""

    fn: Callable
    spec: Any                       # tree spec of (args, kwargs)
    leaves: list                    # their leaves, tensors replaced by None
    tensor_slots: list[int]         # positions of the tensor leaves
    state: _State
    index: int = 0                  # n-th checkpoint call of this process (profile)
    # how the tensors were stored
    packed: list[int] = field(default_factory=list)    # tensor numbers in the payload
    by_ref: list[int] = field(default_factory=list)    # tensor numbers saved as they are
    specs: list = field(default_factory=list)
    payload_bytes: int = 0
    parts: int = 1
    device: torch.device | None = None                 # where the packed tensors lived
    plain: bool = True                                 # saved with save_for_backward as is
    slot: int | None = None
    slots: SlotBuffers | None = None
    token: _Token | None = None
    rng: activation_rng.CallState | None = None
    out_spec: Any = None
    out_leaves: list = field(default_factory=list)
    out_tensor_slots: list[int] = field(default_factory=list)

    def arguments(self, tensors):
        leaves = list(self.leaves)
        for pos, t in zip(self.tensor_slots, tensors):
            leaves[pos] = t
        args, kwargs = _unflatten(self.spec, iter(leaves))
        return args, kwargs


def _transforms(settings: ActivationCheckpointingConfig) -> bool:
    return (settings.partition_activations or settings.cpu_checkpointing
            or settings.contiguous_memory_optimization)


def _store(ctx, call: _Call, tensors: tuple) -> None:
    """Save *tensors* for backward the way the configuration says."""
    st, settings = call.state, call.state.settings
    if not _transforms(settings):
        ctx.save_for_backward(*tensors)
        call.token.account.stored = sum(t.numel() * t.element_size() for t in tensors
                                if not isinstance(t, torch.nn.Parameter))
        return
    call.plain = False
    device = next((t.device for t in tensors if not isinstance(t, torch.nn.Parameter)), None)
    for i, t in enumerate(tensors):
        packable = not isinstance(t, torch.nn.Parameter) and t.device == device
        (call.packed if packable else call.by_ref).append(i)
    call.device = device
    if settings.partition_activations and call.state.mp is not None:
        call.parts, part_index = call.state.mp.size, call.state.mp.rank
    else:
        call.parts, part_index = 1, 0
    packed = [tensors[i] for i in call.packed]
    call.specs, call.payload_bytes = plan(packed, call.parts)
    where = HOST if settings.cpu_checkpointing else (device or HOST)
    pin = _accelerator().pin_memory if where.type == "cpu" and device is not None \
        and device.type != "cpu" else None
    if settings.contiguous_memory_optimization:
        if st.slots is None or st.slots.device != where:
            st.slots = SlotBuffers(settings.number_checkpoints, where, pin)
        call.slot, payload = st.slots.claim(call.payload_bytes, call.token)
        call.slots = st.slots
    else:
        payload = torch.empty(call.payload_bytes, dtype=torch.uint8, device=where)
        if pin is not None:
            payload = pin(payload)
    write_part(payload, packed, call.specs, part_index)
    ctx.save_for_backward(payload, *(tensors[i] for i in call.by_ref))
    call.token.account.stored = call.payload_bytes


def _restore(ctx, call: _Call) -> list[torch.Tensor]:
    """The saved tensors, whole again and on their device."""
    settings = call.state.settings
    if call.slot is not None and not call.slots.holds(call.slot, call.token):
        raise ZeroCoreError(
            f"activation checkpointing: the contiguous buffer {call.slot} of this checkpoint was "
            f"taken by a later checkpointed call before this backward ran (reset() was called, "
            f"or more than number_checkpoints={settings.number_checkpoints} checkpoints were "
            f"alive); raise number_checkpoints or run backward before the next forward")
    saved = ctx.saved_tensors
    if call.plain:
        return list(saved)
    payload, refs = saved[0], saved[1:]
    if call.device is not None and payload.device != call.device:
        payload = payload.to(call.device, non_blocking=True)
    if call.parts > 1:
        matrix = call.state.mp.all_gather(payload)
    else:
        matrix = payload.view(1, call.payload_bytes)
    out: list = [None] * (len(call.packed) + len(call.by_ref))
    for i, t in zip(call.packed, read_all(matrix, call.specs)):
        out[i] = t
    for i, t in zip(call.by_ref, refs):
        out[i] = t
    return out


def _synchronize(call: _Call) -> None:
    if call.state.settings.synchronize_checkpoint_boundary:
        _accelerator().synchronize()


def _record(call: _Call, phase: str, start: float) -> None:
    if not call.state.settings.profile:
        return
    seconds = time.perf_counter() - start
    entry = call.state.profile[phase]
    entry[0] += 1
    entry[1] += seconds
    log.info("activation checkpoint #%d %s: %.3f ms", call.index, phase, seconds * 1e3)


class _CheckpointFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, call: _Call, dummy: torch.Tensor, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        _synchronize(call)
        start = time.perf_counter()
        call.rng = activation_rng.capture(activation_rng.accelerator_devices(tensors))
        args, kwargs = call.arguments(tensors)
        with torch.no_grad():
            outputs = call.fn(*args, **kwargs)
        out_leaves: list = []
        call.out_spec = _flatten(outputs, out_leaves)
        call.out_tensor_slots = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        call.out_leaves = [None if isinstance(x, torch.Tensor) else x for x in out_leaves]
        out_tensors = tuple(out_leaves[i] for i in call.out_tensor_slots)
        _store(ctx, call, tensors)
        state = call.state
        with state.lock:
            call.token.account.live = True
            state.live += 1
            state.stored_bytes += call.token.account.stored
            state.peak_stored_bytes = max(state.peak_stored_bytes, state.stored_bytes)
        ctx.mark_non_differentiable(*(t for t in out_tensors if not t.is_floating_point()
                                      and not t.is_complex()))
        ctx.call = call
        _synchronize(call)
        _record(call, "forward", start)
        return out_tensors

    @staticmethod
    def backward(ctx, *grads):
        call: _Call = ctx.call
        if not torch.autograd._is_checkpoint_valid():
            raise ZeroCoreError("activation checkpointing: backward through a checkpoint must be "
                                "started with .backward(); torch.autograd.grad(...) is not "
                                "supported (the recompute's gradients go to .grad)")
        _synchronize(call)
        start = time.perf_counter()
        saved = _restore(ctx, call)
        inputs = [t.detach().requires_grad_(needs) for t, needs in
                  zip(saved, ctx.needs_input_grad[2:])]
        args, kwargs = call.arguments(inputs)
        _LOCAL.recomputing = getattr(_LOCAL, "recomputing", 0) + 1
        try:
            with activation_rng.replay(call.rng), torch.enable_grad():
                outputs = call.fn(*args, **kwargs)
            leaves: list = []
            _flatten(outputs, leaves)
            out_tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            if len(out_tensors) != len(grads):
                raise ZeroCoreError(
                    f"activation checkpointing: the recompute of {call.fn!r} returned "
                    f"{len(out_tensors)} tensors, the first forward {len(grads)}; a checkpointed "
                    f"function must return the same structure each call")
            pairs = [(o, g) for o, g in zip(out_tensors, grads)
                     if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            _LOCAL.recomputing -= 1
        if call.slot is not None:
            call.slots.release(call.slot, call.token)
        _forget(call.state, call.token.account)
        _synchronize(call)
        _record(call, "recompute", start)
        return (None, None, *(t.grad if needs else None
                              for t, needs in zip(inputs, ctx.needs_input_grad[2:])))


def checkpoint(fn: Callable, *args, **kwargs):
    """Call ``fn(*args, **kwargs)`` saving only its inputs; recompute it in backward.

    Returns what ``fn`` returns (a tensor, or any tuple/list/dict of tensors and other
    values). Tensor arguments may be nested in tuples, lists and dicts; arguments that do
    not require grad are fine, and parameters used inside ``fn`` get their gradients even
    when no argument requires grad. See the module docstring for the recompute contract.
    """
    if not callable(fn):
        raise TypeError(f"checkpoint: fn must be callable, got {type(fn).__name__}")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # nothing will be differentiated: nothing to save
    state = _STATE
    leaves: list = []
    spec = _flatten((args, kwargs), leaves)
    tensor_slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in tensor_slots]
    call = _Call(fn=fn, spec=spec, leaves=[None if isinstance(x, torch.Tensor) else x
                                           for x in leaves],
                 tensor_slots=tensor_slots, state=state, token=_Token())
    with state.lock:
        state.calls += 1
        call.index = state.calls
    weakref.finalize(call.token, _forget, state, call.token.account)
    # Makes the output require grad even when no argument does, so that backward reaches
    # the recompute and the parameters inside fn get their gradients.
    dummy = torch.empty(0, requires_grad=True)
    outputs = _CheckpointFunction.apply(call, dummy, *tensors)
    out_leaves = list(call.out_leaves)
    for pos, t in zip(call.out_tensor_slots, outputs):
        out_leaves[pos] = t
    return _unflatten(call.out_spec, iter(out_leaves))
