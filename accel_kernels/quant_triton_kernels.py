"""Triton kernels of block-wise int8/int4 quantization (imported by :mod:`.quant_triton`).

This module imports triton at its top: import it only through ``quant_triton``, which
does so on the first call. One program handles one quantization block; ``LANES`` is the
block size rounded up to a power of two (Triton's tile sizes are powers of two) and
masked. Every rounding step mirrors :mod:`.quant_reference`: float32 absmax, scale =
absmax / qmax, a true division by the scale, round half to even, NaN scale and zero
payload for a non-finite block.
"""
import triton
import triton.language as tl


@triton.jit
def _round_half_even(v):
    # floor and these subtractions are exact for |v| < 2**23, so this is IEEE rint
    f = tl.floor(v)
    d = v - f
    f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & f_is_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _to_output(v, dtype: tl.constexpr):
    """float32 -> output dtype, rounding to nearest even. bf16 is rounded by hand on the
    bits because Triton's interpreter truncates; on GPUs this gives the same result as
    the hardware's round-to-nearest-even conversion."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        # shifts instead of "& 0xFFFF0000", a literal that would not stay 32-bit
        bits = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16) << 16
        v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))  # keep NaN a NaN
    return v.to(dtype)


@triton.jit
def _div(x, y):
    """IEEE round-to-nearest x / y: Triton's ``/`` is a 2-ulp approximation on CUDA
    (div.full.f32), which would make rare values round differently from the reference."""
    return tl.math.div_rn(x, tl.broadcast_to(y, x.shape))


@triton.jit
def _block_scale(absmax, n_bad, QMAX: tl.constexpr):
    """(scale to store, divisor to use) of one block."""
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32))
    scale = tl.where(n_bad > 0, float("nan"), scale)
    divisor = tl.where(scale > 0.0, scale, 1.0)  # NaN > 0 is false: NaN blocks divide by 1
    return scale, divisor


@triton.jit
def _is_bad(v):
    # v != v is NaN; |v| == inf is +-inf
    return ((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32)


@triton.jit
def quantize_int8_kernel(x_ptr, payload_ptr, scales_ptr, numel, block_size,
                         LANES: tl.constexpr):
    blk = tl.program_id(0)
    lane = tl.arange(0, LANES)
    offs = blk.to(tl.int64) * block_size + lane
    mask = (lane < block_size) & (offs < numel)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    n_bad = tl.sum(_is_bad(x), axis=0)
    absmax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
    scale, divisor = _block_scale(absmax, n_bad, 127.0)
    q = _round_half_even(_div(x, divisor))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    q = tl.where(n_bad > 0, 0.0, q)
    tl.store(payload_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scales_ptr + blk, scale)


@triton.jit
def _quantize_int4_pairs(x_even, x_odd, mask_even, mask_odd):
    """Shared tail of the int4 quantizers: (scale, packed bytes as int32)."""
    n_bad = tl.sum(_is_bad(x_even), axis=0) + tl.sum(_is_bad(x_odd), axis=0)
    absmax = tl.maximum(tl.max(tl.where(mask_even, tl.abs(x_even), 0.0), axis=0),
                        tl.max(tl.where(mask_odd, tl.abs(x_odd), 0.0), axis=0))
    scale, divisor = _block_scale(absmax, n_bad, 7.0)
    q_even = tl.minimum(tl.maximum(_round_half_even(_div(x_even, divisor)), -7.0), 7.0)
    q_odd = tl.minimum(tl.maximum(_round_half_even(_div(x_odd, divisor)), -7.0), 7.0)
    q_even = tl.where(n_bad > 0, 0.0, q_even)
    q_odd = tl.where((n_bad > 0) | (~mask_odd), 0.0, q_odd)  # a missing odd element packs as 0
    packed = (q_even.to(tl.int32) + 8) | ((q_odd.to(tl.int32) + 8) << 4)
    return scale, packed


@triton.jit
def quantize_int4_kernel(x_ptr, payload_ptr, scales_ptr, numel, block_size,
                         HALF_LANES: tl.constexpr):
    blk = tl.program_id(0)
    pair = tl.arange(0, HALF_LANES)
    first = blk.to(tl.int64) * block_size
    in_block = 2 * pair < block_size
    offs_even = first + 2 * pair
    mask_even = in_block & (offs_even < numel)
    mask_odd = in_block & (offs_even + 1 < numel)
    x_even = tl.load(x_ptr + offs_even, mask=mask_even, other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + offs_even + 1, mask=mask_odd, other=0.0).to(tl.float32)
    scale, packed = _quantize_int4_pairs(x_even, x_odd, mask_even, mask_odd)
    tl.store(payload_ptr + first // 2 + pair, packed.to(tl.uint8), mask=mask_even)
    tl.store(scales_ptr + blk, scale)


@triton.jit
def dequantize_int8_kernel(payload_ptr, scales_ptr, out_ptr, numel, block_size,
                           LANES: tl.constexpr):
    blk = tl.program_id(0)
    lane = tl.arange(0, LANES)
    offs = blk.to(tl.int64) * block_size + lane
    mask = (lane < block_size) & (offs < numel)
    q = tl.load(payload_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(scales_ptr + blk)
    tl.store(out_ptr + offs, _to_output(q * scale, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dequantize_int4_kernel(payload_ptr, scales_ptr, out_ptr, numel, block_size,
                           HALF_LANES: tl.constexpr):
    blk = tl.program_id(0)
    pair = tl.arange(0, HALF_LANES)
    first = blk.to(tl.int64) * block_size
    in_block = 2 * pair < block_size
    offs_even = first + 2 * pair
    mask_even = in_block & (offs_even < numel)
    mask_odd = in_block & (offs_even + 1 < numel)
    byte = tl.load(payload_ptr + first // 2 + pair, mask=mask_even, other=0x88).to(tl.int32)
    scale = tl.load(scales_ptr + blk)
    v_even = ((byte & 15) - 8).to(tl.float32) * scale
    v_odd = ((byte >> 4) - 8).to(tl.float32) * scale
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs_even, _to_output(v_even, dtype), mask=mask_even)
    tl.store(out_ptr + offs_even + 1, _to_output(v_odd, dtype), mask=mask_odd)


@triton.jit
def reduce_int8_kernel(payloads_ptr, scales_ptr, payload_ptr, out_scales_ptr, k,
                       payload_stride, scales_stride, numel, block_size,
                       LANES: tl.constexpr):
    """Sum of k senders' dequantized blocks (sender 0 first), requantized to int8."""
    blk = tl.program_id(0)
    lane = tl.arange(0, LANES)
    offs = blk.to(tl.int64) * block_size + lane
    mask = (lane < block_size) & (offs < numel)
    total = tl.zeros([LANES], dtype=tl.float32)
    for i in range(k):
        q = tl.load(payloads_ptr + i * payload_stride + offs, mask=mask, other=0)
        s = tl.load(scales_ptr + i * scales_stride + blk)
        # i == 0 assigns instead of adding to 0.0, as the reference does (-0.0 + 0.0 = 0.0)
        total = tl.where(i == 0, q.to(tl.float32) * s, total + q.to(tl.float32) * s)
    n_bad = tl.sum(_is_bad(total), axis=0)
    absmax = tl.max(tl.where(mask, tl.abs(total), 0.0), axis=0)
    scale, divisor = _block_scale(absmax, n_bad, 127.0)
    q = tl.minimum(tl.maximum(_round_half_even(_div(total, divisor)), -127.0), 127.0)
    q = tl.where(n_bad > 0, 0.0, q)
    tl.store(payload_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(out_scales_ptr + blk, scale)


@triton.jit
def reduce_int4_kernel(payloads_ptr, scales_ptr, payload_ptr, out_scales_ptr, k,
                       payload_stride, scales_stride, numel, block_size,
                       HALF_LANES: tl.constexpr):
    """Sum of k senders' dequantized int4 blocks (sender 0 first), requantized to int4."""
    blk = tl.program_id(0)
    pair = tl.arange(0, HALF_LANES)
    first = blk.to(tl.int64) * block_size
    in_block = 2 * pair < block_size
    offs_even = first + 2 * pair
    mask_even = in_block & (offs_even < numel)
    mask_odd = in_block & (offs_even + 1 < numel)
    t_even = tl.zeros([HALF_LANES], dtype=tl.float32)
    t_odd = tl.zeros([HALF_LANES], dtype=tl.float32)
    for i in range(k):
        byte = tl.load(payloads_ptr + i * payload_stride + first // 2 + pair,
                       mask=mask_even, other=0x88).to(tl.int32)
        s = tl.load(scales_ptr + i * scales_stride + blk)
        v_even = ((byte & 15) - 8).to(tl.float32) * s
        v_odd = ((byte >> 4) - 8).to(tl.float32) * s
        t_even = tl.where(i == 0, v_even, t_even + v_even)
        t_odd = tl.where(i == 0, v_odd, t_odd + v_odd)
    # lanes past the end hold 0 * scale (NaN for a NaN block, like the reference's padding)
    t_even = tl.where(mask_even, t_even, 0.0)
    t_odd = tl.where(mask_odd, t_odd, 0.0)
    scale, packed = _quantize_int4_pairs(t_even, t_odd, mask_even, mask_odd)
    tl.store(payload_ptr + first // 2 + pair, packed.to(tl.uint8), mask=mask_even)
    tl.store(out_scales_ptr + blk, scale)
