"""The ipex kernel set: accel_kernels.optim_ipex and its registration, against float64 math.

Without IPEX (the main CI venv) the module runs on a stand-in for ``torch.ops.torch_ipex``
written here in float64 from IPEX 2.8's kernels as its sources describe them (Adam with L2
decay, corrections ``1 - beta**step``, eps added to ``sqrt(v / c2)``; SGD that starts its own
buffer when given none), so that optim_ipex's own work is checked: the AdamW pre-scale,
``bias_correction=False`` through ``step=inf``, the first SGD step, *found_inf*, the
low-precision copy, and the self-check's fallback to optim_cpu when the op is wrong (a
deliberately broken stand-in). The registry is checked with ipex.state() faked (absent,
mismatched, matching). The tests marked ``needs_ipex`` run the real ops; they need torch 2.8
+ intel-extension-for-pytorch 2.8 (ci/torch_range.sh's ipex leg) and skip elsewhere.
Expected values come from the float64 recurrences of tests/float64_optim.py, on fresh random inputs.
"""
from __future__ import annotations

import math
import warnings
import zlib

import pytest
import torch

from zero_core.accel_kernels import optim_cpu, optim_ipex
from zero_core.backends import kernel_sets
from zero_core.backends.accelerators import ipex
from zero_core.errors import ConfigError
from float64_optim import adam64, sgd64  # the float64 reference (tests/float64_optim.py)

IPEX_OK = ipex.state()[0] == "ok"
needs_ipex = pytest.mark.skipif(not IPEX_OK, reason=f"needs a matching IPEX ({ipex.state()[1]}); "
                                "run it in ci/torch_range.sh's ipex leg")
ADAM = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-3, weight_decay=0.05)


# ---------------------------------------------------------------- the stand-in ops
class FakeIpexOps:
    """torch.ops.torch_ipex's two fused steps on fp32 CPU tensors, computed in float64.
    *bug*: None, "no_bias_correction", "writes_grad" or "raises" (a broken build)."""

    def __init__(self, bug=None):
        self.bug, self.calls = bug, 0

    def adam_fused_step(self, param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, param2, amsgrad,
                        step, beta1, beta2, lr, weight_decay, eps):
        self.calls += 1
        if self.bug == "raises":
            raise RuntimeError("adam_fused_step: expect bfloat16 or float or double param")
        assert not amsgrad and max_exp_avg_sq.numel() == 0 and param2.numel() == 0
        p, g = param.double(), grad.double() + weight_decay * param.double()
        if self.bug == "writes_grad":
            grad.copy_(g)
        m = beta1 * exp_avg.double() + (1 - beta1) * g
        v = beta2 * exp_avg_sq.double() + (1 - beta2) * g * g
        c1, c2 = 1 - math.pow(beta1, step), 1 - math.pow(beta2, step)
        if self.bug == "no_bias_correction":
            c1 = c2 = 1.0
        param.copy_(p - (lr / c1) * m / ((v / c2).sqrt() + eps))
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)

    def sgd_fused_step(self, param, grad, momentum_buf, param2, momentum, lr, weight_decay,
                       dampening, nesterov):
        self.calls += 1
        d = grad.double() + weight_decay * param.double()
        if momentum:
            if momentum_buf is None:
                momentum_buf, buf = torch.empty_like(param), d
            else:
                buf = momentum * momentum_buf.double() + (1 - dampening) * d
            momentum_buf.copy_(buf)
            d = d + momentum * buf if nesterov else buf
        param.copy_(param.double() - lr * d)
        return momentum_buf if momentum else None


@pytest.fixture
def fake_ops(monkeypatch):
    """Install a stand-in as IPEX's ops (fresh verdicts before and after)."""
    def install(bug=None):
        ops = FakeIpexOps(bug)
        monkeypatch.setattr(optim_ipex, "_OPS", ops)
        monkeypatch.setattr(optim_ipex, "load_ops", lambda: ops)
        return ops
    optim_ipex.forget()
    yield install
    optim_ipex.forget()


def _rand(gen, n, scale=1.0, positive=False):
    x = torch.rand(n, generator=gen) if positive else torch.randn(n, generator=gen)
    return x * scale


def _check_adam(gen, n, *, adamw, bias_correction, lowp_dtype, steps=3):
    p, m, v = _rand(gen, n), _rand(gen, n, 0.1), _rand(gen, n, 0.01, positive=True)
    lowp = None if lowp_dtype is None else torch.empty(n, dtype=lowp_dtype)
    for step in range(1, steps + 1):
        g = _rand(gen, n)
        g_before = g.clone()
        hp = dict(ADAM, adamw=adamw, bias_correction=bias_correction, step=step)
        want = adam64(p, g, m, v, **hp)
        optim_ipex.adam_step(p, g, m, v, param_lowp=lowp, **hp)
        assert torch.equal(g, g_before), "the gradient must only be read"
        for got, ref in zip((p, m, v), want):
            torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-6)
        if lowp is not None:
            assert torch.equal(lowp, p.to(lowp_dtype))  # nearest even, as Tensor.to


def _check_sgd(gen, n, *, momentum, nesterov, dampening):
    p = _rand(gen, n)
    buf = torch.full((n,), float("nan")) if momentum else None  # the first step must overwrite it
    ref_buf = None
    hp = dict(lr=0.05, momentum=momentum, dampening=dampening, weight_decay=0.01,
              nesterov=nesterov)
    for step in range(3):
        g = _rand(gen, n)
        want, ref_buf = sgd64(p, g, ref_buf, first_step=step == 0, **hp)
        optim_ipex.sgd_step(p, g, buf, first_step=step == 0, **hp)
        torch.testing.assert_close(p.double(), want, rtol=2e-5, atol=2e-6)
        if momentum:
            torch.testing.assert_close(buf.double(), ref_buf, rtol=2e-5, atol=2e-6)


ADAM_CASES = [(adamw, bc, dt) for adamw in (False, True) for bc in (True, False)
              for dt in (None, torch.bfloat16, torch.float16)]
SGD_CASES = [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 0.0), (0.9, False, 0.3)]


# ---------------------------------------------------------------- optim_ipex on the stand-in
@pytest.mark.parametrize("adamw,bias_correction,lowp_dtype", ADAM_CASES)
def test_adam_through_the_op_matches_float64(fake_ops, adamw, bias_correction, lowp_dtype):
    ops = fake_ops()
    gen = torch.Generator().manual_seed(zlib.crc32(f"{adamw}{bias_correction}{lowp_dtype}".encode()))
    _check_adam(gen, 1031, adamw=adamw, bias_correction=bias_correction, lowp_dtype=lowp_dtype)
    kind = ("adamw" if adamw else "adam") + ("" if lowp_dtype is None else
                                              "+" + str(lowp_dtype).replace("torch.", ""))
    assert optim_ipex.status() == {kind: "IPEX fused op (self-check passed)"}
    assert ops.calls == 3 + 3  # the self-check's three steps, then ours


@pytest.mark.parametrize("momentum,nesterov,dampening", SGD_CASES)
def test_sgd_through_the_op_matches_float64(fake_ops, momentum, nesterov, dampening):
    ops = fake_ops()
    gen = torch.Generator().manual_seed(zlib.crc32(f"sgd{momentum}{nesterov}{dampening}".encode()))
    _check_sgd(gen, 517, momentum=momentum, nesterov=nesterov, dampening=dampening)
    # a damped first step runs optim_cpu (the op would damp it); every other step the op
    assert ops.calls == 3 + (2 if dampening and momentum else 3)


def test_found_inf_skips_everything_and_zero_steps(fake_ops):
    fake_ops()
    gen = torch.Generator().manual_seed(11)
    n = 300
    p, g, m, v = _rand(gen, n), _rand(gen, n), _rand(gen, n), _rand(gen, n, positive=True)
    lowp = torch.zeros(n, dtype=torch.bfloat16)
    before = [t.clone() for t in (p, m, v, lowp)]
    hp = dict(ADAM, adamw=True, step=4, param_lowp=lowp)
    optim_ipex.adam_step(p, g, m, v, found_inf=torch.tensor(1.0), **hp)
    assert all(torch.equal(a, b) for a, b in zip((p, m, v, lowp), before))
    buf = _rand(gen, n)
    optim_ipex.sgd_step(p, g, buf, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0,
                        nesterov=False, first_step=False, found_inf=torch.tensor(1.0))
    assert torch.equal(p, before[0])
    optim_ipex.adam_step(p, g, m, v, found_inf=torch.tensor(0.0), **hp)
    want = adam64(*before[:1], g, *before[1:3], bias_correction=True,
                  **{k: v_ for k, v_ in hp.items() if k != "param_lowp"})
    torch.testing.assert_close(p.double(), want[0], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("bug,needle", [("no_bias_correction", "differs from optim_reference"),
                                        ("writes_grad", "wrote into the gradient"),
                                        ("raises", "RuntimeError: adam_fused_step")])
def test_a_wrong_op_fails_the_self_check_and_optim_cpu_runs(fake_ops, bug, needle):
    fake_ops(bug)
    info = {}
    optim_ipex.report_into(info)
    gen = torch.Generator().manual_seed(zlib.crc32(bug.encode()))
    with pytest.warns(RuntimeWarning, match="failed the self-check"):
        _check_adam(gen, 700, adamw=False, bias_correction=True, lowp_dtype=None)
    path = optim_ipex.status()["adam"]
    assert path.startswith("optim_cpu (") and needle in path
    assert info["path adam"] == path           # the kernel set's info says it too
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the verdict is kept: no second warning
        _check_adam(gen, 70, adamw=False, bias_correction=True, lowp_dtype=None, steps=1)


def test_without_a_loadable_ipex_every_kind_runs_optim_cpu(monkeypatch):
    optim_ipex.forget()
    monkeypatch.setattr(optim_ipex.metadata, "version", lambda name: "2.1.0")  # another torch's
    try:
        gen = torch.Generator().manual_seed(5)
        with pytest.warns(RuntimeWarning, match="not built for torch"):
            _check_adam(gen, 64, adamw=True, bias_correction=True, lowp_dtype=None, steps=1)
        assert "not imported" in optim_ipex.status()["adamw"]
    finally:
        optim_ipex.forget()


def test_optim_ipex_refuses_device_tensors_and_bad_arguments():
    meta = torch.zeros(4, device="meta")
    with pytest.raises(ValueError, match="CPU tensors"):
        optim_ipex.adam_step(meta, meta, meta, meta, step=1, adamw=False, **ADAM)
    z = torch.zeros(4)
    with pytest.raises(ValueError, match="step must be"):
        optim_ipex.adam_step(z, z, z, z, step=0, adamw=False, **ADAM)


# ---------------------------------------------------------------- the registry
def _sets(monkeypatch, state, env=None):
    monkeypatch.setattr(kernel_sets.ipex, "state", lambda *a: state)
    if env is None:
        monkeypatch.delenv(kernel_sets.CPU_KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(kernel_sets.CPU_KERNELS_ENV, env)
    return {ks.name: ks for ks in kernel_sets.builtin_kernel_sets()}


@pytest.mark.parametrize("state", [("absent", "intel-extension-for-pytorch is not installed"),
                                   ("mismatch", "intel-extension-for-pytorch 2.8.0 is built for "
                                                "torch 2.8.* but torch 2.13.0 is installed")])
def test_without_a_matching_ipex_there_is_no_ipex_set_and_cpu_is_unchanged(monkeypatch, state):
    sets = _sets(monkeypatch, state)
    assert "ipex" not in sets
    assert sets["cpu"].adam_step is optim_cpu.adam_step and sets["cpu"].sgd_step is optim_cpu.sgd_step
    assert sets["cpu"].info.get("ipex") == (None if state[0] == "absent" else state[1])
    with pytest.warns(RuntimeWarning, match=f"ZERO_CORE_CPU_KERNELS=ipex, but {state[1]}"):
        asked = _sets(monkeypatch, state, env="ipex")
    assert asked["cpu"].adam_step is optim_cpu.adam_step and "ipex" not in asked


OK_STATE = ("ok", "intel-extension-for-pytorch 2.8.0 matches torch 2.8.0")


def test_a_matching_ipex_adds_the_set_and_the_variable_selects_it(monkeypatch, fake_ops):
    ok = OK_STATE
    loads = []
    monkeypatch.setattr(optim_ipex, "load_ops", lambda: loads.append(1) or FakeIpexOps())
    sets = _sets(monkeypatch, ok)
    ks = sets["ipex"]
    assert (ks.adam_step, ks.sgd_step) == (optim_ipex.adam_step, optim_ipex.sgd_step)
    assert ks.skips_on_device and ks.info["ipex"] == ok[1] and "quantize" in ks.extra
    assert ks.info["adam_step"] == f"{kernel_sets.IPEX}.adam_step"
    assert sets["cpu"].adam_step is optim_cpu.adam_step     # the default stays (measured)
    assert loads == []                                      # listing the set imports nothing
    chosen = _sets(monkeypatch, ok, env="IPEX")["cpu"]
    assert loads == [1]       # selected: IPEX is loaded now, before any model runs
    assert chosen.adam_step is optim_ipex.adam_step and chosen.skips_on_device
    assert chosen.info["selected_by"] == "ZERO_CORE_CPU_KERNELS=ipex"
    assert _sets(monkeypatch, ok, env="cpu")["cpu"].adam_step is optim_cpu.adam_step


def test_a_selected_ipex_that_fails_to_load_leaves_the_cpu_kernels(monkeypatch):
    optim_ipex.forget()
    monkeypatch.setattr(optim_ipex.metadata, "version", lambda name: "2.8.0")
    monkeypatch.setattr(optim_ipex.torch, "__version__", "2.8.0")
    monkeypatch.setattr(optim_ipex, "MODULE", "zero_core_no_such_ipex_module")
    try:
        with pytest.warns(RuntimeWarning, match="ZERO_CORE_CPU_KERNELS=ipex, but "
                                                "zero_core_no_such_ipex_module could not be loaded"):
            sets = _sets(monkeypatch, OK_STATE, env="ipex")
        assert sets["cpu"].adam_step is optim_cpu.adam_step and "selected_by" not in sets["cpu"].info
        assert "zero_core_no_such_ipex_module could not be loaded" in sets["cpu"].info["ipex"]
        assert sets["ipex"].adam_step is optim_ipex.adam_step   # still listed, as installed
    finally:
        optim_ipex.forget()


def test_an_unknown_choice_is_a_config_error_naming_the_variable(monkeypatch):
    with pytest.raises(ConfigError, match=r"ZERO_CORE_CPU_KERNELS='ipx' is not a CPU kernel "
                                          r"choice; use one of cpu, ipex"):
        _sets(monkeypatch, ("absent", "x"), env="ipx")


# ---------------------------------------------------------------- the real IPEX (ipex leg)
@needs_ipex
def test_real_ipex_ops_pass_the_self_check_and_match_float64():
    optim_ipex.forget()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn
            for adamw, bc, dt in ADAM_CASES:
                gen = torch.Generator().manual_seed(zlib.crc32(f"real{adamw}{bc}{dt}".encode()))
                _check_adam(gen, 4099, adamw=adamw, bias_correction=bc, lowp_dtype=dt)
            for momentum, nesterov, dampening in SGD_CASES:
                gen = torch.Generator().manual_seed(zlib.crc32(f"rs{momentum}{nesterov}".encode()))
                _check_sgd(gen, 2053, momentum=momentum, nesterov=nesterov, dampening=dampening)
        assert set(optim_ipex.status().values()) == {"IPEX fused op (self-check passed)"}
    finally:
        optim_ipex.forget()


@needs_ipex
def test_real_ipex_writes_its_bf16_copy_only_for_a_bf16_gradient():
    """The fact behind optim_ipex's rounding copy: with an fp32 gradient the op ignores
    param2; with a bf16 one it writes the nearest-even bf16 of the new fp32 parameter."""
    ops = optim_ipex.load_ops()
    gen = torch.Generator().manual_seed(3)
    n = 1027
    for grad_dtype in (torch.float32, torch.bfloat16):
        p, m, v = _rand(gen, n), torch.zeros(n), torch.zeros(n)
        g = _rand(gen, n).to(grad_dtype)
        copy = torch.zeros(n, dtype=torch.bfloat16)
        ops.adam_fused_step(p, m, v, torch.empty(0), g, copy, False, 1.0, 0.9, 0.999, 1e-2,
                            0.0, 1e-8)
        if grad_dtype == torch.float32:
            assert not copy.any()
        else:
            assert torch.equal(copy, p.bfloat16())


@needs_ipex
def test_real_registry_lists_ipex_and_the_variable_selects_it(monkeypatch):
    monkeypatch.delenv(kernel_sets.CPU_KERNELS_ENV, raising=False)
    sets = {ks.name: ks for ks in kernel_sets.builtin_kernel_sets()}
    assert sets["ipex"].adam_step is optim_ipex.adam_step
    assert sets["cpu"].adam_step is optim_cpu.adam_step
    monkeypatch.setenv(kernel_sets.CPU_KERNELS_ENV, "ipex")
    sets = {ks.name: ks for ks in kernel_sets.builtin_kernel_sets()}
    assert sets["cpu"].adam_step is optim_ipex.adam_step
