"""The wire format of block-wise symmetric quantization, shared by every target.

A flat tensor of ``numel`` values is cut into blocks of ``block_size`` consecutive
elements (the last block is partial when ``numel`` is not a multiple). Each block has one
float32 scale ``s = absmax(block) / qmax`` and its values are sent as integers
``q = round_half_even(x / s)`` in ``[-qmax, qmax]``; the receiver computes ``q * s``.

=====  ====  ==================================================================  =========
bits   qmax  payload                                                             bytes
=====  ====  ==================================================================  =========
8      127   ``torch.int8``, one value per element                               numel
4      7     ``torch.uint8``, two values per byte: element 2i in the low nibble,  ceil(n/2)
             2i+1 in the high nibble, each stored as ``q + 8`` (1..15); the
             unused high nibble of an odd-sized payload holds 8, i.e. zero
=====  ====  ==================================================================  =========

The range is symmetric (-128 / -8 are never produced) so that negating a tensor negates
its payload exactly. For int4, ``block_size`` must be even, so that every block starts on
a byte boundary and a slice of whole blocks is a slice of the payload.

Defined edge cases (identical on every target, tested in tests/test_quant_kernels.py):

* A block of zeros has scale 0 and payload 0; it dequantizes to exact zeros (no 0/0).
* Outliers: a block's scale follows its largest magnitude, so one outlier coarsens only
  its own block; every element is still within half a step (``s / 2``) of its input.
* A block holding any NaN or +-inf gets scale NaN and payload 0, so *every* element of
  that block dequantizes to NaN: the receiver sees non-finite values and an fp16
  loss-scaler's overflow check skips the step, as it would have without quantization.
  The fused dequantize-reduce-requantize propagates this: a NaN block from any sender,
  or a sum that overflows float32, gives a NaN block.
* Scales are computed in float32 whatever the input dtype (fp32, fp16, bf16).
"""
from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}
#: input dtypes the quantizers accept (computed in float32)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: nibble offset of the int4 encoding: stored = q + 8
INT4_OFFSET = 8


def num_blocks(numel: int, block_size: int) -> int:
    """Number of blocks (and of scales) for *numel* elements."""
    return -(-numel // block_size)


def payload_numel(numel: int, bits: int) -> int:
    """Bytes of payload for *numel* elements at *bits* per value."""
    return numel if bits == 8 else -(-numel // 2)


def payload_dtype(bits: int) -> torch.dtype:
    return torch.int8 if bits == 8 else torch.uint8


def check_format(bits: int, block_size: int) -> None:
    """Reject an unsupported bit width or block size, saying what is supported."""
    if bits not in QMAX:
        raise ValueError(f"bits={bits!r} is not supported; use 8 (int8) or 4 (int4, two "
                         "values per byte)")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive int (elements per "
                         "scale, e.g. 256)")
    if bits == 4 and block_size % 2:
        raise ValueError(f"block_size={block_size} is odd; int4 packs two values per byte, "
                         "so blocks must hold an even number of elements (e.g. 256)")


def check_input(x, bits: int, block_size: int) -> None:
    """Validate the arguments of ``quantize``."""
    check_format(bits, block_size)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantize got dtype {x.dtype}; it takes float32, float16 or "
                        f"bfloat16 (convert with .float() first)")


def check_payload(payload, scales, bits: int, block_size: int, numel: int,
                  what: str = "payload") -> None:
    """Validate a (payload, scales) pair against the layout of *numel* elements."""
    check_format(bits, block_size)
    if not isinstance(payload, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise TypeError(f"{what} and its scales must be torch.Tensors")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel={numel!r} must be the int element count of the original "
                         "tensor")
    want_dtype, want_n = payload_dtype(bits), payload_numel(numel, bits)
    if payload.dtype != want_dtype:
        raise TypeError(f"{what} has dtype {payload.dtype}; {bits}-bit payloads are "
                        f"{want_dtype} (pass the payload quantize returned)")
    if payload.numel() != want_n:
        raise ValueError(f"{what} has {payload.numel()} bytes but {numel} elements at "
                         f"{bits} bits need {want_n}; check numel and bits")
    nb = num_blocks(numel, block_size)
    if scales.dtype != torch.float32 or scales.numel() != nb:
        raise ValueError(f"scales of {what} must be {nb} float32 values (one per block of "
                         f"{block_size}), got {scales.numel()} of {scales.dtype}; check "
                         "block_size")
    if payload.device != scales.device:
        raise ValueError(f"{what} is on {payload.device} but its scales are on "
                         f"{scales.device}; keep them together")


def check_output_dtype(dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dequantize dtype={dtype!r}; choose torch.float32, torch.float16 or "
                        "torch.bfloat16")


def stack_senders(payloads, scales, bits: int, block_size: int, numel: int | None):
    """Normalize the k senders' inputs of the fused kernel to (k, bytes) and (k, blocks).

    *payloads* / *scales* may be sequences of 1-D tensors or already-stacked 2-D tensors.
    Returns ``(payloads_2d, scales_2d, numel)``; *numel* defaults to what the payload
    holds (for int4, 2 x bytes: an odd tensor's padding nibble is zero, so it adds nothing).
    """
    check_format(bits, block_size)
    p2 = payloads if isinstance(payloads, torch.Tensor) else _stack("payloads", payloads)
    s2 = scales if isinstance(scales, torch.Tensor) else _stack("scales", scales)
    if p2.dim() != 2 or s2.dim() != 2 or p2.shape[0] != s2.shape[0] or p2.shape[0] < 1:
        raise ValueError(f"expected k >= 1 senders with one payload and one scales tensor "
                         f"each; got payloads {tuple(p2.shape)} and scales "
                         f"{tuple(s2.shape)}")
    if numel is None:
        numel = p2.shape[1] if bits == 8 else 2 * p2.shape[1]
    for i in range(p2.shape[0]):
        check_payload(p2[i], s2[i], bits, block_size, numel, what=f"payload of sender {i}")
    return p2.contiguous(), s2.contiguous(), numel


def _stack(name, seq):
    seq = list(seq)
    if not seq or not all(isinstance(t, torch.Tensor) for t in seq):
        raise TypeError(f"{name} must be a non-empty sequence of tensors (one per sender) "
                        "or a 2-D tensor")
    sizes = {t.numel() for t in seq}
    if len(sizes) != 1:
        raise ValueError(f"every sender's {name} must have the same size, got {sorted(sizes)}")
    return torch.stack([t.reshape(-1) for t in seq])


def check_quant_out(out, numel: int, bits: int, block_size: int, device):
    """Validate an optional ``out=(payload, scales)`` of a quantizer; returns it or None."""
    if out is None:
        return None
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError("out must be a (payload, scales) pair of tensors, as quantize returns")
    payload, scales = out
    check_payload(payload, scales, bits, block_size, numel, what="out payload")
    if not (payload.is_contiguous() and scales.is_contiguous()):
        raise ValueError("out payload and scales must be contiguous")
    if payload.device != device:
        raise ValueError(f"out is on {payload.device} but the input is on {device}")
    return payload.view(-1), scales.view(-1)


def check_dequant_out(out, numel: int, dtype, device):
    """Validate an optional ``out`` tensor of ``dequantize``; returns it flat or None."""
    if out is None:
        return None
    if not isinstance(out, torch.Tensor) or out.dtype != dtype or out.numel() != numel:
        raise ValueError(f"out must be a tensor of {numel} elements of {dtype}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} with "
                         f"{getattr(out, 'numel', lambda: '?')()} elements")
    if not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be contiguous and on {device}")
    return out.view(-1)


def new_quant_out(numel: int, bits: int, block_size: int, device):
    """Fresh (payload, scales) tensors for *numel* elements."""
    return (torch.empty(payload_numel(numel, bits), dtype=payload_dtype(bits), device=device),
            torch.empty(num_blocks(numel, block_size), dtype=torch.float32, device=device))
