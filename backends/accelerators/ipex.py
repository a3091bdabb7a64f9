"""Whether Intel Extension for PyTorch (IPEX) may be imported beside this torch.

Each IPEX release is built for one torch minor release (IPEX 2.8, its last, for torch 2.8.*),
but its wheel declares no torch requirement, so pip puts it beside any torch. Imported beside
another torch it prints an error and then fails with ``AttributeError: module 'os' has no
attribute 'exit'`` (IPEX 2.8.0 beside torch 2.13.0, measured), after having registered some
of its kernels. So the installed version is read from the package metadata first and IPEX is
imported only when its major.minor equals torch's; otherwise it is refused with the reason
(``zero-core report`` shows it: xpu's availability and the cpu kernel set's ``ipex`` line)
and never imported. :func:`state` is also what decides whether the ``ipex`` kernel set
(``backends/kernel_sets.py``) exists.
"""
from __future__ import annotations

import re
from importlib import metadata

import torch

from zero_core.interfaces.accelerator import module_present

MODULE = "intel_extension_for_pytorch"
DISTRIBUTION = "intel-extension-for-pytorch"
#: the torch that the last IPEX release (2.8.0) is built for, as the ipex extra pins it
FIX = "pip install 'torch==2.8.*' 'intel-extension-for-pytorch==2.8.0'"


def _minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def installed_version() -> str | None:
    """IPEX's version from its package metadata; None when it has none (or is absent)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def state(torch_version: str | None = None) -> tuple[str, str]:
    """('absent' | 'mismatch' | 'ok', a sentence) without importing IPEX."""
    torch_version = str(torch.__version__ if torch_version is None else torch_version)
    if not module_present(MODULE):
        return "absent", f"{DISTRIBUTION} is not installed"
    version = installed_version()
    if version is None:
        return "ok", f"{MODULE} is installed without package metadata (version unknown)"
    if _minor(version) != _minor(torch_version):
        have = _minor(version)
        built_for = f"{have[0]}.{have[1]}.*" if have else "another torch"
        return "mismatch", (
            f"{DISTRIBUTION} {version} is built for torch {built_for} but torch "
            f"{torch_version} is installed; importing it would fail, so zero-core does not "
            f"import it. Install the matching pair ({FIX}) or uninstall it "
            f"(pip uninstall {DISTRIBUTION})")
    return "ok", f"{DISTRIBUTION} {version} matches torch {torch_version}"


def xpu_build() -> bool:
    """Whether the installed IPEX is an XPU build: Intel's XPU wheel index versions them
    '+xpu' (2.8.10+xpu); PyPI's wheel (metadata '2.8.0') is the CPU build, with no XPU."""
    return "+xpu" in (installed_version() or "")


def load(for_xpu: bool = False) -> str | None:
    """Import IPEX when it is installed and matches this torch: None when imported or
    absent, else why it was not (a mismatch is never imported). *for_xpu*: skip the
    import (seconds, in every rank) unless it is an XPU build (only those add an XPU)."""
    kind, why = state()
    if kind == "absent" or (for_xpu and kind == "ok" and not xpu_build()):
        return None
    if kind == "mismatch":
        return why
    try:
        __import__(MODULE)
    except (Exception, SystemExit) as exc:  # IPEX's own version check exits
        return f"{MODULE} is installed but failed to import ({type(exc).__name__}: {exc})"
    return None
