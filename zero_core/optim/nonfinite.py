"""What an optimizer step does with an inf/NaN gradient in fp32 and bf16 training.

fp16 has its loss scaler (loss_scaler.py): an overflow is expected there now and then, the
step is skipped and the scale lowered. In fp32 and bf16 nothing rescales, and one
non-finite gradient applied by Adam turns every parameter it touches into NaN for good.
The engine already all-reduces the squared gradient norm at every step, and inf/NaN
survive that sum, so every rank sees the same verdict without another collective. This
module turns the verdict into an action, per ``safety.nonfinite_gradients``:

* ``"skip"`` (default): no update — weights and optimizer states stay bit-identical, the LR
  schedule does not advance, ``engine.skipped_steps`` counts it and rank 0 logs one
  warning (logger ``zero_core.engine``) with the step number and the first parameter
  (in ``module.named_parameters()`` order) whose gradient is not finite.
  ``safety.max_consecutive_skips`` skips in a row raise, since the run is not recovering.
* ``"raise"``: :class:`NonFiniteGradientError` on every rank, weights untouched.
* ``"ignore"``: the update is applied as computed (DeepSpeed's bf16
  ``check_grad_overflow: false``).

The messages are the same on every rank (the parameter name is agreed by a collective),
so a job's failure report prints them once. The skip itself is decided on the device at the
step (engine/update.py); the warning or error comes when the host reads that step's verdict,
at the next update (or ``save_checkpoint``/``load_checkpoint``), naming the step.
"""
from __future__ import annotations

import logging

from zero_core.errors import ZeroCoreError

log = logging.getLogger("zero_core.engine")


class NonFiniteGradientError(ZeroCoreError):
    """A step's gradients held inf/NaN and the config says not to go on."""


class NonFiniteGuard:
    """Decides skip/raise/apply for each optimizer step and counts consecutive skips."""

    def __init__(self, action: str, max_consecutive: int, precision: str):
        self.action = action
        self.max_consecutive = max_consecutive
        self.precision = precision
        self.consecutive = 0

    def should_skip(self, finite: bool, step: int, norm_sumsq: float, where, rank: int) -> bool:
        """True when the step must be skipped. *where()* (a collective every rank calls
        together, only when *finite* is False) names the first non-finite parameter. Raises
        :class:`NonFiniteGradientError` for ``"raise"`` or too many skips in a row."""
        if finite or self.action == "ignore":
            self.consecutive = 0
            return False
        name = where()
        what = (f"step {step}: the global gradient norm is {_kind(norm_sumsq)} ({self.precision} "
                f"training){'' if name is None else f'; first parameter with a non-finite gradient: ' + repr(name)}")
        if self.action == "raise":
            raise NonFiniteGradientError(
                f"{what}. The weights were not updated. Look for a loss that divides by zero "
                f"or overflows, or lower the learning rate; config \"safety\": "
                f"{{\"nonfinite_gradients\": \"skip\"}} skips such steps instead")
        self.consecutive += 1
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise NonFiniteGradientError(
                f"{what}; that is {self.consecutive} skipped steps in a row "
                f"(safety.max_consecutive_skips = {self.max_consecutive}): the run is not "
                f"recovering. The weights are those of the last finite step; check the data "
                f"and the loss, or lower the learning rate")
        if rank == 0:
            log.warning("zero-core: %s — step skipped (weights and optimizer states "
                        "unchanged; %d in a row)", what, self.consecutive)
        return True


def _kind(sumsq: float) -> str:
    return "NaN" if sumsq != sumsq else "inf"
