"""Optimizer kernels (accel_kernels.optim_*) against float64 formulas written here.

The float64 references below are written straight from the Adam/AdamW paper formulas
and torch.optim.SGD's documented algorithm, independently of the kernels' code.

Tolerances. The kernels compute in float32. Each step is checked against the float64
formula applied to the kernel's *own* fp32 state before that step (so errors are not
compounded and every step is checked tightly), over 50 steps so that bias correction
is exercised from t=1 onward. The float32 result of a handful of roundings (~6 ops)
differs from the exact value by a few units in the last place of the magnitudes
involved, so the bound per element is

    |kernel - exact| <= 16 * 2**-23 * (sum of |terms| that make up the value)

e.g. for the parameter |p_old| + |decay term| + |update|. 16 ulps leave room for the
fused kernels' different operation order (FMA, reciprocal multiply) while still being
small enough that a learning rate off by 1e-5 relative, a bias correction computed from
an fp32-rounded beta2, or eps moved inside the square root each fail it (checked by
mutating a copy of the reference while writing these tests). A free-running 50-step
trajectory is also compared, with the per-step bounds summed over the steps (errors may
add up).
"""
from __future__ import annotations

import math

import pytest
import torch

from zero_core.accel_kernels import optim_cpu, optim_fused, optim_reference

# optim_fused (the cuda/xpu kernel sets) runs on CPU tensors too: torch's fused ops have
# CPU kernels, so its bias_correction handling is checked here on fresh random inputs
KERNELS = [optim_reference, optim_cpu, optim_fused]
IDS = ["reference", "cpu", "fused"]
SIZES = [1, 7, 1023, 4099]
ULP = 2.0 ** -23
STEP_ULPS = 16


# ---------------------------------------------------------------- float64 references


def adam64(p, g, m, v, *, lr, b1, b2, eps, wd, t, adamw, bias_correction):
    """One Adam/AdamW step in float64; returns new (p, m, v) and the magnitude scale of p."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    decay = torch.zeros_like(p)
    scale_g = g.abs()  # g + wd*p may cancel: its rounding error scales with both terms
    if wd and not adamw:
        scale_g = g.abs() + (wd * p).abs()
        g = g + wd * p
    if wd and adamw:
        decay = -lr * wd * p
    m_new = b1 * m + (1 - b1) * g
    v_new = b2 * v + (1 - b2) * g * g
    c1 = 1 - b1 ** t if bias_correction else 1.0
    c2 = 1 - b2 ** t if bias_correction else 1.0
    denom = torch.sqrt(v_new / c2) + eps
    update = -(lr / c1) * m_new / denom
    p_new = p + decay + update
    scale_m = (b1 * m).abs() + (1 - b1) * scale_g
    scale_v = (b2 * v).abs() + (1 - b2) * scale_g * scale_g
    # an error of scale_m in m moves the update by lr/c1*scale_m/denom; a relative error
    # of scale_v/v in v moves it by about half that fraction of |update|
    scale_p = (p.abs() + decay.abs() + (lr / c1) * scale_m / denom
               + update.abs() * scale_v / v_new.clamp_min(1e-300))
    return p_new, m_new, v_new, (scale_p, scale_m, scale_v)


def sgd64(p, g, buf, *, lr, mu, damp, wd, nesterov, first):
    """One torch.optim.SGD step in float64; returns new (p, buf) and magnitude scales."""
    p, g = p.double(), g.double()
    d = g + wd * p
    scale_d = g.abs() + (wd * p).abs()
    new_buf = None
    scale_buf = None
    if mu:
        buf = buf.double()
        if first:
            new_buf, scale_buf = d.clone(), scale_d
        else:
            new_buf = mu * buf + (1 - damp) * d
            scale_buf = (mu * buf).abs() + ((1 - damp) * d).abs()
        if nesterov:
            d, scale_d = d + mu * new_buf, scale_d + (mu * new_buf).abs()
        else:
            d, scale_d = new_buf, scale_buf
    p_new = p - lr * d
    return p_new, new_buf, (p.abs() + lr * scale_d, scale_buf)


def assert_close(name, got, exact, scale, ulps):
    err = (got.double() - exact).abs()
    bound = ulps * ULP * scale + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, (f"{name}: max error {err.max().item():.3e} is {worst:.2f}x the "
                          f"bound of {ulps} ulps of the magnitudes involved")


def randn(n, gen, scale=1.0):
    return torch.randn(n, generator=gen, dtype=torch.float32) * scale


# ---------------------------------------------------------------- Adam


ADAM_CASES = [  # (adamw, bias_correction, weight_decay)
    (False, True, 0.0), (False, True, 0.05), (True, True, 0.05), (True, False, 0.1),
    (False, False, 0.02), (True, True, 0.0),
]


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw,bias_correction,wd", ADAM_CASES)
def test_adam_each_step_matches_float64(kernel, n, adamw, bias_correction, wd):
    gen = torch.Generator().manual_seed(hash((n, adamw, bias_correction, wd)) % 2**31)
    hp = dict(lr=3e-3, b1=0.9, b2=0.999, eps=1e-8, wd=wd)
    p = randn(n, gen)
    m = torch.zeros(n)
    v = torch.zeros(n)
    for t in range(1, 51):
        # gradient magnitudes from 1e-7 to 10: at the low end sqrt(v) ~ eps, so a
        # misplaced eps or bias correction shows; at the high end rounding dominates
        g = randn(n, gen, scale=10.0 ** float(torch.empty(1).uniform_(-7, 1, generator=gen)))
        g_before = g.clone()
        exact_p, exact_m, exact_v, (sp, sm, sv) = adam64(
            p, g, m, v, t=t, adamw=adamw, bias_correction=bias_correction, **hp)
        kernel.adam_step(p, g, m, v, lr=hp["lr"], beta1=hp["b1"], beta2=hp["b2"],
                         eps=hp["eps"], weight_decay=wd, step=t, adamw=adamw,
                         bias_correction=bias_correction)
        assert torch.equal(g, g_before), "the kernel modified grad"
        assert_close(f"exp_avg step {t}", m, exact_m, sm, STEP_ULPS)
        assert_close(f"exp_avg_sq step {t}", v, exact_v, sv, STEP_ULPS)
        assert_close(f"param step {t}", p, exact_p, sp, STEP_ULPS)


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize("adamw", [False, True])
def test_adam_trajectory_50_steps(kernel, adamw):
    """Free-running: the kernel's own state drives it; the float64 run is never resynced."""
    n = 4099
    gen = torch.Generator().manual_seed(7 + adamw)
    hp = dict(lr=1e-2, b1=0.8, b2=0.99, eps=1e-6, wd=0.03)
    p = randn(n, gen)
    m, v = torch.zeros(n), torch.zeros(n)
    p64, m64, v64 = p.double(), m.double(), v.double()
    scale = torch.zeros(n, dtype=torch.float64)
    for t in range(1, 51):
        g = randn(n, gen)
        p64, m64, v64, (sp, _, _) = adam64(p64, g, m64, v64, t=t, adamw=adamw,
                                           bias_correction=True, **hp)
        scale += sp
        kernel.adam_step(p, g, m, v, lr=hp["lr"], beta1=hp["b1"], beta2=hp["b2"],
                         eps=hp["eps"], weight_decay=hp["wd"], step=t, adamw=adamw)
    assert_close("param after 50 steps", p, p64, scale, STEP_ULPS)


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [7, 4099, (1 << 20) + 3])
def test_adam_param_lowp_is_rounded_fp32_result(kernel, dtype, n):
    gen = torch.Generator().manual_seed(n)
    p, m, v = randn(n, gen), torch.zeros(n), torch.zeros(n)
    lowp = torch.full((n,), float("nan"), dtype=dtype)
    twin = [p.clone(), m.clone(), v.clone()]
    for t in range(1, 4):
        g = randn(n, gen)
        kernel.adam_step(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.01, step=t, adamw=True, param_lowp=lowp)
        # the same step without the low-precision copy must give the same fp32 state
        kernel.adam_step(*twin[:1], g, *twin[1:], lr=1e-2, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.01, step=t, adamw=True)
        assert torch.equal(lowp, p.to(dtype)), "param_lowp is not the rounded fp32 param"
        assert torch.equal(p, twin[0]) and torch.equal(m, twin[1]) and torch.equal(v, twin[2])


# ---------------------------------------------------------------- SGD


SGD_CASES = [  # (momentum, dampening, nesterov, weight_decay)
    (0.0, 0.0, False, 0.0), (0.0, 0.0, False, 0.1), (0.9, 0.0, False, 0.0),
    (0.9, 0.1, False, 0.05), (0.9, 0.0, True, 0.05), (0.5, 0.5, False, 0.0),
]


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mu,damp,nesterov,wd", SGD_CASES)
def test_sgd_each_step_matches_float64(kernel, n, mu, damp, nesterov, wd):
    gen = torch.Generator().manual_seed(hash((n, mu, damp, nesterov, wd)) % 2**31)
    lr = 0.05
    p = randn(n, gen)
    buf = torch.full((n,), float("nan")) if mu else None  # first step must overwrite it
    for t in range(1, 51):
        g = randn(n, gen)
        g_before = g.clone()
        exact_p, exact_buf, (sp, sb) = sgd64(p, g, buf, lr=lr, mu=mu, damp=damp, wd=wd,
                                             nesterov=nesterov, first=t == 1)
        kernel.sgd_step(p, g, buf, lr=lr, momentum=mu, dampening=damp, weight_decay=wd,
                        nesterov=nesterov, first_step=t == 1)
        assert torch.equal(g, g_before), "the kernel modified grad"
        if mu:
            assert_close(f"momentum_buffer step {t}", buf, exact_buf, sb, STEP_ULPS)
        assert_close(f"param step {t}", p, exact_p, sp, STEP_ULPS)


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1023, (1 << 20) + 5])
def test_sgd_param_lowp_is_rounded_fp32_result(kernel, dtype, n):
    gen = torch.Generator().manual_seed(n + 1)
    p, buf = randn(n, gen), torch.zeros(n)
    lowp = torch.zeros(n, dtype=dtype)
    p2, buf2 = p.clone(), buf.clone()
    for t in range(1, 4):
        g = randn(n, gen)
        kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True,
                  first_step=t == 1)
        kernel.sgd_step(p, g, buf, param_lowp=lowp, **kw)
        kernel.sgd_step(p2, g, buf2, **kw)
        assert torch.equal(lowp, p.to(dtype))
        assert torch.equal(p, p2) and torch.equal(buf, buf2)


# ---------------------------------------------------------------- errors


def _adam_args(n=8):
    return [torch.zeros(n) for _ in range(4)]


ADAM_KW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
               adamw=True)


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize("which,bad,exc,words", [
    (1, torch.zeros(8, dtype=torch.float64), TypeError, "grad has dtype torch.float64"),
    (2, torch.zeros(9), ValueError, "exp_avg has 9 elements"),
    (3, torch.zeros(4, 2), ValueError, "exp_avg_sq must be flat"),
    (0, torch.zeros(16)[::2], ValueError, "param must be flat and contiguous"),
    (1, torch.zeros(8, device="meta"), ValueError, "grad is on meta"),
    (1, [0.0] * 8, TypeError, "grad must be a torch.Tensor"),
])
def test_adam_rejects_bad_tensors(kernel, which, bad, exc, words):
    args = _adam_args()
    args[which] = bad
    with pytest.raises(exc, match=words.replace("(", r"\(")):
        kernel.adam_step(*args, **ADAM_KW)


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize("change,words", [
    (dict(step=0), "step must be the 1-based"),
    (dict(beta1=1.0), "beta1=1.0 is outside"),
    (dict(eps=0.0), "eps=0.0 must be > 0"),
    (dict(lr=float("nan")), "lr=nan must be"),
    (dict(param_lowp=torch.zeros(8, dtype=torch.int8)), "param_lowp has dtype torch.int8"),
    (dict(param_lowp=torch.zeros(7, dtype=torch.bfloat16)), "param_lowp has 7 elements"),
])
def test_adam_rejects_bad_arguments(kernel, change, words):
    with pytest.raises((ValueError, TypeError), match=words):
        kernel.adam_step(*_adam_args(), **{**ADAM_KW, **change})


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_sgd_rejects_bad_arguments(kernel):
    p, g = torch.zeros(5), torch.zeros(5)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
              first_step=True)
    with pytest.raises(ValueError, match="needs a momentum_buffer"):
        kernel.sgd_step(p, g, None, **kw)
    with pytest.raises(ValueError, match="momentum_buffer has 4 elements"):
        kernel.sgd_step(p, g, torch.zeros(4), **kw)
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0 and dampening"):
        kernel.sgd_step(p, g, torch.zeros(5), **{**kw, "nesterov": True, "dampening": 0.1})
    with pytest.raises(TypeError, match="param has dtype torch.float16"):
        kernel.sgd_step(p.half(), g, torch.zeros(5), **kw)
    kernel.sgd_step(p, g, None, **{**kw, "momentum": 0.0})  # no buffer needed without momentum


def test_cpu_kernel_refuses_other_devices():
    args = [torch.zeros(4, device="meta") for _ in range(4)]
    with pytest.raises(ValueError, match="optim_cpu kernels run on CPU tensors"):
        optim_cpu.adam_step(*args, **ADAM_KW)


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_empty_partition_is_a_no_op(kernel):
    args = _adam_args(0)
    kernel.adam_step(*args, **ADAM_KW)
    kernel.sgd_step(args[0], args[1], args[2], lr=0.1, momentum=0.9, dampening=0.0,
                    weight_decay=0.0, nesterov=False, first_step=True)
