"""Parameters that live only as their partition (ZeRO stage 3).

A partitioned parameter stays the same ``nn.Parameter`` object the model (and the user's
optimizer groups) refer to; only its class becomes :class:`PartitionedParameter` and its
``.data`` is swapped between an empty tensor (*released*) and a view of a gathered flat
buffer (*available*). The class exists for one reason: a torch function that receives a
released parameter must not compute with an empty tensor, so ``__torch_function__``
either

* raises :class:`ParameterNotGatheredError` naming the parameter, the module whose forward
  was running and the fix, or
* while :class:`~zero_core.stage3.init_context.Init` is building the model, gathers the
  parameter, runs the function on the full values and keeps this rank's slice of the
  (possibly modified) result — so that ``nn.init.*`` and ``model.apply(init_fn)`` inside a
  model's ``__init__`` work exactly as without partitioning, RNG draws included.

Shape queries (``p.shape``, ``p.size()``, ``p.numel()``, ``p.dim()``) of a released
parameter answer with the full shape; ``p.data`` is the empty placeholder.

Only a *released* parameter has the class :class:`PartitionedParameter`: :func:`attach`
gives an available one back its own class (``ParamMeta.cls``, normally ``nn.Parameter``)
and :func:`release` swaps ``PartitionedParameter`` in again. So functions on available
parameters never enter Python's ``__torch_function__`` at all: on the GPU the check cost
~10 us per call, 1,200 calls per step of the GPU kit's 12-layer GPT, and made stage 3
host-bound (ci/gpu/check.py --profile, 2026-11-27). Whether a parameter is partitioned
is the ``_zc`` entry in its ``__dict__`` (:func:`is_partitioned`), not its class.

Who answers a read of a released parameter is the parameter's *owner*
(``ParamMeta.owner``), never process-wide state, so two engines (or an engine and an
Init context) in one process do not answer for each other. An owner has two methods:
``read_released(func, args, kwargs, released)`` returns the function's result or raises,
and ``running_module()`` names the module whose forward is running (for the error), or
None. Init owns the parameters it partitioned (init_context.py: it materializes them
while a context is open); a stage-3 engine's ParamCoordinator owns its model's
(coordinator.py: the error names the engine's running module). Without an owner, reading
is the plain error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zero_core.errors import ZeroCoreError
from zero_core.placement import set_data


class ParameterNotGatheredError(ZeroCoreError):
    """A partitioned parameter was read while only its partition exists on this rank."""


@dataclass(eq=False)
class ParamMeta:
    """Bookkeeping of one partitioned parameter.

    ``unit``: the fetch unit that holds it once an engine owns it (None before).
    ``offset``: where it starts in the unit's gathered flat buffer (elements).
    ``own_part``: before an engine owns it (built under Init), this rank's slice of the
    parameter's own padded flat values; ``own_padded``: that padded length; ``own_comm``:
    the communicator whose ranks hold the slices (its rank is this slice's index).
    ``owner``: who answers a read while it is released (see the module docstring).
    ``cls``: the parameter's own class, which it has while available.
    """

    name: str
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    available: bool = False
    unit: Any = None
    offset: int = 0
    own_part: torch.Tensor | None = None
    own_padded: int = 0
    own_comm: Any = None
    owner: Any = None
    cls: type = torch.nn.Parameter
    extra: dict = field(default_factory=dict)


# Functions that only look at metadata or attach hooks: fine on a released parameter.
_METADATA_METHODS = frozenset({
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "data_ptr",
    "untyped_storage", "is_floating_point", "is_complex", "element_size", "__hash__",
    "_is_view", "is_contiguous", "get_device", "__repr__", "__format__",
})


def _shape_answers():
    T = torch.Tensor

    def size(meta, args):
        return meta.shape if len(args) < 2 else meta.shape[args[1]]
    return {
        T.shape.__get__: lambda meta, args: meta.shape,
        T.ndim.__get__: lambda meta, args: len(meta.shape),
        T.size: size,
        T.numel: lambda meta, args: meta.numel,
        T.nelement: lambda meta, args: meta.numel,
        T.dim: lambda meta, args: len(meta.shape),
        T.ndimension: lambda meta, args: len(meta.shape),
    }


_SHAPE_ANSWERS = _shape_answers()


def _released_in(args, kwargs) -> list:
    found = []

    def visit(x):
        if isinstance(x, PartitionedParameter):
            meta = x.__dict__.get("_zc")
            if meta is not None and not meta.available and all(x is not f for f in found):
                found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, (PartitionedParameter, list, tuple)):
                    visit(y)

    for a in args:
        visit(a)
    if kwargs:
        for a in kwargs.values():
            visit(a)
    return found


class PartitionedParameter(torch.nn.Parameter):
    """The class of a released partitioned parameter; see the module docstring. Never
    constructed directly: :func:`release` converts, :func:`attach` converts back."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        released = _released_in(args, kwargs)
        if released:
            answer = _SHAPE_ANSWERS.get(func)
            if answer is not None and args and args[0] is released[0]:
                return answer(released[0]._zc, args)
            name = getattr(func, "__name__", "")
            if name not in ("__get__", "__set__", "__delete__") and name not in _METADATA_METHODS:
                owner = released[0]._zc.owner
                if owner is not None:
                    return owner.read_released(func, args, kwargs, released)
                raise not_gathered_error(released[0], func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def function_name(func) -> str:
    """A readable name for a torch function or Tensor method (for error messages)."""
    name = getattr(func, "__name__", None) or repr(func)
    qual = getattr(func, "__qualname__", None) or name
    mod = getattr(func, "__module__", None) or ""
    if qual.startswith(("TensorBase.", "Tensor.")) or (not mod and "." not in qual):
        return f"torch.Tensor.{name}"
    if mod.startswith("torch._C._nn"):
        return f"torch.nn.functional.{name}"
    if mod.startswith("torch._C") or mod == "torch":
        return f"torch.{name}"
    return f"{mod}.{qual}"


def not_gathered_error(p: "PartitionedParameter", func) -> ParameterNotGatheredError:
    """The error for reading released parameter *p* through *func*."""
    meta: ParamMeta = p._zc
    running = meta.owner.running_module() if meta.owner is not None else None
    where = (f"inside the forward of module '{running}'" if running is not None
             else "outside any module's forward")
    module_hint = (f"<module '{running}'>" if running is not None
                   else "<the module that reads it>")
    return ParameterNotGatheredError(
        f"parameter '{meta.name}' (shape {tuple(meta.shape)}) is partitioned by ZeRO stage 3 "
        f"and was read by {function_name(func)} {where} while not gathered: this rank holds "
        f"only 1/N of its values. Stage 3 gathers a module's own parameters around that "
        f"module's forward and backward. To read it elsewhere, either register it with the "
        f"module that reads it — zero_core.register_external_parameter({module_hint}, "
        f"<parameter '{meta.name}'>) — so it is gathered for that module's forward and backward, or "
        f"wrap the access in `with zero_core.GatheredParameters([param]):`.")


def is_partitioned(p) -> bool:
    """True for a parameter converted by :func:`mark_partitioned`."""
    return isinstance(p, torch.Tensor) and "_zc" in p.__dict__


def meta_of(p) -> ParamMeta:
    return p.__dict__["_zc"]


def mark_partitioned(p: torch.nn.Parameter, name: str) -> ParamMeta:
    """Give *p* (in place, same object) partitioning metadata and return it; *p* is
    available with its current values until the caller releases it."""
    if is_partitioned(p):
        return meta_of(p)
    meta = ParamMeta(name=name, shape=torch.Size(p.data.shape), numel=p.data.numel(),
                     dtype=p.data.dtype, cls=type(p))
    p.__dict__["_zc"] = meta
    meta.available = True
    return meta


def attach(p, values: torch.Tensor) -> None:
    """Make *p* available with *values* (a view of a gathered buffer, full shape)."""
    meta = meta_of(p)
    p.__class__ = meta.cls   # first: set_data then runs without __torch_function__
    set_data(p, values.view(meta.shape))
    meta.available = True


def release(p, dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
    """Drop *p*'s full values (its partition is kept elsewhere); the empty placeholder
    has *dtype* and *device* (default: those of the values dropped)."""
    meta = meta_of(p)
    if meta.available:
        data = p.data
        set_data(p, torch.empty(0, dtype=dtype or data.dtype, device=device or data.device))
        meta.available = False
        p.__class__ = PartitionedParameter
