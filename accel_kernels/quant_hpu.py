"""Block-wise int8/int4 quantization for Habana Gaudi (HPU), in plain torch ops.

NOT RUN ON GAUDI HARDWARE: this project has no HPU. The module uses only ordinary torch
ops (elementwise float arithmetic, ``amax``, ``isfinite``, ``where``, ``round``, dtype
casts, ``&`` and ``>>`` on uint8, ``pad``, ``stack``), which Habana's PyTorch bridge runs
as graph ops; whether each has an HPU kernel for every dtype used here (the uint8 bit
operations in particular) has not been checked against Habana's operator list
(docs.habana.ai, "PyTorch Operators") or on a card. It is tested on the CPU against
:mod:`.quant_reference` (bit-identical results). We know of no documented Habana op that
produces this block format, so no vendor op is wrapped and ``habana_frameworks`` is not
imported here.

What is shaped for Gaudi's graph compiler rather than copied from the reference:

* no host synchronisation: no ``.item()``, ``.any()`` or data-dependent Python branch,
  so a step stays one lazy-mode graph (the NaN/inf handling is done with ``where``);
* static shapes: padding with ``torch.nn.functional.pad`` to whole blocks, views and
  fixed slices only, so that recompilation happens once per (numel, block_size);
* the k senders of the fused kernel are added in sender order by a Python loop over a
  static k, which lazy mode traces into one graph (same float32 rounding as the
  reference, which the tests check).

Format and edge cases: :mod:`.quant_layout`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant_layout import (INT4_OFFSET, QMAX, check_dequant_out, check_input,
                           check_output_dtype, check_payload, check_quant_out, num_blocks,
                           stack_senders)


def _as_rows(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """float32 (blocks, block_size) view of *flat*, zero padded to whole blocks."""
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    return F.pad(flat.float(), (0, pad)).view(-1, block_size)


def _quantize_rows(rows: torch.Tensor, numel: int, bits: int):
    qmax = QMAX[bits]
    finite = torch.isfinite(rows).all(dim=1, keepdim=True)
    absmax = torch.where(finite, rows, 0.0).abs().amax(dim=1, keepdim=True)
    scales = absmax / qmax
    divisor = torch.where(scales > 0, scales, 1.0)
    q = torch.where(finite, torch.round(torch.where(finite, rows, 0.0) / divisor), 0.0)
    scales = torch.where(finite, scales, float("nan")).view(-1)
    if bits == 8:
        return q.view(-1)[:numel].to(torch.int8), scales
    # int4: pairs of neighbours -> (q_even + 8) + 16 (q_odd + 8); the padding after an odd
    # numel is a zero value, i.e. nibble 8, as the format requires
    pairs = (q.view(-1)[:2 * ((numel + 1) // 2)] + INT4_OFFSET).view(-1, 2)
    packed = pairs[:, 0] + 16.0 * pairs[:, 1]
    return packed.to(torch.uint8), scales


def _dequantize_rows(payload: torch.Tensor, scales: torch.Tensor, bits: int,
                     block_size: int, numel: int) -> torch.Tensor:
    """float32 (blocks, block_size) of q * scale, the tail padding 0 (NaN in a NaN block)."""
    if bits == 8:
        q = payload.float()
    else:
        low = (payload & 0x0F).float()
        high = (payload >> 4).float()
        q = (torch.stack([low, high], dim=1).view(-1) - INT4_OFFSET)[:numel]
    return _as_rows(q, block_size) * scales.view(-1, 1)


def quantize(x: torch.Tensor, bits: int, block_size: int, *, out=None):
    """Quantize *x* (any shape, fp32/fp16/bf16, read as flat) block-wise.

    Returns ``(payload, scales)`` as :func:`.quant_reference.quantize` does; *out*, an
    optional preallocated ``(payload, scales)`` pair, receives the result.
    """
    check_input(x, bits, block_size)
    flat = x.reshape(-1)
    out = check_quant_out(out, flat.numel(), bits, block_size, x.device)
    payload, scales = _quantize_rows(_as_rows(flat, block_size), flat.numel(), bits)
    return _deliver(payload, scales, out)


def dequantize(payload: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
               numel: int, dtype: torch.dtype = torch.float32, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild *numel* values of *dtype* (flat) from ``quantize``'s output.

    Same results as :func:`.quant_reference.dequantize`; *out* is an optional
    preallocated flat tensor of *numel* elements of *dtype*.
    """
    check_payload(payload, scales, bits, block_size, numel)
    check_output_dtype(dtype)
    flat_out = check_dequant_out(out, numel, dtype, payload.device)
    values = _dequantize_rows(payload.reshape(-1), scales, bits, block_size, numel)
    values = values.view(-1)[:numel].to(dtype)
    if flat_out is None:
        return values
    flat_out.copy_(values)
    return out


def dequantize_reduce_requantize(payloads, scales, bits: int, block_size: int,
                                 numel: int | None = None, *, out=None):
    """qgZ's middle hop: the k senders' dequantized values summed in float32 (sender 0
    first) and requantized; same contract as the reference function of that name."""
    p2, s2, numel = stack_senders(payloads, scales, bits, block_size, numel)
    out = check_quant_out(out, numel, bits, block_size, p2.device)
    total = _dequantize_rows(p2[0], s2[0], bits, block_size, numel)
    for i in range(1, p2.shape[0]):  # k is small and static: unrolled into one graph
        total = total + _dequantize_rows(p2[i], s2[i], bits, block_size, numel)
    payload, new_scales = _quantize_rows(total, numel, bits)
    return _deliver(payload, new_scales, out)


def _deliver(payload, scales, out):
    if out is None:
        return payload, scales
    out[0].copy_(payload)
    out[1].copy_(scales)
    return out
