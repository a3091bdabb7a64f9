"""Random-number and autocast state of a checkpointed call.

The recompute in backward must draw the same random numbers as the first forward (the
same dropout masks) and compute under the same autocast settings, otherwise its
gradients belong to a different function. :func:`capture` records both before the first
forward; :func:`replay` puts them back around the recompute and then restores whatever
state backward was running with, so code after the backward sees an undisturbed RNG.

The CPU generator is always covered. For tensors on an accelerator, the generator of each
of their devices is covered through ``torch.get_device_module(type)`` (``torch.cuda``,
``torch.xpu``, ``torch.hpu`` ...), the same per-device RNG API torch's own checkpoint uses.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable

import torch

from zero_core.errors import ZeroCoreError


@dataclass
class CallState:
    """What :func:`replay` restores. Devices are keyed by ``str(torch.device)``."""

    cpu_rng: torch.Tensor
    device_rng: dict[str, torch.Tensor] = field(default_factory=dict)
    autocast: list[tuple[str, bool, torch.dtype]] = field(default_factory=list)
    autocast_cache: bool = True


def accelerator_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct non-CPU devices of *tensors*, in first-seen order."""
    seen: dict[str, torch.device] = {}
    for t in tensors:
        if t.device.type != "cpu":
            seen.setdefault(str(t.device), t.device)
    return list(seen.values())


def _rng_module(device: torch.device):
    try:
        module = torch.get_device_module(device.type)
    except (RuntimeError, AttributeError) as exc:
        raise ZeroCoreError(f"activation checkpointing: no torch device module for "
                            f"'{device.type}' tensors ({exc}); their random state cannot be "
                            f"saved for the recompute") from None
    if not (hasattr(module, "get_rng_state") and hasattr(module, "set_rng_state")):
        raise ZeroCoreError(f"activation checkpointing: torch.{device.type} has no "
                            f"get_rng_state/set_rng_state, so the recompute of a checkpoint with "
                            f"'{device.type}' inputs could not reproduce its random numbers")
    return module


def _index(device: torch.device):
    return device.index if device.index is not None else device.type


def _autocast_types(devices: list[torch.device]) -> list[str]:
    return ["cpu"] + sorted({d.type for d in devices})


def capture(devices: list[torch.device]) -> CallState:
    """The CPU and *devices*' RNG states and the autocast settings, now."""
    state = CallState(cpu_rng=torch.get_rng_state())
    for d in devices:
        state.device_rng[str(d)] = _rng_module(d).get_rng_state(_index(d))
    for kind in _autocast_types(devices):
        try:
            state.autocast.append((kind, torch.is_autocast_enabled(kind),
                                   torch.get_autocast_dtype(kind)))
        except RuntimeError:
            continue  # a device type autocast does not know: nothing to restore
    state.autocast_cache = torch.is_autocast_cache_enabled()
    return state


@contextlib.contextmanager
def replay(state: CallState):
    """Run the block with *state*'s RNG and autocast settings; afterwards restore the RNG
    states that were current before (the block's draws leave no trace)."""
    devices = [torch.device(name) for name in state.device_rng]
    outer_cpu = torch.get_rng_state()
    outer_dev = {name: _rng_module(d).get_rng_state(_index(d))
                 for name, d in zip(state.device_rng, devices)}
    try:
        torch.set_rng_state(state.cpu_rng)
        for (name, rng), d in zip(state.device_rng.items(), devices):
            _rng_module(d).set_rng_state(rng, _index(d))
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in state.autocast:
                stack.enter_context(torch.autocast(device_type=kind, dtype=dtype, enabled=enabled,
                                                   cache_enabled=state.autocast_cache))
            yield
    finally:
        torch.set_rng_state(outer_cpu)
        for (name, rng), d in zip(outer_dev.items(), devices):
            _rng_module(d).set_rng_state(rng, _index(d))
