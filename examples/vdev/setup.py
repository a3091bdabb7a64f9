"""Build step of zero-core-vdev: compiles the device runtime (csrc/vdev.cpp) against the
installed torch. Metadata lives in pyproject.toml.

The library is a plain shared object with no Python module in it: importing
zero_core_vdev loads it with torch.ops.load_library, and its static registrations (the
allocator, the device guard, the hooks and the kernels) run at that moment.
"""
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

runtime = CppExtension(
    "zero_core_vdev._vdev_runtime",
    sources=["csrc/vdev.cpp"],
    depends=["csrc/streams.h"],  # included by vdev.cpp: a change to it rebuilds
    extra_compile_args=["-O2", "-std=c++17"],
)

setup(ext_modules=[runtime], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)})
