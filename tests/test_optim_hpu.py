"""accel_kernels.optim_hpu against a stand-in habana_frameworks and float64 formulas.

There is no Gaudi here. The stand-in below implements the two documented classes of
``habana_frameworks.torch.hpex.optimizers`` (FusedAdamW, FusedSGD; constructor signatures
as Habana publishes them) in float64 torch math written here from the algorithms, and
reads .grad / state / param_groups the way torch optimizers do. Where Habana's kernels
leave a choice open that optim_hpu must not depend on, the stand-in comes in both
flavours and the results must be right with either:

* FusedAdamW: decoupled decay applied before or after the update is subtracted;
* FusedSGD: the first momentum step of an object taken from its own counter (buffer :=
  gradient) or a plain ``buf = mu buf + (1 - dampening) d`` on every step.

The expected values come from the float64 recurrences of tests/float64_optim.py (torch.optim semantics),
run free over many steps, independently of optim_reference and of the stand-in.
"""
from __future__ import annotations

import importlib.machinery
import math
import sys
import types
import warnings
import zlib

import pytest
import torch
from torch.optim.optimizer import required

from zero_core.accel_kernels import optim_hpu
from zero_core.backends import kernel_sets
from float64_optim import adam64, sgd64  # the float64 reference (tests/float64_optim.py)

SIZES = [1, 7, 1023, 4099]
HPEX = "habana_frameworks.torch.hpex.optimizers"


# ---------------------------------------------------------------- the stand-in
class FakeFusedAdamW(torch.optim.Optimizer):
    """AdamW in float64, as the documented class: bias correction folded into the step
    size (the kernel adds eps to the uncorrected sqrt(v)), decay by (1 - lr wd)."""

    decay_after_update = False  # the flavour (class attribute, set per test)
    calls: list = []
    broken = None  # "ignore_group_lr" or "writes_grad": a wrong op the self-check must reject

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 bias_correction=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.constructor_lr = lr

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            b1, b2 = group["betas"]
            hyper = {k: group[k] for k in ("lr", "eps", "weight_decay", "bias_correction")}
            assert all(type(v) is float for v in (hyper["lr"], hyper["eps"], b1, b2,
                                                  hyper["weight_decay"])), group
            assert type(hyper["bias_correction"]) is bool
            lr = self.constructor_lr if self.broken == "ignore_group_lr" else group["lr"]
            size = lr
            if group["bias_correction"]:
                t = group["step"]
                size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                FakeFusedAdamW.calls.append(dict(param=p, grad=p.grad, state=dict(state),
                                                 betas=(b1, b2), **hyper))
                g = p.grad.double()
                m = b1 * state["exp_avg"].double() + (1 - b1) * g
                v = b2 * state["exp_avg_sq"].double() + (1 - b2) * g * g
                keep = 1 - group["lr"] * group["weight_decay"]
                w = p.double()
                upd = size * m / (v.sqrt() + group["eps"])
                w = (w - upd) * keep if self.decay_after_update else w * keep - upd
                p.copy_(w)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                if self.broken == "writes_grad":
                    p.grad.zero_()


class FakeFusedSGD(torch.optim.Optimizer):
    """torch.optim.SGD in float64, as the documented class."""

    first_step_by_counter = True  # the flavour
    calls: list = []

    def __init__(self, params, lr=required, momentum=0, weight_decay=0, dampening=0,
                 nesterov=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      dampening=dampening, nesterov=nesterov))
        self.momentum_steps = 0  # the object's own counter (kept on the device by Habana)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            mu, damp = group["momentum"], group["dampening"]
            assert all(type(group[k]) is float for k in ("lr", "momentum", "weight_decay",
                                                         "dampening")), group
            assert type(group["nesterov"]) is bool
            for p in group["params"]:
                if p.grad is None:
                    continue
                FakeFusedSGD.calls.append(dict(param=p, grad=p.grad,
                                               state=dict(self.state[p]), **group))
                d = p.grad.double() + group["weight_decay"] * p.double()
                if mu != 0:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    if self.first_step_by_counter and self.momentum_steps == 0:
                        new = d
                    else:
                        new = mu * buf.double() + (1 - damp) * d
                    buf.copy_(new)
                    d = d + mu * new if group["nesterov"] else new
                p.copy_(p.double() - group["lr"] * d)
            if mu != 0:
                self.momentum_steps += 1


@pytest.fixture
def habana(monkeypatch):
    """Install the stand-in as habana_frameworks.torch.hpex.optimizers; let optim_hpu step
    CPU tensors; start from fresh optimizer objects. Yields a function to pick flavours."""
    names = ["habana_frameworks", "habana_frameworks.torch", "habana_frameworks.torch.hpex",
             HPEX]
    mods = {}
    for name in names:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        mods[name] = mod
        monkeypatch.setitem(sys.modules, name, mod)
    for parent, child in zip(names, names[1:]):
        setattr(mods[parent], child.rpartition(".")[2], mods[child])
    mods[HPEX].FusedAdamW = FakeFusedAdamW
    mods[HPEX].FusedSGD = FakeFusedSGD
    monkeypatch.setattr(optim_hpu, "DEVICE_TYPES", ("hpu", "cpu"))
    FakeFusedAdamW.calls, FakeFusedSGD.calls = [], []
    optim_hpu.forget_drivers()

    def flavour(decay_after_update=False, first_step_by_counter=True, broken=None):
        monkeypatch.setattr(FakeFusedAdamW, "decay_after_update", decay_after_update)
        monkeypatch.setattr(FakeFusedAdamW, "broken", broken)
        monkeypatch.setattr(FakeFusedSGD, "first_step_by_counter", first_step_by_counter)
    flavour()
    yield flavour
    optim_hpu.forget_drivers()


def close(got, want, what, rtol=2e-5, atol=2e-6):
    """fp32 state against the free-running float64 recurrence. atol: 40 steps of fp32
    rounding (2**-24 relative each) of values up to ~2 stay below 40 * 2.4e-7 / 2 ~ 5e-6
    in the worst case, ~1e-7 typically; a wrong formula (eps or lr not bias-corrected,
    decay order, first momentum step) moves values by 1e-4..1e-1 here."""
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def gen_for(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# ---------------------------------------------------------------- Adam / AdamW
ADAM_CASES = [  # (adamw, bias_correction, weight_decay)
    (True, True, 0.1), (True, False, 0.05), (False, True, 0.05), (False, False, 0.02),
    (True, True, 0.0), (False, True, 0.0)]


@pytest.mark.parametrize("decay_after_update", [False, True], ids=["decay-first", "decay-last"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw,bias_correction,wd", ADAM_CASES)
def test_adam_matches_float64_over_many_steps(habana, decay_after_update, n, adamw,
                                              bias_correction, wd):
    habana(decay_after_update=decay_after_update)
    gen = gen_for("adam", n, adamw, bias_correction, wd)
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    lowp = torch.empty(n, dtype=torch.bfloat16)
    p64, m64, v64 = p.double(), m.double(), v.double()
    # eps of the order of sqrt(v) so that where it is added (and its bias correction) shows
    hp = dict(lr=2e-2, beta1=0.9, beta2=0.99, eps=1e-3, weight_decay=wd, adamw=adamw,
              bias_correction=bias_correction)
    for step in range(1, 41):
        g = torch.randn(n, generator=gen) * 0.05
        g_before = g.clone()
        FakeFusedAdamW.calls.clear()
        optim_hpu.adam_step(p, g, m, v, step=step, param_lowp=lowp, **hp)
        p64, m64, v64 = adam64(p64, g, m64, v64, step=step, **hp)
        assert torch.equal(g, g_before), "the gradient must only be read"
        # exactly one call of the documented class, on our tensors, with plain Adam settings
        # (the first call also runs optim_hpu's self-check on its own scratch tensors)
        (call,) = [c for c in FakeFusedAdamW.calls if c["param"] is p]
        assert call["param"] is p and call["state"]["exp_avg"] is m
        assert call["state"]["exp_avg_sq"] is v
        assert call["grad"] is g if (adamw or not wd) else call["grad"] is not g
        assert call["weight_decay"] == 0.0 and call["bias_correction"] is False
        assert p.grad is None, "the gradient must not stay attached to the partition"
        close(p, p64, f"param, step {step}")
        close(m, m64, f"exp_avg, step {step}")
        close(v, v64, f"exp_avg_sq, step {step}", atol=1e-11)
        assert torch.equal(lowp, p.to(torch.bfloat16)), "low-precision copy = rounded param"
    assert optim_hpu.status() == {"adam@cpu": "FusedAdamW"}


def test_adam_on_views_of_one_buffer_and_fp16_copy(habana):
    """Partitions are views into the engine's flat buffers; neighbours stay untouched."""
    gen = gen_for("views")
    flat = torch.randn(3 * 101, generator=gen)
    states = torch.zeros(2, 3 * 101)
    lowp = torch.zeros(3 * 101, dtype=torch.float16)
    before = flat.clone()
    sl = slice(101, 202)
    p64, m64, v64 = flat[sl].double(), torch.zeros(101).double(), torch.zeros(101).double()
    hp = dict(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=0.01, adamw=True,
              bias_correction=True)
    for step in (1, 2, 3):
        g = torch.randn(101, generator=gen)
        optim_hpu.adam_step(flat[sl], g, states[0, sl], states[1, sl], step=step,
                            param_lowp=lowp[sl], **hp)
        p64, m64, v64 = adam64(p64, g, m64, v64, step=step, **hp)
    close(flat[sl], p64, "param slice")
    close(states[0, sl], m64, "exp_avg slice")
    assert torch.equal(flat[:101], before[:101]) and torch.equal(flat[202:], before[202:])
    assert not states[:, :101].any() and not states[:, 202:].any()
    assert not lowp[:101].any() and not lowp[202:].any()
    assert torch.equal(lowp[sl], flat[sl].half())


# ---------------------------------------------------------------- SGD
SGD_CASES = [  # (momentum, dampening, nesterov, weight_decay)
    (0.0, 0.0, False, 0.0), (0.0, 0.3, False, 0.01), (0.9, 0.0, False, 0.01),
    (0.9, 0.0, True, 0.0), (0.8, 0.0, True, 0.02), (0.9, 0.2, False, 0.01)]


@pytest.mark.parametrize("by_counter", [True, False], ids=["counter", "plain"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("momentum,dampening,nesterov,wd", SGD_CASES)
def test_sgd_matches_float64_over_many_steps(habana, by_counter, n, momentum, dampening,
                                             nesterov, wd):
    habana(first_step_by_counter=by_counter)
    gen = gen_for("sgd", n, momentum, dampening, nesterov, wd)
    p = torch.randn(n, generator=gen)
    buf = torch.full((n,), float("nan")) if momentum else None  # first step must overwrite
    lowp = torch.empty(n, dtype=torch.bfloat16)
    p64, buf64 = p.double(), None
    hp = dict(lr=0.05, momentum=momentum, dampening=dampening, weight_decay=wd,
              nesterov=nesterov)
    for i in range(30):
        g = torch.randn(n, generator=gen)
        g_before = g.clone()
        FakeFusedSGD.calls.clear()
        optim_hpu.sgd_step(p, g, buf, first_step=i == 0, param_lowp=lowp, **hp)
        p64, buf64 = sgd64(p64, g, buf64, first_step=i == 0, **hp)
        assert torch.equal(g, g_before)
        fused = momentum == 0 or dampening == 0
        calls = [c for c in FakeFusedSGD.calls if c["param"] is p]
        assert len(calls) == (1 if fused else 0)
        if fused:
            (call,) = calls
            assert call["param"] is p and call["grad"] is g
            assert call["lr"] == hp["lr"] and call["nesterov"] is nesterov
            if momentum:
                assert call["state"]["momentum_buffer"] is buf
        close(p, p64, f"param, step {i + 1}")
        if momentum:
            close(buf, buf64, f"momentum buffer, step {i + 1}")
        assert torch.equal(lowp, p.to(torch.bfloat16))


@pytest.mark.parametrize("by_counter", [True, False], ids=["counter", "plain"])
def test_sgd_resumed_run_continues_the_loaded_momentum(habana, by_counter):
    """A run resumed from a checkpoint starts with first_step=False and a loaded buffer:
    the fresh optimizer object must not treat that call as its first step."""
    habana(first_step_by_counter=by_counter)
    gen = gen_for("resume", by_counter)
    n = 513
    p, buf = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    p64, buf64 = p.double(), buf.double()
    hp = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)
    for _ in range(3):
        g = torch.randn(n, generator=gen)
        optim_hpu.sgd_step(p, g, buf, first_step=False, **hp)
        p64, buf64 = sgd64(p64, g, buf64, first_step=False, **hp)
        close(p, p64, "param")
        close(buf, buf64, "momentum buffer")


# ---------------------------------------------------------------- self-check, selection, errors
@pytest.mark.parametrize("broken,words", [("ignore_group_lr", "differs from the reference"),
                                          ("writes_grad", "wrote into the gradient")])
def test_an_op_that_disagrees_is_not_used(habana, broken, words):
    habana(broken=broken)
    gen = gen_for("broken", broken)
    n = 300
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    p64, m64, v64 = p.double(), m.double(), v.double()
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True,
              bias_correction=True)
    with pytest.warns(RuntimeWarning, match=f"FusedAdamW failed the self-check.*{words}"):
        g = torch.randn(n, generator=gen)
        optim_hpu.adam_step(p, g, m, v, step=1, **hp)
    p64, m64, v64 = adam64(p64, g, m64, v64, step=1, **hp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not on every step
        g = torch.randn(n, generator=gen)
        optim_hpu.adam_step(p, g, m, v, step=2, **hp)
    p64, m64, v64 = adam64(p64, g, m64, v64, step=2, **hp)
    close(p, p64, "param")
    close(m, m64, "exp_avg")
    assert optim_hpu.status()["adam@cpu"].startswith("reference (")


def test_kernel_set_selects_optim_hpu_when_habana_frameworks_is_there(habana):
    hpu = {ks.name: ks for ks in kernel_sets.builtin_kernel_sets()}["hpu"]
    assert hpu.adam_step is optim_hpu.adam_step and hpu.sgd_step is optim_hpu.sgd_step
    assert hpu.info["adam_step"] == "zero_core.accel_kernels.optim_hpu.adam_step"
    assert "FusedAdamW" in hpu.info["implementation"] and "fallback_reason" not in hpu.info


def test_kernel_set_falls_back_and_says_why_without_habana_frameworks(monkeypatch):
    monkeypatch.setitem(sys.modules, "habana_frameworks", None)  # import fails, find_spec too
    hpu = {ks.name: ks for ks in kernel_sets.builtin_kernel_sets()}["hpu"]
    assert hpu.info["adam_step"].startswith(kernel_sets.REFERENCE)
    assert "habana_frameworks is not installed" in hpu.info["fallback_reason"]


def test_call_without_habana_frameworks_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "habana_frameworks", None)
    monkeypatch.setattr(optim_hpu, "DEVICE_TYPES", ("hpu", "cpu"))
    optim_hpu.forget_drivers()
    p = torch.zeros(4)
    with pytest.raises(ModuleNotFoundError, match="needs habana_frameworks.*Intel Gaudi") as err:
        optim_hpu.adam_step(p, torch.ones(4), torch.zeros(4), torch.zeros(4), lr=1e-3,
                            beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                            adamw=True)
    assert err.value.name == "habana_frameworks"
    with pytest.raises(ModuleNotFoundError, match="habana_frameworks"):
        optim_hpu.sgd_step(p, torch.ones(4), None, lr=0.1, momentum=0.0, dampening=0.0,
                           weight_decay=0.0, nesterov=False, first_step=True)
    assert torch.equal(p, torch.zeros(4)), "nothing may be half-updated"


def test_host_tensors_are_refused_with_a_pointer_to_the_cpu_set():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="HPU tensors, param is on cpu.*'cpu'"):
        optim_hpu.sgd_step(p, torch.ones(4), None, lr=0.1, momentum=0.0, dampening=0.0,
                           weight_decay=0.0, nesterov=False, first_step=True)


def test_bad_arguments_are_caught_before_habana_is_needed(monkeypatch):
    monkeypatch.setitem(sys.modules, "habana_frameworks", None)
    with pytest.raises(ValueError, match="step must be the 1-based"):
        optim_hpu.adam_step(torch.zeros(4), torch.ones(4), torch.zeros(4), torch.zeros(4),
                            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            step=0, adamw=True)
