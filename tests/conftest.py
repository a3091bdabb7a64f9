"""What the whole test session needs before any test module is imported.

``TRITON_INTERPRET=1``: the Triton kernels are tested on the CPU through Triton's
interpreter, and Triton reads the variable when it is first imported. transformers and
lightning import triton (through torch) as a side effect, so a test file importing them
in-process before tests/test_quant_kernels.py would leave Triton in compiled mode and every
Triton kernel test would fail ("Cannot call @triton.jit'd outside of the scope of a
kernel"). Tests that need compiled Triton run it in a subprocess without the variable.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
