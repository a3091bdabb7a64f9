"""zero_core/optim/grad_norm.py: the local squared gradient norm equals float64 math, and a
bf16 partition's norm does not allocate a float32 copy of it."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from zero_core.optim.grad_norm import CHUNK, squared_norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_squared_norm_equals_float64_math(dtype):
    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(n, generator=g).to(dtype) * s
               for n, s in ((3, 1.0), (CHUNK + 5, 0.01), (8 * CHUNK + 17, 3.0))]
    tensors.append(torch.randn(40, 50, generator=g).to(dtype))   # not flat
    want = sum(float(t.double().square().sum()) for t in tensors)
    got = squared_norm(tensors)
    assert got.dtype == torch.float64 and got.dim() == 0
    # float32 within each chunk: ~2e-4 relative (a whole-tensor float32 norm: 4e-3)
    assert abs(float(got) - want) <= 1e-3 * want


PROBE = """
import torch
from zero_core.backends.accelerators.cpu import peak_rss_bytes, reset_peak_rss, rss_bytes
from zero_core.optim.grad_norm import CHUNK, squared_norm
t = torch.empty(32 * CHUNK, dtype=torch.bfloat16).normal_()   # no float32 temporary
squared_norm([torch.ones(CHUNK + 1, dtype=torch.bfloat16)])   # warm the allocator
why = reset_peak_rss()
before = rss_bytes()
squared_norm([t])
print(why, peak_rss_bytes() - before)
"""


def test_bf16_norm_needs_no_float32_copy():
    """In a fresh process (a test process's heap holds freed blocks of earlier tests): a
    256 MiB bf16 partition, whose float32 copy would be 512 MiB."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out[0] == "None", f"peak RSS cannot be reset here: {out}"
    grown = int(out[1])
    assert grown < 4 * CHUNK * 4, grown / 2 ** 20   # a few chunks in float32, no copy
