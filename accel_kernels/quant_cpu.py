"""Block-wise int8/int4 quantization on the CPU: compiled C when built, else torch.

Same functions, format and edge cases as :mod:`.quant_reference` (see
:mod:`.quant_layout`), and bit-identical results: each value is the integer that
round-half-even gives for the correctly rounded quotient of value and block scale, and the
k senders are summed sender 0 first. (The torch path divides; the native AVX-512 kernels
multiply by the reciprocal and redo by exact division the lanes that land near a tie,
which gives the same integers — the bound is in quant_native.c.)

Two paths, chosen once at import (:func:`backend_info` says which; ``zero-core report``
prints it):

* **native** — the C library built ahead of time when zero-core is installed
  (accel_kernels/quant_native.c, loaded by :mod:`.quant_native` with ctypes). One pass
  per block, in cache, vectorized; each call does a range of blocks single-threaded
  and the chunks run on the worker threads below (ctypes releases the GIL).
* **torch** — the ``*_torch`` functions of this module, used where the library was not
  built (no C compiler at install time), is stale, is disabled with
  ``ZERO_CORE_QUANT_NATIVE=0``, or on big-endian hosts. Kept public so that the
  benchmark can show both paths.

Why the torch path is as fast as it is (measured on this project's 2-core VM with
ci/bench/kernels.py; the figures are in docs/benchmarks.md, "Kernels"):

* Large temporaries are what make the reference slow: every fresh multi-MB tensor is
  page-faulted in by the kernel one page at a time, which costs more than the arithmetic
  (an ``abs`` into a new tensor took many times as long as into an existing one).
  Here the work is done in chunks of whole blocks through small per-thread scratch
  buffers that are allocated once and stay in cache; only the outputs are new memory,
  and callers that reuse communication buffers pass ``out=`` to avoid even that.
* Chunks are spread over single-threaded worker threads (see ``_workers``), so the
  threads meet once per call instead of at the end of every torch op.
* ``amax`` and ``amin`` over rows are two fast vectorized reductions, where
  ``abs().amax()`` needs a temporary and ``aminmax`` takes a slow path.
* int4 packing/unpacking treats each pair of int8 lanes as one int16 and moves nibbles
  with contiguous, vectorized bit operations: faster on a cached chunk than float
  arithmetic through stride-2 views (for packing, and more so for unpacking).
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from . import quant_native
from .quant_layout import (INT4_OFFSET, QMAX, check_dequant_out, check_input,
                           check_output_dtype, check_payload, check_quant_out, new_quant_out,
                           num_blocks, payload_numel, stack_senders)

#: elements per chunk (rounded down to whole blocks). An fp32 chunk and its quotient
#: (2 x 16 MB at 4M elements) about fill a server CPU's L3. Each torch op is a parallel
#: region whose threads must all be scheduled, so on a CPU shared with other processes
#: fewer, larger ops win: int8 quantize (out=) of a large tensor with 2 threads on a loaded
#: machine was fastest with 4M-element chunks, ahead of 1M and 8M, and 64K chunks were far
#: slower still (docs/benchmarks.md, "Kernels").
CHUNK_ELEMENTS = 1 << 22

_local = threading.local()


def _scratch(slot: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A per-thread buffer of at least *numel* elements, reused across calls."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get((slot, dtype))
    if buf is None or buf.numel() < numel:
        buf = bufs[(slot, dtype)] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


# The int4 (un)packing works on pairs of int8 lanes seen as one int16, whose low byte is
# the even element on a little-endian CPU; big-endian hosts take the float-arithmetic path.
_LITTLE_ENDIAN = sys.byteorder == "little"
_BOTH_OFFSETS = 16 * INT4_OFFSET + INT4_OFFSET  # a byte holding two zeros (0x88)


def _pack_int4(q: torch.Tensor, payload: torch.Tensor) -> None:
    """Pack rounded float values in [-7, 7] (even count) two per byte into *payload*."""
    half = q.numel() // 2
    if not _LITTLE_ENDIAN:
        pairs = q.view(-1, 2)
        packed = _scratch(2, half)
        torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=packed).add_(_BOTH_OFFSETS)
        payload.copy_(packed)
        return
    lanes = _scratch(4, q.numel(), torch.int8)
    lanes.copy_(q.view(-1))
    both = lanes.view(torch.int16)  # bits 0-7: element 2i, bits 8-15: element 2i+1
    packed = _scratch(5, half, torch.int16)
    torch.bitwise_right_shift(both, 4, out=packed).bitwise_and_(0xF0)  # 2i+1 -> bits 4-7
    low = _scratch(6, half, torch.int16)
    packed.bitwise_or_(torch.bitwise_and(both, 0x0F, out=low))
    packed.bitwise_xor_(_BOTH_OFFSETS)  # two's-complement nibble + 8 (mod 16) = q + 8
    payload.copy_(packed)


def _unpack_int4(payload: torch.Tensor, dst: torch.Tensor) -> None:
    """Unpack bytes into float values q (2 per byte) in the flat float32 *dst*."""
    half = payload.numel()
    if not _LITTLE_ENDIAN:
        byte = _scratch(2, half)
        byte.copy_(payload)
        pairs = dst.view(-1, 2)
        hi = pairs[:, 1]
        torch.mul(byte, 1.0 / 16, out=hi).floor_()  # exact: byte < 256, power-of-two
        torch.add(byte, hi, alpha=-16, out=pairs[:, 0])
    else:
        both = _scratch(5, half, torch.int16)
        both.copy_(payload)
        high = _scratch(6, half, torch.int16)
        torch.bitwise_and(both, 0xF0, out=high).bitwise_left_shift_(4)  # -> bits 8-11
        both.bitwise_and_(0x0F).bitwise_or_(high)
        dst.copy_(both.view(torch.uint8))
    dst.sub_(INT4_OFFSET)


def _require_cpu(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"quant_cpu kernels run on CPU tensors, got one on {t.device}; use "
                         "the quantization kernels of that device (quant_triton, quant_hpu)")


_pool_lock = threading.Lock()
_pool_state: dict = {}


def _workers():
    """A thread pool whose threads run torch ops single-threaded, or None for 1 thread.

    Why: every torch op is an OpenMP parallel region that ends when *all* its threads
    are done. On a CPU shared with other processes one of them is often descheduled, and
    each small op then waits a scheduler time slice: measured on this 2-core VM under load,
    an int4 unpack step took more than an order of magnitude longer per op with 2 threads
    than with 1, and so did a whole int4 dequantize (docs/benchmarks.md, "Kernels"). So the chunks are
    spread over torch.get_num_threads() Python threads (torch ops release the GIL), each
    running its ops with one intra-op thread: they only meet once per call.
    """
    n = torch.get_num_threads()
    if n <= 1:
        return None
    with _pool_lock:
        pool = _pool_state.get(n)
        if pool is None:
            # the initializer's torch.set_num_threads(1) makes each worker single-threaded
            # (ATen keeps it per thread) but also resets the process-wide default: create
            # every worker now, then restore the default for everyone else
            pool = ThreadPoolExecutor(n, thread_name_prefix="zero-core-quant",
                                      initializer=torch.set_num_threads, initargs=(1,))
            barrier = threading.Barrier(n)
            list(pool.map(lambda _: barrier.wait(), range(n)))
            torch.set_num_threads(n)
            _pool_state[n] = pool
    return pool


def _run_chunks(work, n_rows: int, block_size: int, chunk_elements: int | None = None,
                min_chunk_elements: int = 0) -> None:
    """Call ``work(b0, b1)`` over row ranges covering ``0..n_rows`` in parallel chunks of
    at most *chunk_elements* (default :data:`CHUNK_ELEMENTS`) and, unless the whole job is
    smaller, at least *min_chunk_elements*."""
    pool = _workers()
    lanes = 1 if pool is None else torch.get_num_threads()
    chunk = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    step = max(1, min(chunk // block_size, -(-n_rows // lanes)),
               min_chunk_elements // block_size)
    ranges = [(b0, min(n_rows, b0 + step)) for b0 in range(0, n_rows, step)]
    if pool is None or len(ranges) == 1:
        for b0, b1 in ranges:
            work(b0, b1)
    else:
        list(pool.map(lambda r: work(*r), ranges))  # list(): re-raises a worker's error


# ------------------------------------------------------------------ quantize core


def _quantize_rows(xb: torch.Tensor, bits: int, payload: torch.Tensor,
                   scales: torch.Tensor) -> None:
    """Quantize float32 rows *xb* (r, block_size) into payload bytes and r scales."""
    qmax = QMAX[bits]
    r, bs = xb.shape
    # NaN propagates; abs_(): the maximum of 0.0 and -0.0 may be -0.0, and a zero block's
    # scale must be +0.0 as in the reference (abs().amax())
    absmax = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_()).abs_()
    torch.div(absmax, qmax, out=scales)
    # divide by 1 where the scale is 0 (zero block) or not finite (fixed up below)
    safe = torch.where(torch.isfinite(scales) & (scales > 0), scales,
                       torch.ones_like(scales))
    q = _scratch(1, r * bs).view(r, bs)
    torch.div(xb, safe[:, None], out=q)
    # |x| <= absmax keeps |x/scale| near qmax, but not always below qmax + 0.5: a subnormal
    # absmax loses bits in absmax/qmax, and x/scale can round to 128 (seen: -128 vs the
    # reference's -127); clamp as the reference does
    q.round_().clamp_(-qmax, qmax)
    if bits == 8:
        payload.copy_(q.view(-1))
    else:
        _pack_int4(q.view(-1), payload)
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):  # rare: a NaN/inf block gets scale NaN and a zero payload
        scales.masked_fill_(bad, float("nan"))
        zero = 0 if bits == 8 else _BOTH_OFFSETS
        payload.view(r, -1).masked_fill_(bad[:, None], zero)


def _quantize_chunks(read, numel: int, bits: int, block_size: int, payload: torch.Tensor,
                     scales: torch.Tensor) -> None:
    """Quantize *numel* values chunk by chunk; ``read(b0, b1, full)`` returns blocks
    b0..b1 as float32 rows (r, block_size) in scratch, a partial last block zero padded."""
    nb_full = numel // block_size
    per_byte = 1 if bits == 8 else 2

    def work(b0: int, b1: int) -> None:
        rows = read(b0, b1, full=True)
        _quantize_rows(rows, bits, payload[b0 * block_size // per_byte:
                                           b1 * block_size // per_byte], scales[b0:b1])
    _run_chunks(work, nb_full, block_size)
    tail = numel - nb_full * block_size
    if tail:  # the partial last block, zero padded so that it does not change its absmax
        rows = read(nb_full, nb_full + 1, full=False)
        tmp = torch.empty(block_size // per_byte, dtype=payload.dtype)
        _quantize_rows(rows, bits, tmp, scales[nb_full:])
        payload[nb_full * block_size // per_byte:].copy_(tmp[:payload_numel(tail, bits)])


class _RowReader:
    """Rows of a flat float tensor as float32: a view of fp32 input (no copy), else a
    converted copy in scratch; the partial last block is copied and zero padded."""

    def __init__(self, flat: torch.Tensor, block_size: int):
        self.flat, self.bs = flat, block_size

    def __call__(self, b0: int, b1: int, full: bool) -> torch.Tensor:
        bs = self.bs
        src = self.flat[b0 * bs: b1 * bs]
        if full and src.dtype == torch.float32:
            return src.view(b1 - b0, bs)
        buf = _scratch(0, (b1 - b0) * bs)
        if not full:
            buf.zero_()
        buf[:src.numel()].copy_(src)
        return buf.view(b1 - b0, bs)


# The checks and output buffers of each kernel, shared by its torch and native paths.
def _quantize_io(x: torch.Tensor, bits: int, block_size: int, out):
    """(flat input, payload, scales) for quantizing *x* into *out* or new tensors."""
    check_input(x, bits, block_size)
    _require_cpu(x)
    flat = x.reshape(-1).contiguous()  # a strided 1-D input stays strided otherwise
    out = check_quant_out(out, flat.numel(), bits, block_size, x.device)
    payload, scales = out if out is not None else new_quant_out(flat.numel(), bits,
                                                               block_size, x.device)
    return flat, payload, scales


def _dequantize_io(payload: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                   numel: int, dtype: torch.dtype, out) -> torch.Tensor:
    """The flat output tensor (a view of *out*, or new) after checking the arguments."""
    check_payload(payload, scales, bits, block_size, numel)
    check_output_dtype(dtype)
    _require_cpu(payload)
    flat_out = check_dequant_out(out, numel, dtype, payload.device)
    return flat_out if flat_out is not None else torch.empty(numel, dtype=dtype)


def _reduce_io(payloads, scales, bits: int, block_size: int, numel: int | None, out):
    """(stacked payloads, stacked scales, numel, out payload, out scales) for the fused op."""
    p2, s2, numel = stack_senders(payloads, scales, bits, block_size, numel)
    _require_cpu(p2)
    out = check_quant_out(out, numel, bits, block_size, p2.device)
    payload, out_scales = out if out is not None else new_quant_out(numel, bits, block_size,
                                                                    p2.device)
    return p2, s2, numel, payload, out_scales


def quantize_torch(x: torch.Tensor, bits: int, block_size: int, *, out=None):
    """:func:`quantize` on the torch path (whether or not the native library is loaded).

    Returns ``(payload, scales)`` exactly as :func:`.quant_reference.quantize` does;
    *out*, an optional preallocated ``(payload, scales)`` pair, receives the result.
    """
    flat, payload, scales = _quantize_io(x, bits, block_size, out)
    _quantize_chunks(_RowReader(flat, block_size), flat.numel(), bits, block_size, payload,
                     scales)
    return payload, scales


# ------------------------------------------------------------------ dequantize core


def _dequantize_rows(payload: torch.Tensor, scales: torch.Tensor, bits: int,
                     block_size: int, dst: torch.Tensor) -> None:
    """Write q * scale for r rows into float32 *dst* (r, block_size); payload holds the
    rows' bytes, padded to whole rows."""
    if bits == 8:
        dst.view(-1).copy_(payload)
    else:
        _unpack_int4(payload, dst.view(-1))
    dst.mul_(scales[:, None])


def _payload_rows(payload: torch.Tensor, b0: int, b1: int, block_size: int, bits: int,
                  numel: int) -> torch.Tensor:
    """Bytes of rows b0..b1, the partial last row padded with zero values."""
    per_byte = 1 if bits == 8 else 2
    want = (b1 - b0) * block_size // per_byte
    part = payload[b0 * block_size // per_byte: b1 * block_size // per_byte]
    # an odd int4 size: the last byte's high nibble is padding, whatever the sender put there
    odd_tail = bits == 4 and numel % 2 and b1 * block_size >= numel
    if part.numel() == want and not odd_tail:
        return part
    padded = torch.full((want,), 0 if bits == 8 else _BOTH_OFFSETS,
                        dtype=payload.dtype)
    padded[:part.numel()] = part
    if odd_tail:
        last = padded[part.numel() - 1: part.numel()]
        last.bitwise_and_(0x0F).bitwise_or_(INT4_OFFSET << 4)
    return padded


def dequantize_torch(payload: torch.Tensor, scales: torch.Tensor, bits: int,
                     block_size: int, numel: int, dtype: torch.dtype = torch.float32, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dequantize` on the torch path (whether or not the native library is loaded).

    Bit-identical to :func:`.quant_reference.dequantize`; *out* is an optional
    preallocated flat tensor of *numel* elements of *dtype*.
    """
    flat_out = _dequantize_io(payload, scales, bits, block_size, numel, dtype, out)
    payload, scales = payload.reshape(-1), scales.reshape(-1)

    def work(b0: int, b1: int) -> None:
        dst = _scratch(0, (b1 - b0) * block_size).view(b1 - b0, block_size)
        _dequantize_rows(_payload_rows(payload, b0, b1, block_size, bits, numel),
                         scales[b0:b1], bits, block_size, dst)
        piece = flat_out[b0 * block_size: min(numel, b1 * block_size)]
        piece.copy_(dst.view(-1)[:piece.numel()])
    _run_chunks(work, num_blocks(numel, block_size), block_size)
    return flat_out if out is None else out


def dequantize_reduce_requantize_torch(payloads, scales, bits: int, block_size: int,
                                       numel: int | None = None, *, out=None):
    """:func:`dequantize_reduce_requantize` on the torch path.

    Bit-identical to :func:`.quant_reference.dequantize_reduce_requantize`; the sum for a
    chunk of blocks is built in a cached scratch buffer and quantized while still in cache.
    """
    p2, s2, numel, payload, out_scales = _reduce_io(payloads, scales, bits, block_size,
                                                    numel, out)
    _quantize_chunks(_SumReader(p2, s2, bits, block_size, numel), numel, bits, block_size,
                     payload, out_scales)
    return payload, out_scales


class _SumReader:
    """Rows of the senders' dequantized sum, built chunk by chunk in scratch."""

    def __init__(self, p2, s2, bits, block_size, numel):
        self.p2, self.s2, self.bits, self.bs, self.numel = p2, s2, bits, block_size, numel
        # each sender's padded row bytes are rebuilt per chunk; only the last chunk pads

    def __call__(self, b0: int, b1: int, full: bool) -> torch.Tensor:
        r = b1 - b0
        acc = _scratch(0, r * self.bs).view(r, self.bs)
        part = _scratch(3, r * self.bs).view(r, self.bs)
        for i in range(self.p2.shape[0]):
            rows = _payload_rows(self.p2[i], b0, b1, self.bs, self.bits, self.numel)
            _dequantize_rows(rows, self.s2[i, b0:b1], self.bits, self.bs,
                             acc if i == 0 else part)
            if i:
                acc.add_(part)
        return acc


# ------------------------------------------------------------------ the public functions

#: native path: elements per chunk of blocks handed to one C call. Smaller than the torch
#: path's (a C call has no per-op cost to amortize), so that on a CPU shared with other
#: processes the worker that is running takes over the chunks of one that is not
#: (on a loaded machine, chunks of 1M to 32M elements were within noise of each other and
#: 256K-element chunks slower; docs/benchmarks.md, "Kernels").
NATIVE_CHUNK_ELEMENTS = 1 << 20
#: native path: below this many elements a call runs on the caller's thread (handing
#: work to the pool costs more than it saves)
NATIVE_MIN_PARALLEL_ELEMENTS = 1 << 18


def native_in_use() -> bool:
    """True when the public functions run the compiled C library (see :func:`backend_info`)."""
    # _LITTLE_ENDIAN is checked again so that tests can force the big-endian torch path
    return quant_native.available() and _LITTLE_ENDIAN


def backend_info() -> dict:
    """What the kernel set reports about this module: the path in use and, for the torch
    path, why the native library is not used."""
    if native_in_use():
        return {"quantize_path": f"native C library, {quant_native.describe()}"}
    return {"quantize_path": "torch (pure-torch CPU path)",
            "quantize_native_missing": quant_native.REASON or "big-endian host"}


def _run_native(work, numel: int, block_size: int) -> None:
    _run_chunks(work, num_blocks(numel, block_size), block_size, NATIVE_CHUNK_ELEMENTS,
                NATIVE_MIN_PARALLEL_ELEMENTS)


def quantize(x: torch.Tensor, bits: int, block_size: int, *, out=None):
    """Quantize *x* (any shape, fp32/fp16/bf16 CPU tensor, read as flat) block-wise.

    Returns ``(payload, scales)`` exactly as :func:`.quant_reference.quantize` does;
    *out*, an optional preallocated ``(payload, scales)`` pair, receives the result.
    """
    if not native_in_use():
        return quantize_torch(x, bits, block_size, out=out)
    flat, payload, scales = _quantize_io(x, bits, block_size, out)
    _run_native(lambda b0, b1: quant_native.quantize_blocks(flat, bits, block_size, b0, b1,
                                                            payload, scales),
                flat.numel(), block_size)
    return payload, scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
               numel: int, dtype: torch.dtype = torch.float32, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild *numel* values of *dtype* (flat) from ``quantize``'s output, on the CPU.

    Bit-identical to :func:`.quant_reference.dequantize`; *out* is an optional
    preallocated flat tensor of *numel* elements of *dtype*.
    """
    if not native_in_use():
        return dequantize_torch(payload, scales, bits, block_size, numel, dtype, out=out)
    flat_out = _dequantize_io(payload, scales, bits, block_size, numel, dtype, out)
    payload, scales = payload.reshape(-1).contiguous(), scales.reshape(-1).contiguous()
    _run_native(lambda b0, b1: quant_native.dequantize_blocks(payload, scales, bits,
                                                              block_size, numel, b0, b1,
                                                              flat_out),
                numel, block_size)
    return flat_out if out is None else out


def dequantize_reduce_requantize(payloads, scales, bits: int, block_size: int,
                                 numel: int | None = None, *, out=None):
    """qgZ's middle hop on the CPU: sum of the k senders' dequantized values, requantized.

    Bit-identical to :func:`.quant_reference.dequantize_reduce_requantize` (float32 sum,
    sender 0 first); *out* as in :func:`quantize`.
    """
    if not native_in_use():
        return dequantize_reduce_requantize_torch(payloads, scales, bits, block_size, numel,
                                                  out=out)
    p2, s2, numel, payload, out_scales = _reduce_io(payloads, scales, bits, block_size,
                                                    numel, out)
    _run_native(lambda b0, b1: quant_native.reduce_blocks(p2, s2, bits, block_size, numel,
                                                          b0, b1, payload, out_scales),
                numel, block_size)
    return payload, out_scales
