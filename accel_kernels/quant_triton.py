"""Block-wise int8/int4 quantization as Triton kernels, for CUDA and Intel XPU devices.

Same functions, format and edge cases as :mod:`.quant_reference` (see
:mod:`.quant_layout`): one Triton program per quantization block, with the reference's
rounding steps (true division by the scale, round half to even), so results match it
bit for bit wherever the device follows IEEE float32 division.

Triton is optional (``pip install zero-core[triton]``): this module imports without it
and says how to get it on the first call. The kernels themselves live in
:mod:`.quant_triton_kernels`, imported then. Tested on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, tensors on the CPU) against the reference; they
have not been run on a GPU by this project.
"""
from __future__ import annotations

import importlib

import torch

from .quant_layout import (check_dequant_out, check_input, check_output_dtype,
                           check_payload, check_quant_out, new_quant_out, num_blocks,
                           stack_senders)

_kernels = None


def kernels():
    """The compiled-on-demand Triton kernels module (imports triton on first use)."""
    global _kernels
    if _kernels is None:
        try:
            _kernels = importlib.import_module(f"{__package__}.quant_triton_kernels")
        except ImportError as exc:
            raise ImportError(f"quant_triton needs triton ({exc}); install it with "
                              "`pip install zero-core[triton]` or use quant_reference / "
                              "quant_cpu") from exc
    return _kernels


def _lanes(block_size: int, bits: int) -> dict:
    """Launch options: the tile width of one block (the block size rounded up to a power
    of two), and no FMA contraction, which would round q*s+t once where the reference
    rounds twice."""
    lanes = 1 << max(0, (block_size - 1).bit_length())
    tile = {"LANES": lanes} if bits == 8 else {"HALF_LANES": max(1, lanes // 2)}
    return {**tile, "enable_fp_fusion": False}


def quantize(x: torch.Tensor, bits: int, block_size: int, *, out=None):
    """Quantize *x* (any shape, fp32/fp16/bf16, read as flat) block-wise on its device.

    Returns ``(payload, scales)`` as :func:`.quant_reference.quantize` does; *out*, an
    optional preallocated ``(payload, scales)`` pair, receives the result.
    """
    check_input(x, bits, block_size)
    k = kernels()
    flat = x.reshape(-1).contiguous()  # a strided 1-D input stays strided otherwise
    numel = flat.numel()
    out = check_quant_out(out, numel, bits, block_size, x.device)
    payload, scales = out if out is not None else new_quant_out(numel, bits, block_size,
                                                               x.device)
    grid = (num_blocks(numel, block_size),)
    if numel:
        kernel = k.quantize_int8_kernel if bits == 8 else k.quantize_int4_kernel
        kernel[grid](flat, payload, scales, numel, block_size, **_lanes(block_size, bits))
    return payload, scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
               numel: int, dtype: torch.dtype = torch.float32, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild *numel* values of *dtype* (flat) from ``quantize``'s output on its device.

    Same results as :func:`.quant_reference.dequantize`; *out* is an optional
    preallocated flat tensor of *numel* elements of *dtype*.
    """
    check_payload(payload, scales, bits, block_size, numel)
    check_output_dtype(dtype)
    k = kernels()
    flat_out = check_dequant_out(out, numel, dtype, payload.device)
    if flat_out is None:
        flat_out = torch.empty(numel, dtype=dtype, device=payload.device)
    if numel:
        kernel = k.dequantize_int8_kernel if bits == 8 else k.dequantize_int4_kernel
        kernel[(num_blocks(numel, block_size),)](
            payload.reshape(-1).contiguous(), scales.reshape(-1).contiguous(), flat_out,
            numel, block_size, **_lanes(block_size, bits))
    return flat_out if out is None else out


def dequantize_reduce_requantize(payloads, scales, bits: int, block_size: int,
                                 numel: int | None = None, *, out=None):
    """qgZ's middle hop in one kernel: dequantize k senders, sum (sender 0 first) in
    float32, requantize. Same contract as the reference function of that name."""
    p2, s2, numel = stack_senders(payloads, scales, bits, block_size, numel)
    k = kernels()
    out = check_quant_out(out, numel, bits, block_size, p2.device)
    payload, out_scales = out if out is not None else new_quant_out(numel, bits, block_size,
                                                                    p2.device)
    if numel:
        kernel = k.reduce_int8_kernel if bits == 8 else k.reduce_int4_kernel
        kernel[(num_blocks(numel, block_size),)](
            p2, s2, payload, out_scales, p2.shape[0], p2.stride(0), s2.stride(0), numel,
            block_size, **_lanes(block_size, bits))
    return payload, out_scales
