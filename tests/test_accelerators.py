"""The built-in accelerators and the kernel sets they use.

The CPU accelerator runs for real here. CUDA, HPU and XPU are not present on this
machine: their tests check the contract (names, priorities, defaults, no abstract
methods left) and that they report themselves unavailable with a reason a user can act
on. Their device code has NOT run on real hardware; the device contract test below runs
on every accelerator that is available, so it will exercise them where they are.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
import zlib

import pytest
import torch

from zero_core.interfaces.accelerator import Accelerator
from zero_core.backends import kernel_sets
from zero_core.backends.accelerators import cpu as cpu_mod
from zero_core.interfaces.accelerator import module_present
from zero_core.backends.accelerators import xpu as xpu_mod
from zero_core.backends.accelerators.cpu import CpuAccelerator
from zero_core.backends.accelerators.cuda import CudaAccelerator
from zero_core.backends.accelerators.hpu import HpuAccelerator
from zero_core.backends.accelerators.xpu import XpuAccelerator
from zero_core.errors import PluginError
from zero_core.runtime.launch import LaunchInfo
from float64_optim import adam64, sgd64  # the float64 reference (tests/float64_optim.py)

ALL = (CpuAccelerator, CudaAccelerator, HpuAccelerator, XpuAccelerator)
MiB = 1 << 20


# ---- CPU memory -------------------------------------------------------------------------
def test_cpu_memory_stats_follow_a_big_allocation_and_reset_works():
    acc = CpuAccelerator()
    size = 256 * MiB
    acc.reset_peak_memory_stats()
    before_now, before_peak = acc.memory_allocated(), acc.max_memory_allocated()
    block = torch.ones(size // 4, dtype=torch.float32)  # ones() touches every page
    grown_now, grown_peak = acc.memory_allocated(), acc.max_memory_allocated()
    assert grown_now - before_now > 0.9 * size
    assert grown_peak - before_peak > 0.9 * size
    del block
    after_now = acc.memory_allocated()
    assert grown_now - after_now > 0.9 * size          # the pages went back to the OS
    # ...but the peak remembers them (the kernel folds per-thread RSS counters into its
    # high-water mark lazily: allow a few pages of slack)
    assert acc.max_memory_allocated() > grown_peak - 4 * MiB
    acc.reset_peak_memory_stats()
    reset_peak = acc.max_memory_allocated()
    assert reset_peak < grown_peak - 0.9 * size
    assert reset_peak >= acc.memory_allocated() - 4 * MiB   # peak restarts from now
    assert acc.memory_stats()["peak_since"].startswith("last reset")


def test_cpu_memory_stats_agree_with_the_kernel_figures():
    acc = CpuAccelerator()
    with open("/proc/self/statm") as fh:
        statm_rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert abs(acc.memory_allocated() - statm_rss) < 8 * MiB
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert abs(acc.total_memory() - phys) <= 0.01 * phys
    assert acc.memory_stats()["total"] == acc.total_memory()


def test_cpu_peak_reset_falls_back_when_the_kernel_forbids_it(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_mod, "_CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    acc = CpuAccelerator()
    with pytest.warns(RuntimeWarning, match="cannot be reset"):
        acc.reset_peak_memory_stats()
    stats = acc.memory_stats()
    assert stats["peak_since"].startswith("process start") and "clear_refs" in stats["peak_since"]
    assert stats["peak"] >= stats["allocated"]


# ---- CPU defaults -----------------------------------------------------------------------
def _launch(launcher):
    return LaunchInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, launcher=launcher)


def test_cpu_default_comm_under_an_mpi_launcher_is_the_measured_choice(monkeypatch):
    acc = CpuAccelerator()
    for launcher in ("openmpi", "mpich", "pmix"):
        assert acc.default_comm_for(_launch(launcher)) == (
            cpu_mod.COMM_UNDER_MPI_LAUNCHER if module_present("mpi4py") else "gloo")
    for launcher in ("torchrun", "slurm", "single"):
        assert acc.default_comm_for(_launch(launcher)) == "gloo"
    monkeypatch.setattr(cpu_mod, "module_present", lambda name: name != "mpi4py")
    assert acc.default_comm_for(_launch("openmpi")) == "gloo"


def test_cpu_device_is_plain_cpu_for_every_rank():
    acc = CpuAccelerator()
    for local_rank in range(3):
        assert acc.device(local_rank) == torch.empty(1).device


# ---- contract of every built-in accelerator ---------------------------------------------
def test_builtin_accelerators_satisfy_the_contract():
    expected = {"cpu": (0, "cpu"), "cuda": (40, "cuda"), "hpu": (30, "hpu"), "xpu": (20, "xpu")}
    known_sets = {ks.name for ks in kernel_sets.builtin_kernel_sets()}
    for cls in ALL:
        assert issubclass(cls, Accelerator) and not inspect.isabstract(cls), cls
        assert (cls.priority, cls.kernel_set) == expected[cls.name]
        assert cls.kernel_set in known_sets
        ok, why = cls.availability()
        assert isinstance(ok, bool) and isinstance(why, str)
        assert ok or len(why) > 20, (cls.name, why)   # unavailable: a real sentence
        acc = cls()                                   # constructing touches no device
        assert acc.device_type() == cls.name
    assert CudaAccelerator.default_comm == "nccl"
    assert HpuAccelerator.default_comm == "hccl"
    assert CpuAccelerator.default_comm == "gloo"


def test_cuda_reports_why_it_is_unavailable():
    ok, why = CudaAccelerator.availability()
    assert ok == (torch.cuda.is_available() and torch.cuda.device_count() > 0)
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        assert "built without CUDA" in why and torch.__version__ in why and "install" in why
    elif not ok:
        assert "sees no GPU" in why


def test_hpu_reports_why_it_is_unavailable():
    ok, why = HpuAccelerator.availability()
    if not module_present("habana_frameworks"):
        assert not ok
        assert why.startswith("habana_frameworks is not installed: it comes with Intel Gaudi")


def test_xpu_reports_why_it_is_unavailable_and_picks_its_communicator(monkeypatch):
    ok, why = XpuAccelerator.availability()
    assert ok == (torch.xpu.is_available() and torch.xpu.device_count() > 0)
    if not torch.xpu._is_compiled() and not module_present("intel_extension_for_pytorch"):
        assert "built without XPU" in why and torch.__version__ in why
    monkeypatch.setattr(xpu_mod, "xccl_available", lambda: True)
    assert XpuAccelerator().default_comm_for(None) == "xccl"
    monkeypatch.setattr(xpu_mod, "xccl_available", lambda: False)
    assert XpuAccelerator().default_comm_for(None) == "ccl"


@pytest.fixture
def fake_habana(tmp_path, monkeypatch):
    """Install a stand-in habana_frameworks package: call with the sources of its
    ``torch/core.py`` and ``torch/hpu.py``. Removed from sys.modules afterwards."""
    def install(core_source: str, hpu_source: str):
        pkg = tmp_path / "habana_frameworks"
        (pkg / "torch").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "torch" / "__init__.py").write_text("")
        (pkg / "torch" / "core.py").write_text(core_source)
        (pkg / "torch" / "hpu.py").write_text(hpu_source)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
    yield install
    for name in [m for m in sys.modules if m.startswith("habana_frameworks")]:
        del sys.modules[name]


def test_hpu_availability_explains_a_bridge_that_fails_to_load(fake_habana):
    fake_habana('raise ImportError("libSynapse.so: not found")\n', "")
    ok, why = HpuAccelerator.availability()
    assert not ok and "bridge failed to load" in why and "libSynapse.so" in why


def test_hpu_availability_explains_a_machine_without_cards(fake_habana, monkeypatch):
    fake_habana("", "def is_available():\n    return False\n\n"
                    "def device_count():\n    return 0\n")
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "7")
    ok, why = HpuAccelerator.availability()
    assert not ok and "no Gaudi device is visible" in why and "HABANA_VISIBLE_MODULES='7'" in why


# ---- device contract on whatever is available --------------------------------------------
AVAILABLE = [cls for cls in ALL if cls.availability()[0]]


@pytest.mark.parametrize("cls", AVAILABLE, ids=[c.name for c in AVAILABLE])
def test_available_accelerator_runs_work_streams_and_memory(cls):
    acc = cls()
    acc.set_device(0)
    device = acc.device(0)
    assert device.type == acc.device_type()
    side = acc.new_stream()
    x = torch.randn(1 << 16, device=device, dtype=torch.float64)
    with acc.stream(side):
        y = x * 2
    event = acc.record_event()
    acc.wait_event(event)
    acc.synchronize()
    assert torch.equal(y.cpu(), x.cpu() * 2)
    acc.reset_peak_memory_stats()
    peak0 = acc.max_memory_allocated()
    big = torch.ones(64 * MiB // 4, device=device)
    assert acc.max_memory_allocated() - peak0 >= 0.9 * 64 * MiB
    del big
    host = torch.randn(1024)
    pinned = acc.pin_memory(host)
    assert torch.equal(pinned, host)
    assert acc.total_memory() > 0
    assert torch.float32 in acc.supported_dtypes()


# ---- kernel sets --------------------------------------------------------------------------
SETS = {ks.name: ks for ks in kernel_sets.builtin_kernel_sets()}


def test_builtin_kernel_sets_are_the_five_targets_and_say_what_backs_them():
    # plus "ipex" where an IPEX matching this torch is installed (tests/test_kernels_ipex.py)
    assert set(SETS) - {"ipex"} == {"reference", "cpu", "cuda", "xpu", "hpu"}
    for ks in SETS.values():
        assert ks.info["implementation"]
        for kernel in ("adam_step", "sgd_step"):
            fn = getattr(ks, kernel)
            module, _, name = ks.info[kernel].rpartition(".")
            if isinstance(fn, kernel_sets.LazyKernel):
                assert (fn.module, fn.function) == (module, name)
            else:
                assert getattr(importlib.import_module(module), name) is fn, (ks.name, kernel)
        if ks.info["adam_step"].startswith(kernel_sets.REFERENCE) and ks.name != "reference":
            assert ks.info["fallback_reason"]   # a fallback always says why


@pytest.mark.parametrize("name", sorted(SETS))
@pytest.mark.parametrize("adamw", [False, True])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_kernel_set_adam_matches_float64_formula(name, adamw, bias_correction):
    gen = torch.Generator().manual_seed(zlib.crc32(f"adam {name} {adamw} {bias_correction}".encode()))
    n = 4099
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, adamw=adamw,
              bias_correction=bias_correction)
    lowp = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        g = torch.randn(n, generator=gen)
        g_before = g.clone()
        want = adam64(p, g, m, v, step=step, **hp)
        SETS[name].adam_step(p, g, m, v, step=step, param_lowp=lowp, **hp)
        assert torch.equal(g, g_before), "the gradient must only be read"
        for got, ref in zip((p, m, v), want):
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(lowp, p.to(torch.bfloat16))


@pytest.mark.parametrize("name", sorted(SETS))
@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_kernel_set_sgd_matches_float64_formula(name, momentum, nesterov):
    gen = torch.Generator().manual_seed(zlib.crc32(f"sgd {name} {momentum} {nesterov}".encode()))
    n = 2053
    p = torch.randn(n, generator=gen)
    buf = torch.zeros(n) if momentum else None
    ref_buf = None
    hp = dict(lr=0.05, momentum=momentum, dampening=0.1 if not nesterov else 0.0,
              weight_decay=0.01, nesterov=nesterov)
    for step in range(3):
        g = torch.randn(n, generator=gen)
        want_p, ref_buf = sgd64(p, g, ref_buf, first_step=step == 0, **hp)
        SETS[name].sgd_step(p, g, buf, first_step=step == 0, **hp)
        torch.testing.assert_close(p.double(), want_p, rtol=1e-5, atol=1e-6)
        if momentum:
            torch.testing.assert_close(buf.double(), ref_buf, rtol=1e-5, atol=1e-6)


def test_lazy_kernel_imports_on_first_call_and_names_what_is_missing():
    missing = kernel_sets.LazyKernel("zero_core.accel_kernels.no_such_kernels", "adam_step")
    assert "no_such_kernels" in repr(missing)
    with pytest.raises(PluginError, match="no_such_kernels.adam_step could not be loaded"):
        missing(torch.zeros(1))
    present = kernel_sets.LazyKernel(kernel_sets.REFERENCE, "sgd_step")
    p = torch.ones(4)
    present(p, torch.ones(4), None, lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0,
            nesterov=False, first_step=True)
    assert torch.equal(p, torch.full((4,), 0.5))


def test_device_set_falls_back_to_reference_without_fused_ops(monkeypatch):
    monkeypatch.setattr(kernel_sets, "_torch_fused_available", lambda: False)
    ks = kernel_sets._device_set("cuda", importlib.import_module(kernel_sets.REFERENCE))
    assert ks.info["implementation"].startswith("reference")
    assert "no fused optimizer ops" in ks.info["fallback_reason"]


def test_cpu_set_falls_back_to_reference_when_its_module_is_missing(monkeypatch):
    real = kernel_sets.module_present
    monkeypatch.setattr(kernel_sets, "module_present",
                        lambda name: False if name == kernel_sets.CPU else real(name))
    sets = {ks.name: ks for ks in kernel_sets.builtin_kernel_sets()}
    assert sets["cpu"].adam_step is sets["reference"].adam_step
    assert "optim_cpu does not exist yet" in sets["cpu"].info["fallback_reason"]
