"""Loss scaling for fp16 training, with DeepSpeed's semantics.

fp16 gradients underflow to zero when the loss is small, so the loss is multiplied by a
scale before backward and the gradients are divided by it before the optimizer step. A
*dynamic* scale starts high (``2**initial_scale_power``) and adapts:

* on an overflow (any inf/NaN gradient, see :func:`has_overflow`) the step is skipped by the
  engine; the scaler first spends its *hysteresis* (``fp16.hysteresis`` overflows are
  tolerated without changing the scale), and once only one is left each overflow halves the
  scale, never below ``min_loss_scale``. An overflow while already at ``min_loss_scale`` with
  no hysteresis left raises :class:`LossScaleUnderflowError` (DeepSpeed stops the run there
  too: the gradients are inf/NaN at any scale it may use).
* after ``loss_scale_window`` good steps counted from the step *after* the last overflow the
  scale doubles and the hysteresis is refilled. As in DeepSpeed, this means the scale grows on
  the (window+1)-th consecutive good step since the last overflow (or since the start), then
  every ``window`` good steps.
* with ``consecutive_hysteresis`` the hysteresis is refilled on every good step, so only
  ``hysteresis`` overflows *in a row* lower the scale.

A *static* scale (``fp16.loss_scale > 0``) never changes. :class:`GradScalerLossScaler` is
``torch.amp.GradScaler``'s rule instead (``torch_autocast`` to fp16 with fp32 parameters,
engine/autocast.py): halve on every overflow, no hysteresis, no floor; double after
``growth_interval`` good steps in a row, counted afresh after each change.

The dynamic scaler's state lives in one small tensor, moved to the engine's device
(:meth:`DynamicLossScaler.to`): the engine multiplies the loss by :attr:`current` (that
tensor's scale) and calls :meth:`DynamicLossScaler.update_on_device` with the step's
overflow flag as a device tensor, so that no step reads the scale back to the host (a
synchronization on a GPU). The rules are the same arithmetic on tensors; an overflow at the
floor sets :attr:`underflow`, which the engine turns into :class:`LossScaleUnderflowError`
when it reads the step's verdict (engine/update.py). ``update(overflow: bool)`` is the
host-side form (tests, tools): it raises at once. Reading :attr:`scale` copies it to the host.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from zero_core.errors import ConfigError, ZeroCoreError

__all__ = ["DynamicLossScaler", "StaticLossScaler", "GradScalerLossScaler",
           "LossScaleUnderflowError", "has_overflow", "overflow_flag", "build_loss_scaler"]


class LossScaleUnderflowError(ZeroCoreError, FloatingPointError):
    """Gradients overflowed while the dynamic loss scale was already at its minimum."""


def overflow_flag(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """A 0-dim float32 tensor: 1.0 if any of *tensors* holds an inf or NaN, else 0.0.

    Stays on the tensors' device without a host sync, so that the engine can all-reduce it
    (MAX) across ranks before deciding. ``None`` entries (parameters without gradients) are
    skipped; with no tensors the flag is 0.0 on the CPU.
    """
    flag = None
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        bad = torch.logical_not(torch.isfinite(t).all())
        flag = bad if flag is None else torch.logical_or(flag, bad.to(flag.device))
    if flag is None:
        return torch.zeros((), dtype=torch.float32)
    return flag.to(torch.float32)


def has_overflow(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True if any of *tensors* (None entries skipped) holds an inf or NaN value."""
    return bool(overflow_flag(tensors).item())


class _LossScaler:
    """What both scalers share: the current scale, under DeepSpeed's two names."""

    _scale: float

    @property
    def scale(self) -> float:
        """The current loss scale (multiplier of the loss)."""
        return self._scale

    loss_scale = scale  # DeepSpeed's attribute name

    @property
    def current(self):
        """The scale as the engine multiplies by it: a float, or a 0-dim device tensor."""
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """*loss* multiplied by the current scale."""
        return loss * self.current

    def to(self, device) -> "_LossScaler":
        """Keep the state on *device* (nothing to move for a static scale)."""
        return self


class StaticLossScaler(_LossScaler):
    """A fixed loss scale (DeepSpeed's ``fp16.loss_scale > 0``); ``update`` changes nothing."""

    dynamic = False

    def __init__(self, scale: float):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale) or scale <= 0:
            raise ConfigError(f"fp16.loss_scale={scale!r}: a static loss scale must be a finite "
                              f"number > 0 (use 0 for dynamic scaling)")
        self._scale = float(scale)

    def update(self, overflow: bool) -> None:
        """Nothing to adapt; the engine still skips the step when *overflow* is True."""

    def update_on_device(self, overflow: torch.Tensor) -> None:
        """Nothing to adapt (the engine's device-side form of :meth:`update`)."""

    underflow = None  # a static scale never reaches a floor

    def state_dict(self) -> dict:
        """The scale, for checkpoints."""
        return {"type": "static", "scale": self._scale}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict` (refuses a dynamic scaler's state)."""
        if state.get("type", "static") != "static":
            raise ConfigError(f"cannot load a {state.get('type')!r} loss-scaler state into a "
                              f"static scaler: the checkpoint used dynamic loss scaling "
                              f"(fp16.loss_scale 0); use the same fp16 settings as when it was "
                              f"saved")
        self._scale = float(state["scale"])


class _DeviceStateScaler(_LossScaler):
    """A dynamic scaler whose state is one float64 tensor on the device (exact counts up to
    2**53): ``[scale, <the rule's own counters>..., steps, overflows]``; read on the host only
    for reports and checkpoints."""

    _state: torch.Tensor

    def to(self, device):
        self._state = self._state.to(device)
        return self

    @property
    def scale(self) -> float:
        return float(self._state[0])

    loss_scale = scale

    @property
    def current(self) -> torch.Tensor:
        return self._state[0]

    @property
    def steps(self) -> int:
        return int(self._state[-2])

    @property
    def overflows(self) -> int:
        return int(self._state[-1])


class DynamicLossScaler(_DeviceStateScaler):
    """DeepSpeed's dynamic loss scale (see the module docstring for the rules).

    Arguments: ``initial_scale`` (the first scale, ``2**initial_scale_power``),
    ``scale_window`` (good steps between increases), ``min_scale`` (> 0, the floor),
    ``hysteresis`` (>= 1, overflows absorbed before the scale drops),
    ``consecutive_hysteresis`` (refill the hysteresis on every good step), ``scale_factor``
    (2 in DeepSpeed), ``raise_error_at_min_scale`` (raise on an overflow at the floor).
    """

    dynamic = True

    def __init__(self, initial_scale: float = 2.0 ** 16, scale_window: int = 1000,
                 min_scale: float = 1.0, hysteresis: int = 2, consecutive_hysteresis: bool = False,
                 scale_factor: float = 2.0, raise_error_at_min_scale: bool = True):
        def positive(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name}={value!r}: expected a finite number > 0")

        def count(name, value):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: expected an integer >= 1")

        positive("fp16 initial loss scale", initial_scale)
        positive("fp16.min_loss_scale", min_scale)
        count("fp16.loss_scale_window", scale_window)
        count("fp16.hysteresis", hysteresis)
        if not isinstance(scale_factor, (int, float)) or not scale_factor > 1:
            raise ConfigError(f"scale_factor={scale_factor!r}: expected a number > 1")
        if initial_scale < min_scale:
            raise ConfigError(f"initial loss scale {initial_scale:g} is below fp16.min_loss_scale "
                              f"{min_scale:g}: raise fp16.initial_scale_power or lower "
                              f"fp16.min_loss_scale")
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.scale_factor = float(scale_factor)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        # [scale, hysteresis left, good steps since the last overflow, steps, overflows]:
        # float64 holds every count exactly up to 2**53
        self._state = torch.tensor([float(initial_scale), hysteresis, 0, 0, 0],
                                   dtype=torch.float64)
        #: 1.0 once an overflow hit the floor (raise_error_at_min_scale), on the state's device
        self.underflow = torch.zeros((), dtype=torch.float64)

    def to(self, device) -> "DynamicLossScaler":
        super().to(device)
        self.underflow = self.underflow.to(device)
        return self

    @property
    def hysteresis_left(self) -> int:
        return int(self._state[1])

    @property
    def good_steps(self) -> int:
        return int(self._state[2])

    def update_on_device(self, overflow: torch.Tensor) -> None:
        """Adapt the scale after one optimizer step; *overflow* (a 0-dim bool tensor on the
        state's device) says whether its gradients held an inf/NaN. Nothing is read back."""
        scale, hyst, good, steps, overflows = self._state.unbind()
        spent = hyst <= 1  # no hysteresis left: this overflow lowers the scale
        if self.raise_error_at_min_scale:
            hit = overflow & spent & (scale <= self.min_scale)
            self.underflow = torch.maximum(self.underflow, hit.to(torch.float64))
        lowered = torch.where(spent, torch.clamp(scale / self.scale_factor, min=self.min_scale),
                              scale)
        good_after = good + 1
        # DeepSpeed counts the window from the step after the last overflow: the scale grows
        # when good_steps - 1 is a positive multiple of the window
        stable = good_after - 1
        grow = (stable > 0) & (torch.remainder(stable, self.scale_window) == 0)
        kept = torch.full_like(hyst, float(self.hysteresis)) if self.consecutive_hysteresis else hyst
        refill = torch.full_like(hyst, float(self.hysteresis))
        new = torch.stack([
            torch.where(overflow, lowered, torch.where(grow, scale * self.scale_factor, scale)),
            torch.where(overflow, torch.where(spent, hyst, hyst - 1),
                        torch.where(grow, refill, kept)),
            torch.where(overflow, torch.zeros_like(good), good_after),
            steps + 1,
            overflows + overflow.to(torch.float64)])
        self._state.copy_(new)

    def update(self, overflow: bool) -> None:
        """:meth:`update_on_device` for a host *overflow*; raises
        :class:`LossScaleUnderflowError` at once for an overflow at the floor."""
        if overflow and self.raise_error_at_min_scale and self.hysteresis_left <= 1 \
                and self.scale <= self.min_scale:
            raise LossScaleUnderflowError(underflow_message(self.min_scale, self.steps))
        flag = torch.tensor(bool(overflow), device=self._state.device)
        self.update_on_device(flag)

    def state_dict(self) -> dict:
        """Everything needed to continue the same scale sequence after a restart."""
        return {"type": "dynamic", "scale": self.scale, "hysteresis_left": self.hysteresis_left,
                "good_steps": self.good_steps, "steps": self.steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`. The window/hysteresis settings come from the
        config, not the checkpoint."""
        if state.get("type", "dynamic") != "dynamic":
            raise ConfigError(f"cannot load a {state.get('type')!r} loss-scaler state into a "
                              f"dynamic scaler: the checkpoint used a static fp16.loss_scale; use "
                              f"the same fp16 settings as when it was saved")
        values = [float(state["scale"]), int(state["hysteresis_left"]), int(state["good_steps"]),
                  int(state.get("steps", 0)), int(state.get("overflows", 0))]
        self._state.copy_(torch.tensor(values, dtype=torch.float64))


class GradScalerLossScaler(_DeviceStateScaler):
    """``torch.amp.GradScaler``'s scale (defaults: ``init_scale`` 2**16, ``growth_factor``
    2, ``backoff_factor`` 0.5, ``growth_interval`` 2000), which DeepSpeed 0.19.8 uses for
    ``torch_autocast`` to fp16 with fp32 parameters: an overflow multiplies the scale by
    ``backoff_factor`` and restarts the count; a good step counts, and the
    ``growth_interval``-th in a row multiplies it by ``growth_factor`` (kept only if
    finite) and restarts the count. No hysteresis and no floor (never raises). The state
    lives on the device as :class:`DynamicLossScaler`'s does."""

    dynamic = True
    underflow = None   # no floor to hit

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        # [scale, good steps since the last change, steps, overflows] (float64: exact counts)
        self._state = torch.tensor([float(init_scale), 0, 0, 0], dtype=torch.float64)

    @property
    def growth_tracker(self) -> int:
        return int(self._state[1])

    def update_on_device(self, overflow: torch.Tensor) -> None:
        """Adapt the scale after one optimizer step (*overflow*: a 0-dim bool tensor on the
        state's device); nothing is read back."""
        scale, tracker, steps, overflows = self._state.unbind()
        counted = tracker + 1
        grow = counted >= self.growth_interval
        grown = scale * self.growth_factor
        grown = torch.where(torch.isfinite(grown), grown, scale)
        new = torch.stack([
            torch.where(overflow, scale * self.backoff_factor,
                        torch.where(grow, grown, scale)),
            torch.where(overflow | grow, torch.zeros_like(tracker), counted),
            steps + 1,
            overflows + overflow.to(torch.float64)])
        self._state.copy_(new)

    def update(self, overflow: bool) -> None:
        """:meth:`update_on_device` for a host *overflow* (tests, tools)."""
        self.update_on_device(torch.tensor(bool(overflow), device=self._state.device))

    def state_dict(self) -> dict:
        return {"type": "grad_scaler", "scale": self.scale,
                "growth_tracker": self.growth_tracker, "steps": self.steps,
                "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; the factors and interval come from the config."""
        if state.get("type") != "grad_scaler":
            raise ConfigError(f"cannot load a {state.get('type')!r} loss-scaler state into the "
                              f"torch_autocast fp16 GradScaler: the checkpoint was saved with "
                              f"other precision settings; use the same fp16 / torch_autocast "
                              f"settings as when it was saved")
        values = [float(state["scale"]), int(state.get("growth_tracker", 0)),
                  int(state.get("steps", 0)), int(state.get("overflows", 0))]
        self._state.copy_(torch.tensor(values, dtype=torch.float64))


def underflow_message(min_scale: float, step: int) -> str:
    return (f"fp16 gradients overflowed at the minimum loss scale {min_scale:g} "
            f"(step {step}): the loss or gradients are inf/NaN at any scale. "
            f"Check the data and learning rate, lower fp16.min_loss_scale, or train "
            f"in bf16")


def build_loss_scaler(fp16) -> DynamicLossScaler | StaticLossScaler:
    """The scaler an :class:`~zero_core.config.FP16Config` describes: static when
    ``loss_scale > 0``, else dynamic from ``2**initial_scale_power``. It does not look at
    ``enabled``: the engine uses no scaler for fp32/bf16."""
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        initial_scale=float(2.0 ** fp16.initial_scale_power),
        scale_window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=getattr(fp16, "consecutive_hysteresis", False),
    )
