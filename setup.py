"""Build step of zero-core: compiles the CPU quantization library ahead of time.

All project metadata lives in pyproject.toml; setuptools merges in what this file adds,
which is only the C library ``zero_core.accel_kernels._quant_native`` (source
accel_kernels/quant_native.c). It is plain C loaded with ctypes (no Python C-API), built
by ``pip install .``, ``pip install -e .`` (in place, next to the source) and wheel
builds; nothing is compiled at run time. If no C compiler works the install still
succeeds and quant_cpu uses its pure-torch path; ``zero-core report`` says why.
"""
import hashlib
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = os.path.join("accel_kernels", "quant_native.c")

# The results must be bit-identical to the float32 reference: no FMA contraction of
# a*b+c, no fast-math. Portable code generation only (no -march=native): the source
# multiversions its loops for AVX-512/AVX2 itself (see quant_native.c).
UNIX_FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden"]
MSVC_FLAGS = ["/O2", "/fp:precise"]


def _source_sha256() -> str:
    """Compiled into the library so the loader can detect a build older than the source."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, SOURCE), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


class BuildNative(build_ext):
    """build_ext with compiler-specific floating-point flags for the C library."""

    def build_extension(self, ext):
        flags = MSVC_FLAGS if self.compiler.compiler_type == "msvc" else UNIX_FLAGS
        ext.extra_compile_args = flags + list(ext.extra_compile_args or [])
        super().build_extension(ext)

    def get_export_symbols(self, ext):
        # a ctypes library, not a Python module: there is no PyInit_ function to export
        return []


native = Extension(
    "zero_core.accel_kernels._quant_native",
    sources=[SOURCE],
    define_macros=[("ZC_SOURCE_SHA256", f'"{_source_sha256()}"')],
    # it does not use the Python C-API at all, so one build serves every CPython 3
    py_limited_api=True,
    # a host without a working C compiler still installs; quant_cpu falls back to torch
    optional=True,
)

setup(ext_modules=[native], cmdclass={"build_ext": BuildNative},
      options={"bdist_wheel": {"py_limited_api": "cp310"}})
