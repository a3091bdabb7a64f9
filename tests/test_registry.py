"""The plugin registry: selection order, error messages, and what loading costs.

Selection order (ARCHITECTURE §2): explicit argument / config, then ZERO_CORE_ACCELERATOR /
ZERO_CORE_COMM, then auto-detection by priority among the available accelerators.
Stand-in backends are registered in-process (``registry.load(extra_modules=...)``) next
to the real entry points; the module-level cache is restored after each test.
"""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

from zero_core.runtime import registry
from zero_core.interfaces.accelerator import Accelerator
from zero_core.backends.accelerators.cpu import CpuAccelerator
from zero_core.interfaces.communicator import Communicator
from zero_core.errors import BackendUnavailable, PluginError
from zero_core.interfaces.hookspecs import hookimpl


def _accelerator(name, priority, available=True, why=""):
    """A stand-in accelerator class that is only selected, never used for work."""
    def availability(cls):
        return available, why
    return type(f"Fake_{name}", (CpuAccelerator,), {
        "name": name, "priority": priority, "availability": classmethod(availability)})


def _communicator(name, available=True, why=""):
    def availability(cls):
        return available, why
    return type(f"Fake_{name}", (Communicator,), {
        "name": name, "availability": classmethod(availability)})


FAKE_ACCELERATORS = [
    _accelerator("fake-top", 200, available=False, why="fake-top needs a fake card: plug it in"),
    _accelerator("fake-high", 100),
    _accelerator("fake-low", -5),
]
FAKE_COMMS = [_communicator("fake-comm-a"), _communicator("fake-comm-b"),
              _communicator("fake-comm-off", available=False, why="fake-comm-off needs a fake network")]


def _plugin_module():
    mod = types.ModuleType("fake_zero_core_plugin")
    mod.zero_core_accelerators = hookimpl(lambda: list(FAKE_ACCELERATORS))
    mod.zero_core_communicators = hookimpl(lambda: list(FAKE_COMMS))
    return mod


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("ZERO_CORE_ACCELERATOR", "ZERO_CORE_COMM"):
        monkeypatch.delenv(key, raising=False)
    # load(extra_modules=...) replaces the process-wide cache: give it back afterwards
    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY)
    return monkeypatch


@pytest.fixture
def reg(clean_env):
    return registry.load(extra_modules=[_plugin_module()])


# ---- accelerators ------------------------------------------------------------------------
def test_auto_detection_takes_the_available_accelerator_of_highest_priority(reg):
    # fake-top ranks higher but is unavailable; fake-high beats cpu (0) and fake-low (-5)
    assert reg.accelerator_class() is FAKE_ACCELERATORS[1]


def test_environment_variable_beats_auto_detection(reg, clean_env):
    clean_env.setenv("ZERO_CORE_ACCELERATOR", "fake-low")
    assert reg.accelerator_class() is FAKE_ACCELERATORS[2]


def test_explicit_name_beats_environment_variable(reg, clean_env):
    clean_env.setenv("ZERO_CORE_ACCELERATOR", "fake-low")
    assert reg.accelerator_class("cpu") is CpuAccelerator
    assert reg.accelerator_class("fake-high") is FAKE_ACCELERATORS[1]


def test_unknown_accelerator_lists_every_registered_one_and_why(reg, clean_env):
    clean_env.setenv("ZERO_CORE_ACCELERATOR", "tpu")
    with pytest.raises(PluginError) as info:
        reg.accelerator_class()
    msg = str(info.value)
    assert "unknown accelerator 'tpu' (from ZERO_CORE_ACCELERATOR)" in msg
    assert "cpu [zero-core]: available" in msg
    assert "fake-high [(registered in-process)]: available" in msg
    assert "fake-top [(registered in-process)]: unavailable: fake-top needs a fake card" in msg
    cuda_ok, cuda_why = reg.accelerators["cuda"].obj.availability()
    assert (f"cuda [zero-core]: unavailable: {cuda_why}" in msg) != cuda_ok


def test_asking_for_an_unavailable_accelerator_says_why_and_where_it_came_from(reg):
    with pytest.raises(BackendUnavailable) as info:
        reg.accelerator_class("fake-top")
    msg = str(info.value)
    assert "accelerator 'fake-top'" in msg and "selected by argument" in msg
    assert "package '(registered in-process)'" in msg
    assert "is not available here: fake-top needs a fake card: plug it in" in msg
    assert "fake-high [(registered in-process)]: available" in msg   # the alternatives


def test_builtin_auto_detection_follows_cuda_hpu_xpu_cpu(clean_env):
    reg = registry.load(refresh=True)
    order = ["cuda", "hpu", "xpu", "cpu"]   # ARCHITECTURE §2
    expected = next(n for n in order if reg.accelerators[n].obj.availability()[0])
    assert reg.accelerator_class().name == expected
    if not torch.cuda.is_available():
        assert expected != "cuda"


# ---- communicators -----------------------------------------------------------------------
def test_communicator_explicit_then_environment_then_default(reg, clean_env):
    assert reg.communicator_class(None, default="fake-comm-a") is FAKE_COMMS[0]
    clean_env.setenv("ZERO_CORE_COMM", "fake-comm-b")
    assert reg.communicator_class(None, default="fake-comm-a") is FAKE_COMMS[1]
    assert reg.communicator_class("fake-comm-a", default="fake-comm-b") is FAKE_COMMS[0]


def test_unknown_or_unavailable_communicator_lists_the_others(reg, clean_env):
    with pytest.raises(PluginError) as info:
        reg.communicator_class("nccl2", default="fake-comm-a")
    msg = str(info.value)
    assert "unknown communicator 'nccl2' (from argument)" in msg
    assert "fake-comm-a [(registered in-process)]: available" in msg
    assert "fake-comm-off [(registered in-process)]: unavailable: fake-comm-off needs a fake network" in msg
    clean_env.setenv("ZERO_CORE_COMM", "fake-comm-off")
    with pytest.raises(BackendUnavailable, match="selected by ZERO_CORE_COMM.*needs a fake network"):
        reg.communicator_class(None, default="fake-comm-a")


def test_no_communicator_and_no_default_is_an_error(reg):
    with pytest.raises(BackendUnavailable, match="no communicator named"):
        reg.communicator_class(None, default=None)


# ---- kernel sets -------------------------------------------------------------------------
def test_every_builtin_accelerator_finds_its_kernel_set(clean_env):
    reg = registry.load(refresh=True)
    for name in ("cpu", "cuda", "hpu", "xpu"):
        cls = reg.accelerators[name].obj
        ks = reg.kernel_set(cls.kernel_set)
        assert ks.name == cls.kernel_set and reg.kernel_sets[ks.name].package == "zero-core"
    assert reg.kernel_set("reference").info["implementation"].startswith("reference")


def test_unknown_kernel_set_lists_the_registered_ones(clean_env):
    reg = registry.load(refresh=True)
    # the built-in sets, and whatever installed plugins add (examples/vdev adds 'vdev')
    with pytest.raises(PluginError, match=r"kernel set 'tpu' is not registered.*'cpu', 'cuda', 'hpu', 'reference'.*'xpu'"):
        reg.kernel_set("tpu")


# ---- cost of loading ---------------------------------------------------------------------
def test_loading_the_registry_imports_no_vendor_library_and_initializes_nothing():
    code = """
import json, sys
from zero_core.runtime import registry
reg = registry.load()
for cls in reg.accelerators.values():
    cls.obj.availability()
import torch.distributed as dist
vendor = ("habana_frameworks", "intel_extension_for_pytorch", "triton", "mpi4py.MPI")
print(json.dumps({"imported": sorted(m for m in sys.modules if m.split(".")[0] in vendor[:3]
                                      or m == "mpi4py.MPI"),
                  "cuda_initialized": __import__("torch").cuda.is_initialized(),
                  "dist_initialized": dist.is_initialized(),
                  "accelerators": sorted(reg.accelerators)}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"cpu", "cuda", "hpu", "xpu"} <= set(facts["accelerators"])
    # on this machine none of them is installed; where one is, availability() may load it,
    # but never MPI, and never a CUDA context or a process group
    from zero_core.interfaces.accelerator import module_present
    for lib in facts["imported"]:
        assert lib != "mpi4py.MPI" and module_present(lib.split(".")[0]), lib
    assert not facts["cuda_initialized"] and not facts["dist_initialized"]


def test_builtin_plugin_is_registered_through_the_entry_point(clean_env):
    reg = registry.load(refresh=True)
    builtin = [p for p in reg.plugins if p["package"] == "zero-core"]
    assert builtin == [{"name": "builtin", "package": "zero-core",
                        "module": "zero_core.backends.plugin"}]
    assert all(reg.accelerators[n].plugin == "builtin" for n in ("cpu", "cuda", "hpu", "xpu"))
