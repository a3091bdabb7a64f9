"""Block-wise symmetric int8/int4 quantization in plain torch: the definition to match.

The format and every edge case (zero blocks, outliers, NaN/inf, partial last block) are
defined in :mod:`.quant_layout`. These functions favour clarity over speed, run on any
device torch supports and compute in float32.
"""
from __future__ import annotations

import torch

from .quant_layout import (INT4_OFFSET, QMAX, check_dequant_out, check_input,
                           check_output_dtype, check_payload, check_quant_out, num_blocks,
                           stack_senders)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x as float32 (n_blocks, block_size), the partial last block padded with zeros."""
    flat = x.reshape(-1).float()
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int values in [-7, 7] two per byte (element 2i low nibble, stored as q + 8)."""
    u = (q.reshape(-1).to(torch.int16) + INT4_OFFSET).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_full((1,), INT4_OFFSET)])  # the padding nibble means 0
    pairs = u.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(payload: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: *numel* int8 values in [-8, 7]."""
    low = (payload & 0x0F).to(torch.int8) - INT4_OFFSET
    high = (payload >> 4).to(torch.int8) - INT4_OFFSET
    return torch.stack([low, high], dim=1).reshape(-1)[:numel]


def _quantize_blocks(blocks: torch.Tensor, numel: int, bits: int):
    """Quantize float32 (n_blocks, block_size) rows; returns (payload, scales)."""
    qmax = QMAX[bits]
    finite = torch.isfinite(blocks).all(dim=1)
    absmax = torch.where(finite, blocks.abs().amax(dim=1), 0.0)
    scales = absmax / qmax
    # zero blocks: divide by 1 instead of 0 (their values are 0 anyway); non-finite
    # blocks: divide by 1 too, the payload is zeroed below and the scale set to NaN
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax)
    q = torch.where(finite[:, None], q, torch.zeros_like(q))
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    q = q.reshape(-1)[:numel].to(torch.int8)
    payload = q if bits == 8 else pack_int4(q)
    return payload, scales


def _deliver(result, out):
    if out is None:
        return result
    out[0].copy_(result[0])
    out[1].copy_(result[1])
    return out


def quantize(x: torch.Tensor, bits: int, block_size: int, *, out=None):
    """Quantize *x* (any shape, fp32/fp16/bf16, read as flat) block-wise.

    Returns ``(payload, scales)``: payload int8 (bits=8, numel bytes) or uint8 with two
    values per byte (bits=4, ceil(numel/2) bytes); scales float32, one per block of
    *block_size* elements (last block partial). See :mod:`.quant_layout`. *out*, an
    optional preallocated ``(payload, scales)`` pair, receives the result.
    """
    check_input(x, bits, block_size)
    out = check_quant_out(out, x.numel(), bits, block_size, x.device)
    return _deliver(_quantize_blocks(_blocks(x, block_size), x.numel(), bits), out)


def _dequantize_blocks(payload, scales, bits, block_size, numel) -> torch.Tensor:
    """float32 (n_blocks, block_size) values, the padding of the last block 0."""
    q = payload.reshape(-1) if bits == 8 else unpack_int4(payload.reshape(-1), numel)
    nb = num_blocks(numel, block_size)
    pad = nb * block_size - numel
    qf = q.float()
    if pad:
        qf = torch.cat([qf, qf.new_zeros(pad)])
    return qf.view(nb, block_size) * scales.reshape(-1, 1)


def dequantize(payload: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
               numel: int, dtype: torch.dtype = torch.float32, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild a flat tensor of *numel* values of *dtype* from ``quantize``'s output.

    Each value is ``q * scale`` of its block, computed in float32 and then rounded to
    *dtype*; a block with a NaN scale comes back as NaN. *out*: optional preallocated
    flat tensor of *numel* elements of *dtype*.
    """
    check_payload(payload, scales, bits, block_size, numel)
    check_output_dtype(dtype)
    flat_out = check_dequant_out(out, numel, dtype, payload.device)
    values = _dequantize_blocks(payload, scales, bits, block_size, numel)
    values = values.reshape(-1)[:numel].to(dtype)
    if flat_out is None:
        return values
    flat_out.copy_(values)
    return out


def dequantize_reduce_requantize(payloads, scales, bits: int, block_size: int,
                                 numel: int | None = None, *, out=None):
    """qgZ's middle hop: dequantize k senders' payloads, sum them, quantize the sum.

    *payloads*: k payloads of one layout (a sequence, or a (k, bytes) tensor); *scales*:
    their k scale vectors (a sequence or a (k, n_blocks) tensor). The sum is taken in
    float32, sender 0 first. Returns ``(payload, scales)`` in the same format. *numel*
    defaults to the payload's capacity (exact for int8 and for even sizes). *out*: as
    in :func:`quantize`.
    """
    p2, s2, numel = stack_senders(payloads, scales, bits, block_size, numel)
    out = check_quant_out(out, numel, bits, block_size, p2.device)
    total = None
    for i in range(p2.shape[0]):
        part = _dequantize_blocks(p2[i], s2[i], bits, block_size, numel)
        total = part if total is None else total + part
    return _deliver(_quantize_blocks(total, numel, bits), out)
