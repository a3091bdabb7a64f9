"""CPU optimizer kernels over Intel Extension for PyTorch's fused steps (IPEX 2.8, CPU build).

The ``ipex`` kernel set (``backends/kernel_sets.py``): the signatures and semantics of
:mod:`.optim_reference`, on CPU tensors, through ``torch.ops.torch_ipex.adam_fused_step`` and
``torch.ops.torch_ipex.sgd_fused_step`` (the ops behind ``ipex.optim`` / ``ipex.optimize``).
IPEX is imported on the first call or by :func:`load_ops`, never at import of this module (it
takes seconds, and a mismatched one must not be imported at all: see "Loading"). Its import
also replaces some of torch's own CPU kernels (autocast, linear algebra: the forward pass's
rounding changes), so when ``ZERO_CORE_CPU_KERNELS=ipex`` makes these the cpu kernels the
registry calls :func:`load_ops` before any model runs (backends/kernel_sets.py).

What the ops compute, read in IPEX's kernels (csrc/cpu/aten/kernels/optimizer/, IPEX 2.8) and
checked by calling them here (tests/test_kernels_ipex.py):

* ``adam_fused_step(param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, param2, amsgrad, step,
  beta1, beta2, lr, weight_decay, eps)``: Adam with L2 decay (``g + wd p``) and torch's bias
  corrections, ``p -= lr/(1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)``, one pass. The
  corrections are computed as ``1 - pow(beta, step)`` in double, so ``step = +inf`` gives
  exactly 1 for both: that is how ``bias_correction=False`` is passed (as in optim_fused).
* There is no AdamW op: decoupled decay is the exact pre-scale ``p *= 1 - lr wd`` (the
  reference's own order) followed by the op with ``weight_decay=0`` — one more read and write
  of the parameter (measured in ci/bench/ipex_kernels.py).
* ``param2``, the "bf16 path": the op writes a bf16 copy of the updated fp32 parameter in the
  same pass (rounded to nearest even, like ``Tensor.to``) only when the *gradient* is bf16
  (its float/bf16 kernel; a bf16 param plus bf16 ``param2`` is the split "trail" master
  weight). With the fp32 gradient of this interface the op dispatches on the gradient's dtype
  to its fp32 kernel, which ignores ``param2``. Rounding the gradient to bf16 to reach that
  path would change the update, so *param_lowp* is written by a rounding copy after the op,
  exactly as in optim_cpu; fp16 copies likewise (IPEX has no fp16 path).
* ``sgd_fused_step(param, grad, momentum_buf, param2, momentum, lr, weight_decay, dampening,
  nesterov)``: torch.optim.SGD's update; with ``momentum_buf=None`` it starts a buffer of its
  own (buf := d), with a buffer it always continues it (buf := mu buf + (1 - dampening) d). For
  *first_step* with dampening == 0, our buffer is zeroed first (mu * 0 + d = d, exactly);
  with dampening != 0 the first step runs optim_cpu's kernel.
* *found_inf* (1.0: skip the step; torch's fused ops' meaning) is not taken by IPEX's ops: it is
  read on the host before the op. On CPU tensors that read costs no device synchronization.

Self-check. The first time each (kind, low-precision dtype) is stepped — kind being adam (L2),
adamw or sgd — a scratch partition of 259 elements (not a multiple of the vector width, so
IPEX's scalar tail runs too) is stepped three times next to :mod:`.optim_reference`, with eps
large enough to matter, decay on, bias correction on and off, first and later SGD steps. If
the op raises, writes the gradient, differs from the reference by more than
``SELF_CHECK_RTOL`` of the update (parameter) or of the state's norm, or the low-precision
copy is not the nearest-even rounding of the new parameter, a RuntimeWarning says so and that
kind runs optim_cpu's kernels (torch's fused ops) for the rest of the process: correct,
never slower than before. :func:`status` tells which path each kind takes and why; the
kernel set's ``info`` gets the same lines (:func:`report_into`).

Loading. IPEX 2.8 is built for torch 2.8 only and its wheel does not say so; imported beside
another torch it fails after registering part of its kernels. The first call therefore
compares IPEX's package version with torch's (major.minor) before importing it, and a
mismatch, a missing IPEX or a failed import makes every kind run optim_cpu's kernels, with
the reason in :func:`status` (the registry refuses such an IPEX earlier, so this is the
guard for direct callers).
"""
from __future__ import annotations

import math
import re
import warnings
from importlib import metadata

import torch

from . import optim_cpu, optim_reference
from .optim_checks import check_adam_args, check_sgd_args

#: IPEX's import name and distribution name
MODULE = "intel_extension_for_pytorch"
DISTRIBUTION = "intel-extension-for-pytorch"
#: relative disagreement with the reference above which the self-check rejects an op (IPEX
#: 2.8's ops differ from the reference in rounding only: at most 1.2e-6 of the update on the
#: scratch partition, measured; a wrong formula, e.g. no bias correction, is off by > 1e-2)
SELF_CHECK_RTOL = 1e-4
#: scratch partition of the self-check
SELF_CHECK_NUMEL = 259

_OPS = None         # torch.ops.torch_ipex once loaded
_LOAD_ERROR = None  # why IPEX cannot be used (then every kind runs optim_cpu)
_VERDICTS: dict = {}  # (kind, lowp dtype) -> None (the IPEX op passed) or why not
_REPORT_TO: list = []  # info dicts that get the verdicts (report_into)


# ---- public kernels -----------------------------------------------------------------------
def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, step: int, adamw: bool,
              bias_correction: bool = True,
              param_lowp: torch.Tensor | None = None,
              found_inf: torch.Tensor | None = None) -> None:
    """One Adam (adamw=False, L2) or AdamW (adamw=True, decoupled decay) step, in place,
    through IPEX's fused Adam.

    Same contract as :func:`zero_core.accel_kernels.optim_reference.adam_step`: flat
    contiguous fp32 CPU tensors of one size, *grad* only read, *step* the 1-based count after
    this update, optional bf16/fp16 *param_lowp* written rounded (nearest even) after the
    step; *found_inf* 1.0: nothing changes.
    """
    check_adam_args(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, weight_decay=weight_decay, step=step, param_lowp=param_lowp)
    _require_cpu(param)
    if param.numel() == 0 or _skipped(found_inf):
        return
    kind = "adamw" if adamw else "adam"
    if not _usable(kind, param_lowp):
        optim_cpu.adam_step(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
                            eps=eps, weight_decay=weight_decay, step=step, adamw=adamw,
                            bias_correction=bias_correction, param_lowp=param_lowp)
        return
    _ipex_adam(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
               weight_decay=weight_decay, step=step, adamw=adamw,
               bias_correction=bias_correction, param_lowp=param_lowp)


def sgd_step(param: torch.Tensor, grad: torch.Tensor,
             momentum_buffer: torch.Tensor | None, *, lr: float, momentum: float,
             dampening: float, weight_decay: float, nesterov: bool, first_step: bool,
             param_lowp: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None) -> None:
    """One SGD step with torch.optim.SGD semantics, in place, through IPEX's fused SGD.

    Same contract as :func:`zero_core.accel_kernels.optim_reference.sgd_step`;
    *momentum_buffer* is ignored (and may be None) when momentum == 0; *found_inf* as in
    :func:`adam_step`.
    """
    check_sgd_args(param, grad, momentum_buffer, lr=lr, momentum=momentum,
                   dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                   param_lowp=param_lowp)
    _require_cpu(param)
    if param.numel() == 0 or _skipped(found_inf):
        return
    first_damped = momentum != 0 and first_step and dampening != 0
    if first_damped or not _usable("sgd", param_lowp):
        optim_cpu.sgd_step(param, grad, momentum_buffer, lr=lr, momentum=momentum,
                           dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                           first_step=first_step, param_lowp=param_lowp)
        return
    _ipex_sgd(param, grad, momentum_buffer, lr=lr, momentum=momentum, dampening=dampening,
              weight_decay=weight_decay, nesterov=nesterov, first_step=first_step,
              param_lowp=param_lowp)


def status() -> dict:
    """Which path each kind stepped so far takes: ``{"adam": "IPEX adam_fused_step"}`` or
    ``{"adam": "optim_cpu (<why the IPEX op is not used>)"}``; keys name the low-precision
    dtype when one was given (``"adam+bfloat16"``)."""
    return {_label(kind, dtype): _path(why) for (kind, dtype), why in _VERDICTS.items()}


def report_into(info: dict) -> None:
    """Write every verdict (now and later) into *info* as ``path <kind>`` lines (the kernel
    set's info dict, which ``zero-core report`` and the engine's logs show)."""
    _REPORT_TO.append(info)
    for key, why in _VERDICTS.items():
        info[f"path {_label(*key)}"] = _path(why)


def forget() -> None:
    """Drop the loaded ops and the verdicts (tests)."""
    global _OPS, _LOAD_ERROR
    _OPS, _LOAD_ERROR = None, None
    _VERDICTS.clear()


# ---- the IPEX steps -----------------------------------------------------------------------
def _ipex_adam(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
               adamw, bias_correction, param_lowp, ops=None):
    ops = _OPS if ops is None else ops
    decay = float(weight_decay)
    if adamw:
        if decay != 0:
            param.mul_(1.0 - lr * decay)  # decoupled decay first, as the reference does
        decay = 0.0
    # +inf makes both corrections 1 - beta**inf exactly 1 (module docstring)
    t = float(step) if bias_correction else math.inf
    ops.adam_fused_step(param, exp_avg, exp_avg_sq, _EMPTY, grad, _EMPTY, False, t,
                        float(beta1), float(beta2), float(lr), decay, float(eps))
    if param_lowp is not None:
        param_lowp.copy_(param)


def _ipex_sgd(param, grad, momentum_buffer, *, lr, momentum, dampening, weight_decay,
              nesterov, first_step, param_lowp, ops=None):
    ops = _OPS if ops is None else ops
    buf = None
    if momentum != 0:
        buf = momentum_buffer
        if first_step:  # dampening is 0 here: mu * 0 + d = d, torch's first step
            buf.zero_()
    ops.sgd_fused_step(param, grad, buf, _EMPTY, float(momentum), float(lr),
                       float(weight_decay), float(dampening), bool(nesterov))
    if param_lowp is not None:
        param_lowp.copy_(param)


_EMPTY = torch.empty(0)


# ---- loading and self-check ---------------------------------------------------------------
def _require_cpu(param: torch.Tensor) -> None:
    if param.device.type != "cpu":
        raise ValueError(f"optim_ipex kernels run on CPU tensors, param is on {param.device}; "
                         "use the kernel set of that device's accelerator instead")


def _skipped(found_inf) -> bool:
    """found_inf read on the host (CPU tensors: no synchronization); 1.0 skips, as in
    torch's fused ops."""
    return found_inf is not None and float(found_inf) == 1.0


def _minor(version: str):
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else None


def load_ops():
    """``torch.ops.torch_ipex`` (importing IPEX now), or None with the reason in
    :data:`_LOAD_ERROR`; a version that does not match torch's is not imported."""
    global _OPS, _LOAD_ERROR
    if _OPS is not None or _LOAD_ERROR is not None:
        return _OPS
    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        version = None
    if version is not None and _minor(version) != _minor(torch.__version__):
        _LOAD_ERROR = (f"{DISTRIBUTION} {version} is not built for torch {torch.__version__}; "
                       f"not imported")
        return None
    try:
        __import__(MODULE)
        ops = torch.ops.torch_ipex
        for name in ("adam_fused_step", "sgd_fused_step"):
            getattr(ops, name)  # raises if this IPEX build lacks the op
        _OPS = ops
    except (Exception, SystemExit) as exc:  # IPEX's own version check exits
        _OPS, _LOAD_ERROR = None, f"{MODULE} could not be loaded ({type(exc).__name__}: {exc})"
    return _OPS


def load_error() -> str | None:
    """Why IPEX's ops are not used (after :func:`load_ops`), or None."""
    return _LOAD_ERROR


def _usable(kind: str, param_lowp) -> bool:
    """Whether *kind* runs IPEX's op (self-checked on first use), else optim_cpu."""
    key = (kind, None if param_lowp is None else param_lowp.dtype)
    if key not in _VERDICTS:
        ops = load_ops()
        why = _LOAD_ERROR if ops is None else self_check(kind, key[1], ops)
        if why is not None and ops is not None:
            warnings.warn(f"zero-core optim_ipex: IPEX's {kind} op failed the self-check "
                          f"({why}); {_label(*key)} runs optim_cpu's kernels (torch's fused "
                          f"ops) instead", RuntimeWarning, stacklevel=3)
        elif why is not None:
            warnings.warn(f"zero-core optim_ipex: {why}; the ipex kernel set runs optim_cpu's "
                          f"kernels (torch's fused ops) instead", RuntimeWarning, stacklevel=3)
        _VERDICTS[key] = why
        for info in _REPORT_TO:
            info[f"path {_label(*key)}"] = _path(why)
    return _VERDICTS[key] is None


def _label(kind, dtype) -> str:
    return kind if dtype is None else f"{kind}+{str(dtype).replace('torch.', '')}"


def _path(why) -> str:
    return "IPEX fused op (self-check passed)" if why is None else f"optim_cpu ({why})"


def self_check(kind: str, lowp_dtype, ops) -> str | None:
    """Step a scratch partition through *ops* and through optim_reference: None if they
    agree, else what went wrong (see the module docstring)."""
    gen = torch.Generator().manual_seed(4321)
    n = SELF_CHECK_NUMEL

    def rand(scale=1.0, positive=False):
        x = torch.rand(n, generator=gen) if positive else torch.randn(n, generator=gen)
        return x * scale

    if kind in ("adam", "adamw"):
        # eps comparable to sqrt(v), so that where eps sits shows
        mine = [rand(), rand(0.01), rand(1e-4, positive=True)]
        cases = [dict(weight_decay=0.1, bias_correction=True),
                 dict(weight_decay=0.05, bias_correction=False),
                 dict(weight_decay=0.0, bias_correction=True)]
    else:
        mine = [rand(), rand(0.1)]
        cases = [dict(first_step=True, nesterov=False, momentum=0.9),
                 dict(first_step=False, nesterov=True, momentum=0.9),
                 dict(first_step=False, nesterov=False, momentum=0.0)]
    ref = [t.clone() for t in mine]
    lowp = None if lowp_dtype is None else torch.empty(n, dtype=lowp_dtype)
    try:
        for i, case in enumerate(cases):
            grad = rand()
            grad_before = grad.clone()
            before = ref[0].clone()
            if kind == "sgd":
                hp = dict(lr=0.1, weight_decay=0.01, dampening=0.0, **case)
                _ipex_sgd(mine[0], grad, mine[1], param_lowp=lowp, ops=ops, **hp)
                optim_reference.sgd_step(ref[0], grad, ref[1], **hp)
            else:
                hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=3e-3, step=i + 1,
                          adamw=kind == "adamw", **case)
                _ipex_adam(mine[0], grad, mine[1], mine[2], param_lowp=lowp, ops=ops, **hp)
                optim_reference.adam_step(ref[0], grad, ref[1], ref[2], **hp)
            if not torch.equal(grad, grad_before):
                return "it wrote into the gradient, which the kernels must only read"
            update = (ref[0] - before).norm().item()
            for name, got, want, scale in (("parameter", mine[0], ref[0], update),
                                           *((f"state {j}", mine[j], ref[j], ref[j].norm().item())
                                             for j in range(1, len(mine)))):
                err = (got - want).norm().item()
                if not err <= SELF_CHECK_RTOL * scale + 1e-12:
                    return (f"{name} after step {i + 1} of {case} differs from optim_reference "
                            f"by {err:.3g} (allowed {SELF_CHECK_RTOL:g} x {scale:.3g})")
            if lowp is not None and not torch.equal(lowp, mine[0].to(lowp_dtype)):
                return (f"the {lowp_dtype} copy is not the nearest-even rounding of the updated "
                        f"parameter")
    except Exception as exc:  # an op that cannot run our way must not take training down
        return f"{type(exc).__name__}: {exc}"
    return None
