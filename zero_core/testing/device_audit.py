"""Where the engine's tensors live: a walk over everything an engine owns.

On a GPU a buffer on the wrong side of the bus is a silent slowdown or a crash; on the CPU
it cannot be seen at all, since host and device memory are one. :func:`audit` walks an
engine's object graph (its flat buffers, partitions, gathered units, optimizer states,
reducer buckets, the wrapped model's parameters and buffers) and returns every tensor
with the memory it is expected in:

* ``"device"`` (the engine's ``device``) by default;
* ``"host"`` for a tensor whose storage is held by an object whose class declares
  ``TENSOR_HOME = "host"`` (everything it holds: the offload stores of master weights and
  optimizer states) or names the attributes that hold host memory in ``HOST_ATTRS`` (the
  parameter offload, which also refers to device-side fetch units). Such memory is host
  memory also where it is reached through another object or as a view (an offloaded
  master buffer hangs off the group buffers too), so homes are decided by storage, in two
  passes.

:func:`misplaced` lists the tensors whose device differs from their expected home; the
device test matrix fails on any. New engine state is covered without registering it: it
is found by the walk, and it belongs on the device unless its owner says otherwise.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Iterator

import torch

#: attributes not walked: the process-wide runtime and its communicators (their own tests
#: cover them; staging buffers are host memory by design), the config, and back references
#: to the engine from its parts
_SKIP_ATTRS = frozenset({"runtime", "config", "engine", "_engine", "comm", "world_comm",
                         "sharding", "accelerator", "ledger", "memory_ledger", "lr_scheduler",
                         "cfg"})
_LEAVES = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device,
           torch.Size, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.ModuleType, type)


@dataclass(frozen=True)
class Placement:
    path: str
    device: torch.device
    home: str          # "device" or "host"
    nbytes: int


def _children(obj) -> Iterator[tuple[str, object]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]", v
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
    else:
        attrs = getattr(obj, "__dict__", None)
        if attrs is None and hasattr(type(obj), "__slots__"):
            attrs = {s: getattr(obj, s) for s in type(obj).__slots__ if hasattr(obj, s)}
        for k, v in (attrs or {}).items():
            if k not in _SKIP_ATTRS:
                yield f".{k}", v


def _walk(root, root_path: str, max_depth: int):
    """(path, object) for everything reachable from *root*, each object once."""
    seen: set[int] = set()
    stack = [(root_path, root, 0)]
    while stack:
        path, obj, depth = stack.pop()
        if isinstance(obj, _LEAVES) or id(obj) in seen or depth > max_depth:
            continue
        seen.add(id(obj))
        yield path, obj
        if not isinstance(obj, torch.Tensor):
            for name, child in _children(obj):
                stack.append((path + name, child, depth + 1))


def _host_roots(obj):
    """The parts of *obj* that its class declares to be host memory."""
    cls = type(obj)
    if getattr(cls, "TENSOR_HOME", None) == "host":
        return [obj]
    return [getattr(obj, a) for a in getattr(cls, "HOST_ATTRS", ()) if hasattr(obj, a)]


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr()) if t.numel() else None


def audit(engine, max_depth: int = 14) -> list[Placement]:
    """Every tensor reachable from *engine*, once, with its expected home."""
    objects = list(_walk(engine, "engine", max_depth))
    host_storages = {_storage_key(t) for _, obj in objects for root in _host_roots(obj)
                     for _, t in _walk(root, "", max_depth) if isinstance(t, torch.Tensor)}
    host_storages.discard(None)
    found = []
    for path, obj in objects:
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided \
                and obj.device.type != "meta":
            key = _storage_key(obj)
            nbytes = obj.untyped_storage().nbytes() if key else 0
            found.append(Placement(path, obj.device, "host" if key in host_storages
                                   else "device", nbytes))
    return found


def misplaced(engine, device: torch.device | None = None) -> list[str]:
    """Tensors of *engine* not where they belong, as readable lines (empty: all good).

    Zero-element tensors are ignored (released buffers keep a zero-byte storage on some
    device and hold no data)."""
    device = torch.device(device or engine.device)
    out = []
    for p in audit(engine):
        if p.nbytes == 0:
            continue
        if p.home == "device" and p.device != device:
            out.append(f"{p.path}: {p.nbytes} bytes on {p.device}, expected {device}")
        elif p.home == "host" and p.device.type != "cpu":
            out.append(f"{p.path}: {p.nbytes} bytes on {p.device}, expected host memory")
    return out


def summary(engine) -> dict:
    """Bytes per (home, device) — for reports."""
    totals: dict[str, int] = {}
    for p in audit(engine):
        key = f"{p.home}:{p.device}"
        totals[key] = totals.get(key, 0) + p.nbytes
    return totals
