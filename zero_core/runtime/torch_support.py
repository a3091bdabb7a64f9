"""Which torch releases zero-core runs on, and the few code paths that depend on the release.

The supported range is ``SUPPORTED`` (the same as ``pyproject.toml``'s torch requirement;
``tests/test_torch_support.py`` holds the two together). ``check_torch()`` runs first thing
in ``import zero_core`` and raises :class:`UnsupportedTorchError` naming the installed
torch, the range and the pip command that fixes it, so that an old torch fails at import
instead of with an AttributeError in the middle of a step. ``ZERO_CORE_UNTESTED_TORCH=1``
lets a torch newer than the range import (for trying a new release; ``zero-core report``
still calls it untested); a torch older than the range is always refused, because the
engine calls APIs it does not have.

Why the lower bound is 2.4: it is the oldest release the engine-critical suite passes on
(ci/torch_range.sh), and older ones lack what the engine calls. Present in 2.4.1 and used
throughout: ``Tensor.register_post_accumulate_grad_hook`` (since 2.1; every stage's gradient
reduction), ``torch.utils.swap_tensors`` and ``torch.get_device_module`` (since 2.3), the
generic ``torch.Event`` (asynchronous checkpoint saves), ``_foreach_norm(..., dtype=)``,
torch's fused Adam/AdamW/SGD on CPU tensors (since 2.4; the cpu kernel set),
``torch.serialization.add_safe_globals`` (since 2.4). Missing in 2.4 and shimmed here:
``torch.serialization.safe_globals`` (2.5; DeepSpeed checkpoint loading). Missing in 2.4 and
needed only by the example device examples/vdev: ``torch.accelerator`` (2.6) and
device-aware ``Tensor.pin_memory()`` (2.4's means CUDA): vdev compiles on 2.4 (one guard in
its csrc/vdev.cpp) but runs on 2.8 and newer.
"""
from __future__ import annotations

import re
from contextlib import contextmanager

import torch

from zero_core.errors import ZeroCoreError
from zero_core.runtime.launch import env_flag

#: (oldest, newest) minor releases zero-core is tested on; pyproject says ">=2.4,<2.14"
SUPPORTED = ((2, 4), (2, 13))
#: the environment variable that lets a torch newer than SUPPORTED import
UNTESTED_ENV = "ZERO_CORE_UNTESTED_TORCH"


class UnsupportedTorchError(ZeroCoreError, ImportError):
    """The installed torch is outside the range zero-core supports."""


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.4.1+cu121' -> (2, 4), '2.14.0a0+git' -> (2, 14)."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if match is None:
        raise UnsupportedTorchError(f"cannot read torch's version {version!r}; zero-core needs "
                                    f"torch {range_text()} ({pip_command()})")
    return int(match.group(1)), int(match.group(2))


def range_text() -> str:
    """The supported range as people write it: '2.4 to 2.13'."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def requirement() -> str:
    """The range as a pip requirement: 'torch>=2.4,<2.14'."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    return f"torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"


def pip_command() -> str:
    return f"pip install '{requirement()}'"


def status(version: str | None = None) -> tuple[str, str]:
    """('supported' | 'too old' | 'untested', a sentence) for *version* (default: this torch)."""
    version = str(torch.__version__ if version is None else version)
    have = parse(version)
    lo, hi = SUPPORTED
    if have < lo:
        return "too old", (f"torch {version} is older than the oldest release zero-core supports "
                           f"(tested range {range_text()}): the engine calls APIs it lacks. "
                           f"Install a supported torch: {pip_command()}")
    if have > hi:
        return "untested", (f"torch {version} is newer than zero-core's tested range "
                            f"({range_text()}). Install a tested torch ({pip_command()}), or set "
                            f"{UNTESTED_ENV}=1 to try this release anyway")
    return "supported", f"torch {version} is in zero-core's tested range ({range_text()})"


def check_torch(version: str | None = None) -> None:
    """Raise UnsupportedTorchError unless *version* (default: this torch) may run zero-core."""
    state, why = status(version)
    if state == "too old" or (state == "untested" and not env_flag(UNTESTED_ENV)):
        raise UnsupportedTorchError(why)


# ---- shims: the code paths that differ between supported releases -------------------------
@contextmanager
def safe_globals(pairs):
    """``torch.serialization.safe_globals(pairs)`` (torch >= 2.5), scoped to the ``with``.

    torch 2.4 has only the process-wide ``add_safe_globals``, without the (object, name)
    form: there the pairs are entered into its allow-list by name for the duration of the
    ``with`` and taken out afterwards.
    """
    serialization = torch.serialization
    if hasattr(serialization, "safe_globals"):
        with serialization.safe_globals(pairs):
            yield
        return
    # torch 2.4: the allow-list (public get/add/clear_safe_globals) holds objects only and
    # knows them by module and name; a stand-in takes the name it stands in for while it is
    # allowed, and the list is put back as it was afterwards
    saved = serialization.get_safe_globals()
    renamed = []
    try:
        objs = []
        for entry in pairs:
            obj, name = entry if isinstance(entry, tuple) else (entry, None)
            if name is not None:
                module, _, qualname = name.rpartition(".")
                renamed.append((obj, obj.__module__, obj.__qualname__, obj.__name__))
                obj.__module__, obj.__qualname__, obj.__name__ = module, qualname, qualname
            objs.append(obj)
        serialization.add_safe_globals(objs)
        yield
    finally:
        serialization.clear_safe_globals()
        serialization.add_safe_globals(saved)
        for obj, module, qualname, simple in renamed:
            obj.__module__, obj.__qualname__, obj.__name__ = module, qualname, simple
