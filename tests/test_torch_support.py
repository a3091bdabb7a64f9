"""The supported torch range (zero_core/runtime/torch_support.py): pyproject says the same
range, an unsupported torch is refused by name at ``import zero_core``, and the shims of the
release-dependent code paths give what the newer torch gives.

The refusal is tested by changing ``torch.__version__`` before ``import zero_core`` in a fresh
interpreter, not by installing an old torch (ci/torch_range.sh runs the suite on real old
releases)."""
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from zero_core.runtime import torch_support
from zero_core.runtime.torch_support import UnsupportedTorchError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject_torch_requirement() -> str:
    with open(os.path.join(REPO, "pyproject.toml")) as fh:
        text = fh.read()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    found = re.findall(r'"(torch[^"]*)"', deps)
    assert len(found) == 1, found
    return found[0]


def test_pyproject_states_exactly_the_supported_range():
    assert _pyproject_torch_requirement() == torch_support.requirement()
    lo, hi = torch_support.SUPPORTED
    assert torch_support.requirement() == f"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"


def test_the_ipex_extra_pins_the_torch_ipex_is_built_for():
    with open(os.path.join(REPO, "pyproject.toml")) as fh:
        line = next(ln for ln in fh if ln.startswith("ipex ="))
    pins = dict(re.findall(r'"([a-z-]+)==([0-9.*]+)"', line))
    ipex, pinned_torch = pins["intel-extension-for-pytorch"], pins["torch"]
    assert pinned_torch == ".".join(ipex.split(".")[:2]) + ".*"
    assert torch_support.status(pinned_torch.replace("*", "0"))[0] == "supported"


def test_this_torch_is_supported():
    state, why = torch_support.status()
    assert state == "supported", why
    torch_support.check_torch()


@pytest.mark.parametrize("version, state", [
    ("2.3.1+cu121", "too old"), ("1.13.1", "too old"), ("2.4.0", "supported"),
    ("2.4.1+cu121", "supported"), ("2.8.0+cpu", "supported"), ("2.13.0", "supported"),
    ("2.14.0a0+git1234", "untested"), ("3.0.0", "untested")])
def test_versions_are_classified_by_minor_release(version, state):
    assert torch_support.status(version)[0] == state


def test_a_newer_torch_needs_the_explicit_opt_in(monkeypatch):
    monkeypatch.delenv(torch_support.UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedTorchError, match="ZERO_CORE_UNTESTED_TORCH=1"):
        torch_support.check_torch("2.14.0")
    monkeypatch.setenv(torch_support.UNTESTED_ENV, "1")
    torch_support.check_torch("2.14.0")
    with pytest.raises(UnsupportedTorchError, match="older than the oldest"):
        torch_support.check_torch("2.3.0")  # the opt-in never lets an old torch through


def test_import_zero_core_refuses_an_old_torch_by_name():
    code = ("import torch; torch.__version__ = '2.3.1+cu121'\n"
            "try:\n    import zero_core\n"
            "except ImportError as exc:\n    print(type(exc).__name__); print(exc)\n"
            "else:\n    print('imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    name, message = out.stdout.split("\n", 1)
    assert name == "UnsupportedTorchError"
    assert "torch 2.3.1+cu121" in message and "2.4 to 2.13" in message
    assert "pip install 'torch>=2.4,<2.14'" in message


def test_the_report_names_the_torch_support():
    from zero_core.cli import versions
    assert versions()["torch support"].startswith(f"torch {torch.__version__} is in")


# ---- shims ---------------------------------------------------------------------------------
class _StandIn:
    """What a file's foreign class is read back as."""


def _saved_under_foreign_name(path, value, monkeypatch):
    """torch.save a {"obj": vendor.Thing with .value, "t": tensor} (vendor: a module made here)."""
    vendor = types.ModuleType("zc_test_vendor")
    vendor.Thing = type("Thing", (), {"__module__": "zc_test_vendor"})
    monkeypatch.setitem(sys.modules, "zc_test_vendor", vendor)
    obj = vendor.Thing()
    obj.value = value
    torch.save({"obj": obj, "t": torch.arange(3)}, path)


@pytest.mark.parametrize("old_torch", [False, True], ids=["this-torch", "torch-2.4-path"])
def test_safe_globals_maps_a_foreign_name_to_a_stand_in(tmp_path, monkeypatch, old_torch):
    path = str(tmp_path / "f.pt")
    value = float(torch.rand(()))
    _saved_under_foreign_name(path, value, monkeypatch)
    if old_torch:  # the torch-2.4 path: no scoped safe_globals, only the allow-list
        monkeypatch.delattr(torch.serialization, "safe_globals", raising=False)
    with pytest.raises(Exception, match="zc_test_vendor.Thing"):
        torch.load(path, weights_only=True)
    with torch_support.safe_globals([(_StandIn, "zc_test_vendor.Thing")]):
        got = torch.load(path, weights_only=True)
    assert type(got["obj"]) is _StandIn and got["obj"].value == value
    assert torch.equal(got["t"], torch.arange(3))
    # scoped: afterwards the name is refused again and the stand-in has its own name back
    with pytest.raises(Exception, match="zc_test_vendor.Thing"):
        torch.load(path, weights_only=True)
    assert (_StandIn.__module__, _StandIn.__name__) == (__name__, "_StandIn")


# ---- IPEX: refused unimported when it is built for another torch ----------------------------
def _fake_ipex(monkeypatch, version):
    """IPEX *version* 'installed' (metadata and module), with any import of it recorded."""
    from zero_core.backends.accelerators import ipex
    monkeypatch.setattr(ipex, "module_present", lambda name: name == ipex.MODULE)
    monkeypatch.setattr(ipex, "installed_version", lambda: version)
    imported = []
    real_import = __import__

    def spy(name, *args, **kwargs):
        if name.startswith(ipex.MODULE):
            imported.append(name)
            raise AttributeError("module 'os' has no attribute 'exit'")  # what IPEX does
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr("builtins.__import__", spy)
    return ipex, imported


def test_an_ipex_for_another_torch_is_refused_unimported_and_reported(monkeypatch):
    ipex, imported = _fake_ipex(monkeypatch, "2.8.0+cpu")
    kind, why = ipex.state("2.13.0+cpu")
    assert kind == "mismatch"
    assert "intel-extension-for-pytorch 2.8.0+cpu is built for torch 2.8.*" in why
    assert "torch 2.13.0+cpu is installed" in why and ipex.FIX in why
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert ipex.load() == why and imported == []
    # zero-core report shows it: the cpu kernel set's info and xpu's availability
    from zero_core.backends.accelerators.xpu import XpuAccelerator
    from zero_core.backends.kernel_sets import builtin_kernel_sets
    cpu = next(k for k in builtin_kernel_sets() if k.name == "cpu")
    assert cpu.info["ipex"] == why
    assert XpuAccelerator.describe(XpuAccelerator())["ipex"] == why
    assert imported == []


def test_a_matching_ipex_is_imported_and_its_failure_named(monkeypatch):
    ipex, imported = _fake_ipex(monkeypatch, "2.8.0+cpu")
    assert ipex.state("2.8.0+cu128")[0] == "ok"
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu128")
    why = ipex.load()
    assert imported == [ipex.MODULE]
    assert "failed to import (AttributeError: module 'os' has no attribute 'exit')" in why


def test_without_ipex_nothing_is_said():
    from zero_core.backends.accelerators import ipex
    from zero_core.backends.kernel_sets import builtin_kernel_sets
    if ipex.module_present(ipex.MODULE):
        pytest.skip("IPEX is installed here (the test above covers that case)")
    assert ipex.state()[0] == "absent" and ipex.load() is None
    assert "ipex" not in next(k for k in builtin_kernel_sets() if k.name == "cpu").info


def test_the_xpu_probe_does_not_import_ipex_cpu_build(monkeypatch):
    ipex, imported = _fake_ipex(monkeypatch, "2.8.0")  # PyPI's wheel: the CPU build
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu128")
    assert ipex.load(for_xpu=True) is None and imported == []  # no XPU in IPEX's CPU build
    monkeypatch.setattr(ipex, "installed_version", lambda: "2.8.10+xpu")
    assert "failed to import" in ipex.load(for_xpu=True) and imported == [ipex.MODULE]
