"""ctypes loader of the compiled CPU quantization library (quant_native.c).

The library ``_quant_native`` is built ahead of time when zero-core is installed (see
setup.py) and sits next to this file; nothing is compiled at run time. Loading it never
raises: :data:`LIB` is the loaded library or None, and :data:`REASON` then says why
(not built, stale, disabled, big-endian host, ...) and how to fix it. quant_cpu uses the
library when it is loaded and its pure-torch path otherwise.

Environment:

* ``ZERO_CORE_QUANT_NATIVE=0`` disables the library (quant_cpu runs its torch path).

The functions below take CPU tensors whose layout the caller (quant_cpu) has already
checked with :mod:`.quant_layout`; they work on block ranges so that quant_cpu's worker
threads can run chunks in parallel (ctypes releases the GIL during each call).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES

import torch

#: must equal ZC_ABI_VERSION in quant_native.c
ABI_VERSION = 1
LIB_NAME = "_quant_native"
SOURCE_NAME = "quant_native.c"
ENV_DISABLE = "ZERO_CORE_QUANT_NATIVE"

# dtype codes of quant_native.c
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_STATUS = {-1: "invalid arguments", -2: "out of memory for one block of scratch"}

_HERE = os.path.dirname(os.path.abspath(__file__))
_REBUILD = ("rebuild it with `pip install -e . --no-deps --no-build-isolation` (editable "
            "install) or reinstall zero-core; it needs a C compiler (gcc or clang)")

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    # name: (argument types, result type)
    "zc_abi_version": ([], _int),
    "zc_source_sha256": ([], ctypes.c_char_p),
    "zc_best_level": ([], _int),
    "zc_level_name": ([_int], ctypes.c_char_p),
    # each kernel takes the instruction-set level to run first
    "zc_quantize": ([_int, _ptr, _int, _i64, _int, _i64, _i64, _i64, _ptr, _ptr], _int),
    "zc_dequantize": ([_int, _ptr, _ptr, _int, _i64, _i64, _i64, _i64, _ptr, _int], _int),
    "zc_dequantize_reduce_requantize": ([_int, _ptr, _i64, _ptr, _i64, _i64, _int, _i64,
                                         _i64, _i64, _i64, _ptr, _ptr], _int),
}


def library_path() -> str | None:
    """Path of the built library next to this module, or None if there is none."""
    for suffix in EXTENSION_SUFFIXES:  # .abi3.so first match wins; also .pyd on Windows
        path = os.path.join(_HERE, LIB_NAME + suffix)
        if os.path.exists(path):
            return path
    return None


def _source_sha256() -> str | None:
    """SHA-256 of quant_native.c when the source is present (editable install), else None."""
    path = os.path.join(_HERE, SOURCE_NAME)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) or (None, why it is not used)."""
    if os.environ.get(ENV_DISABLE, "").strip() == "0":
        return None, f"disabled by {ENV_DISABLE}=0 in the environment"
    if sys.byteorder != "little":
        return None, ("the native library is only used on little-endian hosts (this one "
                      "is big-endian)")
    path = library_path()
    if path is None:
        return None, (f"the native library {LIB_NAME} was not built (no "
                      f"{LIB_NAME}{EXTENSION_SUFFIXES[0]} in {_HERE}; the C build is "
                      f"optional and is skipped when it fails); {_REBUILD}")
    try:
        lib = ctypes.CDLL(path)
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
    except (OSError, AttributeError) as exc:
        return None, f"{path} could not be loaded ({type(exc).__name__}: {exc}); {_REBUILD}"
    if lib.zc_abi_version() != ABI_VERSION:
        return None, (f"{path} has ABI version {lib.zc_abi_version()} but quant_native.py "
                      f"expects {ABI_VERSION} (a stale build); {_REBUILD}")
    built_from, source = lib.zc_source_sha256().decode(), _source_sha256()
    if source is not None and built_from != source:
        return None, (f"{path} was built from another version of {SOURCE_NAME} (stale "
                      f"build: the source changed since); {_REBUILD}")
    return lib, None


LIB, REASON = _load()
#: instruction-set level the kernels run at: the best this CPU supports (see
#: quant_native.c; 2 = AVX-512, 1 = AVX2, 0 = baseline / portable build)
LEVEL = LIB.zc_best_level() if LIB is not None else None


def levels() -> list[int]:
    """Every level this CPU can run (tests check each against the reference)."""
    return [] if LIB is None else list(range(LIB.zc_best_level() + 1))


def level_name(level: int) -> str:
    return LIB.zc_level_name(level).decode()


def available() -> bool:
    """True when the compiled library is loaded and used."""
    return LIB is not None


def describe() -> str:
    """One line for reports: the library and the variant the CPU runs, or why not used."""
    if LIB is None:
        return f"not used: {REASON}"
    return f"{library_path()} ({level_name(LEVEL)} code, the best this CPU runs)"


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native {what} failed: {_STATUS.get(rc, f'status {rc}')}; this is "
                           f"a bug in zero-core (its arguments were checked before the call); "
                           f"set {ENV_DISABLE}=0 to use the torch path meanwhile")


def quantize_blocks(x: torch.Tensor, bits: int, block_size: int, b0: int, b1: int,
                    payload: torch.Tensor, scales: torch.Tensor,
                    level: int | None = None) -> None:
    """Quantize blocks b0..b1 of the flat contiguous fp32/fp16/bf16 *x* into the whole
    *payload* / *scales* of its layout. *level*: instruction-set level (default LEVEL)."""
    _check(LIB.zc_quantize(LEVEL if level is None else level, x.data_ptr(), DTYPE_CODES[x.dtype], x.numel(), bits, block_size,
                           b0, b1, payload.data_ptr(), scales.data_ptr()), "quantize")


def dequantize_blocks(payload: torch.Tensor, scales: torch.Tensor, bits: int,
                      block_size: int, numel: int, b0: int, b1: int, out: torch.Tensor,
                      level: int | None = None) -> None:
    """Dequantize blocks b0..b1 into the flat contiguous *out* of *numel* elements."""
    _check(LIB.zc_dequantize(LEVEL if level is None else level, payload.data_ptr(), scales.data_ptr(), bits, block_size, numel,
                             b0, b1, out.data_ptr(), DTYPE_CODES[out.dtype]), "dequantize")


def reduce_blocks(p2: torch.Tensor, s2: torch.Tensor, bits: int, block_size: int,
                  numel: int, b0: int, b1: int, payload: torch.Tensor,
                  scales: torch.Tensor, level: int | None = None) -> None:
    """Sum of the k senders' (rows of the contiguous *p2* / *s2*) dequantized blocks
    b0..b1, sender 0 first, quantized into *payload* / *scales*."""
    _check(LIB.zc_dequantize_reduce_requantize(
        LEVEL if level is None else level, p2.data_ptr(), p2.stride(0), s2.data_ptr(), s2.stride(0), p2.shape[0], bits,
        block_size, numel, b0, b1, payload.data_ptr(), scales.data_ptr()),
        "dequantize_reduce_requantize")
