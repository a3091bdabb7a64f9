"""Learning-rate schedules with DeepSpeed's names, parameters, defaults and formulas.

Each schedule drives the ``lr`` of every parameter group of any object with
``param_groups`` (a torch optimizer or zero-core's partitioned optimizer). The engine calls
``step()`` once after every optimizer step that was taken (not after a skipped fp16 overflow
step, as in DeepSpeed). ``last_batch_iteration`` is the index of the last step taken, -1
before training; the lr in the groups is always the lr for ``last_batch_iteration``, and it
is written at construction, so the first optimizer step already uses the schedule.

Formulas (it = last_batch_iteration, W = max(2, warmup_num_steps), T = total_num_steps;
DeepSpeed warms up over at least two steps):

* warmup factor g(it) for it < W: ``"log"``: ln(it + 1) / ln(W); ``"linear"``: it / W.
* WarmupLR: lr = min_lr + (max_lr - min_lr) * g(it) during warmup, then max_lr. Before the
  first step (it = -1) lr = min_lr. ``warmup_max_lr`` defaults to the optimizer's lr.
* WarmupDecayLR: as WarmupLR during warmup, then the factor decays linearly,
  max(0, (T - it) / max(1, T - W)), reaching min_lr at it = T and staying there.
  ``warmup_max_lr`` defaults to 0.001.
* WarmupCosineLR: lr = base_lr * ratio, base_lr being each group's lr at construction. During
  warmup ratio = warmup_min_ratio + (1 - warmup_min_ratio) * g(it); after it,
  p = min(1, (it - W + 1) / max(1, T - W)) and
  ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2), so the lr ends
  at base_lr * cos_min_ratio and stays there. Before the first step (it = -1) lr = 0.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from zero_core.errors import ConfigError

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_scheduler", "SCHEDULERS"]


def _param_groups(optimizer) -> list[dict]:
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        raise ConfigError(f"the LR scheduler needs an optimizer with param_groups (a torch "
                          f"optimizer or zero-core's partitioned optimizer), got "
                          f"{type(optimizer).__name__}")
    return groups


def _read_lr(group: dict) -> float:
    lr = group["lr"]
    return float(lr.item()) if torch.is_tensor(lr) else float(lr)


def _write_lrs(groups: list[dict], lrs: list[float]) -> list[float]:
    for group, lr in zip(groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)  # in place: a tensor lr may be captured by a compiled step
        else:
            group["lr"] = lr
    return list(lrs)


def _per_group(value, groups: list[dict], name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ConfigError(f"scheduler.params.{name} has {len(value)} entries but the optimizer "
                              f"has {len(groups)} parameter groups; give one number (used for "
                              f"every group) or one per group")
        return [float(v) for v in value]
    return [float(value)] * len(groups)


def _check_common(warmup_num_steps: Any, warmup_type: Any, last_batch_iteration: Any) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) \
            or warmup_num_steps < 0:
        raise ConfigError(f"scheduler.params.warmup_num_steps={warmup_num_steps!r}: expected an "
                          f"integer >= 0 (warmup lasts max(2, warmup_num_steps) steps)")
    if warmup_type not in ("log", "linear"):
        raise ConfigError(f"scheduler.params.warmup_type={warmup_type!r}: expected \"log\" or "
                          f"\"linear\"")
    if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int) \
            or last_batch_iteration < -1:
        raise ConfigError(f"scheduler.params.last_batch_iteration={last_batch_iteration!r}: "
                          f"expected an integer >= -1 (-1 = start from the beginning)")


class _Schedule:
    """Shared stepping, lr writing and state of the warmup family."""

    def __init__(self, optimizer, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int):
        _check_common(warmup_num_steps, warmup_type, last_batch_iteration)
        self.optimizer = optimizer
        self.warmup_type = warmup_type
        self.warmup_num_steps = max(2, warmup_num_steps)  # DeepSpeed: at least two steps
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration

    def _start(self) -> None:
        # Written also when resuming (last_batch_iteration >= 0), so that the optimizer never
        # runs a step with the lr from the config instead of the scheduled one.
        self._last_lr = _write_lrs(_param_groups(self.optimizer), self.get_lr())

    def _warmup_fraction(self, it: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(it + 1)
        return it / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        """The lr of every parameter group for ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lrs last written to the parameter groups."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step (or jump to *last_batch_iteration*) and write the new lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _write_lrs(_param_groups(self.optimizer), self.get_lr())

    def state_dict(self) -> dict:
        """Position in the schedule (DeepSpeed's key) and the lrs it interpolates between."""
        return {"last_batch_iteration": self.last_batch_iteration, **self._extra_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (a DeepSpeed one with only last_batch_iteration works too)
        and write the lrs for that position."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._load_extra_state(state)
        self._last_lr = _write_lrs(_param_groups(self.optimizer), self.get_lr())

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass


class WarmupLR(_Schedule):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    steps (``"log"`` or ``"linear"``), then hold it. ``warmup_max_lr`` None = the lr of the
    optimizer's first parameter group (as DeepSpeed). Either lr may be a list (one per group)."""

    def __init__(self, optimizer, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        groups = _param_groups(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = _read_lr(groups[0])
        self.min_lrs = _per_group(warmup_min_lr, groups, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, groups, "warmup_max_lr")
        self._start()

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return self._warmup_fraction(it)
        return 1.0

    def get_lr(self) -> list[float]:
        it = self.last_batch_iteration
        if it < 0:
            return list(self.min_lrs)
        gamma = self._gamma(it)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def _extra_state(self) -> dict:
        return {"min_lrs": list(self.min_lrs), "max_lrs": list(self.max_lrs)}

    def _load_extra_state(self, state: dict) -> None:
        if "min_lrs" in state:
            self.min_lrs = [float(v) for v in state["min_lrs"]]
            self.max_lrs = [float(v) for v in state["max_lrs"]]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay from ``warmup_max_lr`` to ``warmup_min_lr`` at step
    ``total_num_steps`` (held there after)."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) \
                or total_num_steps < 1:
            raise ConfigError(f"scheduler.params.total_num_steps={total_num_steps!r}: expected an "
                              f"integer >= 1")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return self._warmup_fraction(it)
        decay_steps = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - it) / decay_steps)


class WarmupCosineLR(_Schedule):
    """Warm the lr up from ``warmup_min_ratio`` × base lr to the base lr (each group's lr at
    construction), then follow a half cosine down to ``cos_min_ratio`` × base lr at step
    ``total_num_steps`` (held there after)."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) \
                or total_num_steps < 1:
            raise ConfigError(f"scheduler.params.total_num_steps={total_num_steps!r}: expected an "
                              f"integer >= 1")
        for name, value in (("warmup_min_ratio", warmup_min_ratio),
                            ("cos_min_ratio", cos_min_ratio)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0.0 <= value <= 1.0:
                raise ConfigError(f"scheduler.params.{name}={value!r}: expected a number in "
                                  f"[0, 1] (a fraction of the optimizer's lr)")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.base_lrs = [_read_lr(g) for g in _param_groups(optimizer)]
        self._start()

    def get_lr_ratio(self) -> float:
        """The factor applied to every group's base lr at ``last_batch_iteration``."""
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            g = self._warmup_fraction(it)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * g
        # Progress is clamped so that past total_num_steps the lr stays at the floor instead
        # of climbing back up the cosine.
        done = it - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, done / span)
        half_cos = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half_cos)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.base_lrs]

    def _extra_state(self) -> dict:
        return {"base_lrs": list(self.base_lrs)}

    def _load_extra_state(self, state: dict) -> None:
        # The base lrs are kept in the checkpoint because an optimizer restored before the
        # scheduler holds the *scheduled* lr, which must not become the new base.
        if "base_lrs" in state:
            self.base_lrs = [float(v) for v in state["base_lrs"]]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
              "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(config, optimizer):
    """The schedule a :class:`~zero_core.config.SchedulerConfig` names, driving *optimizer*
    (anything with ``param_groups``). Returns None when *config* is None."""
    if config is None:
        return None
    cls = SCHEDULERS.get(config.type)
    if cls is None:
        raise ConfigError(f"scheduler.type={config.type!r}: expected one of "
                          f"{', '.join(SCHEDULERS)}")
    return cls(optimizer, **dict(config.params))
