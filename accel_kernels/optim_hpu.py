"""Optimizer kernels for Intel Gaudi (HPU) over Habana's fused optimizers (FusedAdamW, FusedSGD).

NOT RUN ON GAUDI HARDWARE: this project has no HPU. The module is tested on the CPU
against a stand-in ``habana_frameworks`` (tests/test_optim_hpu.py) that implements the
documented classes with float64 math, and checks itself against the reference kernels
on the card the first time it is used there (see "Self-check" below).

What Habana documents, and what this module uses
------------------------------------------------
Intel Gaudi's "Fused Optimizers and Custom Ops" page
(https://docs.habana.ai/en/latest/PyTorch/Model_Optimization_PyTorch/Custom_Ops_PyTorch.html)
documents the fused optimizers as ``torch.optim.Optimizer`` classes in
``habana_frameworks.torch.hpex.optimizers``: FusedAdagrad, FusedAdamW, FusedEMA,
FusedLamb, FusedSGD, FusedLars, and a "Functional FusedAdamW" (for torch.distributed's
functional optimizers). Their constructors (read in the bridge's published sources,
github.com/HabanaAI/gaudi-pytorch-bridge, ``python_packages/habana_frameworks/torch/hpex/
optimizers/FusedAdamW.py`` and ``FusedSGD.py``) are::

    FusedAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
               bias_correction=True)
    FusedSGD(params, lr, momentum=0, weight_decay=0, dampening=0, nesterov=False)

Their ``step()`` reads each parameter's ``.grad``, keeps per-parameter state under
torch.optim's names (``exp_avg`` / ``exp_avg_sq``, ``momentum_buffer``) and reads the
hyperparameters from ``param_groups`` on every step (as every torch optimizer does, which
is what learning-rate schedulers rely on).

The classes call lower-level ops (``torch.ops.hpu.optimizer_adamw``, ``optimizer_sgd``,
``optimizer_sgd_momentum``). Those would fit a flat partition best, but they are not on
Habana's documentation pages, and their argument lists differ between bridge releases
(a learning-rate tensor and FP8 moment scales appear in some and not in others), so a
call written against one release can fail, or mean something else, on the next. Hence
the documented classes, driven as follows.

How a flat partition is stepped
-------------------------------
One optimizer object per kind and device is built on first use (around a 1-element
placeholder) and reused. For each call the partition tensor becomes the group's only
parameter, ``.grad`` is set to the gradient, the state entry is set to *our* ``exp_avg``
/ ``exp_avg_sq`` / ``momentum_buffer`` tensors (so the op updates them in place and no
state lives in the object between calls), the group's hyperparameters are written, and
``step()`` runs. Afterwards the placeholder is put back and the state dropped, so the
object holds no reference to the engine's buffers (they may be views that change from
call to call, e.g. NVMe-offload sub-groups reusing one buffer).

Adam/AdamW. Only the plain Adam recurrence of FusedAdamW is relied on:
``bias_correction=False`` and ``weight_decay=0`` leave
``m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2;  p <- p - lr m / (sqrt(v) + eps)``,
which has one reading. Everything else is done here, exactly:

* bias correction (torch's placement of eps): with c1 = 1 - b1^t, c2 = 1 - b2^t,
  ``lr/c1 * m / (sqrt(v)/sqrt(c2) + eps) = (lr sqrt(c2)/c1) * m / (sqrt(v) + eps sqrt(c2))``,
  so the op is given lr' = lr sqrt(c2)/c1 and eps' = eps sqrt(c2). This also makes the
  result independent of the object's own step counter.
* decoupled decay (adamw=True): ``p *= 1 - lr wd`` before the op. Passing wd to the op
  would save that pass, but whether its kernel decays before or after subtracting the
  update (which changes the result) is not documented; checking it on a card and then
  folding it in is future work.
* L2 (adamw=False): the op gets ``g + wd p`` (a temporary; the caller's grad is read only).
* the bf16/fp16 copy: ``param_lowp.copy_(param)`` after the op (one extra read of the
  fp32 partition; the op has no low-precision output).

SGD. FusedSGD with momentum keeps an int step counter on the device inside the object
(not documented) that its kernel appears to use to recognise the first step (momentum
buffer := gradient). The KernelSet passes *first_step* explicitly instead. With
dampening == 0 both readings agree if the buffer is zeroed on the first step
(mu * 0 + g = g), and the shared object has stepped at least once (its self-check) before
any real call, so its counter is past "first" either way. Momentum with dampening != 0
therefore runs the reference kernel (plain torch ops, which Habana's bridge runs on the
card). Weight decay and nesterov are passed to the op (torch.optim.SGD's meaning,
no ordering ambiguity).

Self-check. On first use per device, each wrapped optimizer steps a small scratch
partition three times next to :mod:`.optim_reference` (eps large enough to matter, decay
on, Adam and AdamW, first and later SGD steps). If it raises, writes the gradient, keeps
state under other names, or disagrees by more than 1e-3 of the update, a RuntimeWarning
says so and that kernel runs the reference for the rest of the process: slower, never
wrong. :func:`status` tells which path each kernel takes.

Not offered by the interface, so not handled: amsgrad, maximize, FP8 moments.

``habana_frameworks`` is imported on the first call only; without it the call raises
ModuleNotFoundError naming the package and how to get it.
"""
from __future__ import annotations

import math
import warnings

import torch

from . import optim_reference
from .optim_checks import check_adam_args, check_sgd_args

#: device types these kernels accept (the tests widen it to run the CPU stand-in)
DEVICE_TYPES = ("hpu",)
#: where Habana's fused optimizers live
HPEX_OPTIMIZERS = "habana_frameworks.torch.hpex.optimizers"
INSTALL_HINT = ("habana_frameworks (Intel Gaudi's PyTorch bridge) is not installed; it "
                "comes with Intel Gaudi's software stack (Intel's Gaudi PyTorch container, "
                "or the habana-torch-plugin wheels of Intel Gaudi's installation guide). "
                "Without Gaudi, select kernel set 'reference' or 'cpu'")
#: relative disagreement with the reference above which the self-check rejects an op
SELF_CHECK_RTOL = 1e-3

_ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
_MOMENTUM_KEY = "momentum_buffer"


# ---- public kernels -----------------------------------------------------------------------
def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, step: int, adamw: bool,
              bias_correction: bool = True,
              param_lowp: torch.Tensor | None = None) -> None:
    """One Adam (adamw=False, L2) or AdamW (adamw=True, decoupled decay) step, in place,
    through Habana's FusedAdamW.

    Same contract as :func:`zero_core.accel_kernels.optim_reference.adam_step`: flat
    contiguous fp32 HPU tensors of one size, *grad* only read, *lr* in parameter units
    per step, *step* the 1-based count after this update, optional bf16/fp16
    *param_lowp* written (rounded) after the step.
    """
    check_adam_args(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, weight_decay=weight_decay, step=step, param_lowp=param_lowp)
    _check_device(param)
    if param.numel() == 0:
        return
    driver = _driver("adam", param.device)
    if driver is None:  # the self-check rejected the op on this device
        optim_reference.adam_step(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1,
                                  beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                                  adamw=adamw, bias_correction=bias_correction,
                                  param_lowp=param_lowp)
        return
    _fused_adam(driver, param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                eps=eps, weight_decay=weight_decay, step=step, adamw=adamw,
                bias_correction=bias_correction)
    if param_lowp is not None:
        param_lowp.copy_(param)


def sgd_step(param: torch.Tensor, grad: torch.Tensor,
             momentum_buffer: torch.Tensor | None, *, lr: float, momentum: float,
             dampening: float, weight_decay: float, nesterov: bool, first_step: bool,
             param_lowp: torch.Tensor | None = None) -> None:
    """One SGD step with torch.optim.SGD semantics, in place, through Habana's FusedSGD.

    *momentum_buffer* may be None when momentum == 0. Momentum with dampening != 0 runs
    the reference kernel (see the module docstring). *grad* is only read; *param_lowp*
    as in :func:`adam_step`.
    """
    check_sgd_args(param, grad, momentum_buffer, lr=lr, momentum=momentum,
                   dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                   param_lowp=param_lowp)
    _check_device(param)
    if param.numel() == 0:
        return
    driver = None
    if momentum == 0 or dampening == 0:
        driver = _driver("sgd", param.device)
    if driver is None:
        optim_reference.sgd_step(param, grad, momentum_buffer, lr=lr, momentum=momentum,
                                 dampening=dampening, weight_decay=weight_decay,
                                 nesterov=nesterov, first_step=first_step,
                                 param_lowp=param_lowp)
        return
    _fused_sgd(driver, param, grad, momentum_buffer, lr=lr, momentum=momentum,
               weight_decay=weight_decay, nesterov=nesterov, first_step=first_step)
    if param_lowp is not None:
        param_lowp.copy_(param)


def status() -> dict:
    """Which path each kernel takes per device used so far: ``{"adam@hpu": "FusedAdamW"}``,
    or ``"reference (<why the self-check rejected the fused op>)"``."""
    return {f"{kind}@{dev}": (d.label if d is not None else f"reference ({_REJECTED[(kind, dev)]})")
            for (kind, dev), d in _DRIVERS.items()}


def forget_drivers() -> None:
    """Drop the cached optimizer objects and self-check verdicts (tests; a new bridge)."""
    _DRIVERS.clear()
    _REJECTED.clear()


# ---- the fused steps ----------------------------------------------------------------------
def _fused_adam(driver, param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps,
                weight_decay, step, adamw, bias_correction):
    if bias_correction:
        c1 = 1.0 - beta1 ** step
        sqrt_c2 = math.sqrt(1.0 - beta2 ** step)
    else:
        c1 = sqrt_c2 = 1.0
    if weight_decay != 0 and adamw:
        param.mul_(1.0 - lr * weight_decay)
    if weight_decay != 0 and not adamw:
        grad = grad.add(param, alpha=weight_decay)  # a temporary: the caller's grad stays
    hyper = dict(lr=float(lr) * sqrt_c2 / c1, betas=(float(beta1), float(beta2)),
                 eps=float(eps) * sqrt_c2, weight_decay=0.0, bias_correction=False)
    driver.run(param, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, hyper)


def _fused_sgd(driver, param, grad, momentum_buffer, *, lr, momentum, weight_decay,
               nesterov, first_step):
    state = {}
    if momentum != 0:
        if first_step:
            # torch: buf := d on the first step; mu * 0 + (1 - 0) d is the same, whatever
            # the op's own counter says (dampening is 0 on this path)
            momentum_buffer.zero_()
        state[_MOMENTUM_KEY] = momentum_buffer
    hyper = dict(lr=float(lr), momentum=float(momentum), weight_decay=float(weight_decay),
                 dampening=0.0, nesterov=bool(nesterov))
    driver.run(param, grad, state, hyper)


class _Driver:
    """One Habana optimizer object, stepped on whatever partition a call brings."""

    def __init__(self, cls, device: torch.device, label: str, defaults: dict):
        self.label = label
        self.placeholder = torch.zeros(1, dtype=torch.float32, device=device)
        self.opt = cls([self.placeholder], **defaults)

    def run(self, param, grad, state: dict, hyper: dict) -> None:
        """Step *param* with *grad*, the op updating the tensors of *state* in place."""
        opt = self.opt
        group = opt.param_groups[0]
        group.update(hyper)
        group["params"] = [param]
        opt.state.clear()
        opt.state[param] = dict(state)
        param.grad = grad
        try:
            opt.step()
            kept = opt.state.get(param, {})
            if any(kept.get(k) is not v for k, v in state.items()):
                raise RuntimeError(
                    f"{type(opt).__name__} replaced the state tensors zero-core mapped into "
                    f"it (keys now {sorted(kept)}); this habana_frameworks release keeps "
                    f"its state differently. Select kernel set 'reference' and report it")
        finally:
            param.grad = None
            group["params"] = [self.placeholder]
            opt.state.clear()


# ---- construction, lazy import and self-check ---------------------------------------------
_DRIVERS: dict = {}   # (kind, device str) -> _Driver, or None when rejected
_REJECTED: dict = {}  # (kind, device str) -> why


def _check_device(param: torch.Tensor) -> None:
    if param.device.type not in DEVICE_TYPES:
        raise ValueError(f"optim_hpu kernels step HPU tensors, param is on {param.device}; "
                         f"use the kernel set of that device's accelerator (e.g. 'cpu' for "
                         f"host memory) instead")


def _hpex_optimizers():
    """``habana_frameworks.torch.hpex.optimizers``, imported now (first call)."""
    try:
        import habana_frameworks.torch.hpex.optimizers as hpex_optimizers
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("habana_frameworks"):
            raise
        raise ModuleNotFoundError(f"zero_core.accel_kernels.optim_hpu needs {HPEX_OPTIMIZERS}: "
                                  f"{INSTALL_HINT}", name="habana_frameworks") from exc
    return hpex_optimizers


def _driver(kind: str, device: torch.device):
    """The checked optimizer object of *kind* ("adam"/"sgd") on *device*, or None if the
    self-check rejected it (then a warning has said why)."""
    key = (kind, str(device))
    if key not in _DRIVERS:
        hpex = _hpex_optimizers()
        if kind == "adam":
            driver = _Driver(hpex.FusedAdamW, device, "FusedAdamW",
                             dict(lr=1e-3, bias_correction=False))
        else:
            driver = _Driver(hpex.FusedSGD, device, "FusedSGD", dict(lr=1e-3, momentum=0.9))
        why = _self_check(kind, driver, device)
        if why is not None:
            warnings.warn(f"zero-core optim_hpu: Habana's {driver.label} failed the self-check "
                          f"on {device} ({why}); the {kind} kernel runs the reference torch ops "
                          f"there instead (correct, slower)", RuntimeWarning, stacklevel=3)
            _REJECTED[key] = why
            driver = None
        _DRIVERS[key] = driver
    return _DRIVERS[key]


def _self_check(kind: str, driver: _Driver, device: torch.device) -> str | None:
    """Step a scratch partition with *driver* and with the reference; None if they agree,
    else what went wrong. Doubles as the warm-up of FusedSGD's step counter."""
    gen = torch.Generator().manual_seed(1234)
    n = 257

    def rand(scale=1.0, positive=False):
        x = torch.rand(n, generator=gen) if positive else torch.randn(n, generator=gen)
        return (x * scale).to(device)

    if kind == "adam":
        # eps comparable to sqrt(v) so that its placement shows; decay on
        fused = [rand(), rand(0.01), rand(1e-4, positive=True)]
        cases = [dict(adamw=True, bias_correction=True, weight_decay=0.1),
                 dict(adamw=False, bias_correction=True, weight_decay=0.05),
                 dict(adamw=True, bias_correction=False, weight_decay=0.0)]
    else:
        fused = [rand(), rand(0.1)]
        cases = [dict(first_step=True, nesterov=False, momentum=0.9),
                 dict(first_step=False, nesterov=True, momentum=0.9),
                 dict(first_step=False, nesterov=False, momentum=0.0)]
    ref = [t.clone() for t in fused]
    try:
        for i, case in enumerate(cases):
            grad = rand()
            grad_before = grad.clone()
            before = fused[0].clone()
            if kind == "adam":
                hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=3e-3, step=i + 1, **case)
                _fused_adam(driver, *fused[:1], grad, *fused[1:], **hp)
                optim_reference.adam_step(ref[0], grad, ref[1], ref[2], **hp)
            else:
                hp = dict(lr=0.1, weight_decay=0.01, **case)
                _fused_sgd(driver, fused[0], grad, fused[1], **hp)
                optim_reference.sgd_step(ref[0], grad, ref[1], dampening=0.0, **hp)
            if not torch.equal(grad.cpu(), grad_before.cpu()):
                return "it wrote into the gradient, which the kernels must only read"
            update = (ref[0] - before).norm().item()
            for name, got, want, scale in (("parameter", fused[0], ref[0], update),
                                           *((f"state {j}", fused[j], ref[j], ref[j].norm().item())
                                             for j in range(1, len(fused)))):
                err = (got - want).norm().item()
                if not err <= SELF_CHECK_RTOL * scale + 1e-12:
                    return (f"{name} after step {i + 1} of {case} differs from the reference by "
                            f"{err:.3g} (allowed {SELF_CHECK_RTOL:g} x {scale:.3g})")
    except Exception as exc:  # an op that cannot run our way must not take training down
        return f"{type(exc).__name__}: {exc}"
    return None
