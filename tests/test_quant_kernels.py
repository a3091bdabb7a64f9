"""Block-wise int8/int4 quantization kernels (accel_kernels.quant_*).

Every target is checked twice: against properties computed here from the input alone
(float64 block absmax, error bounds, the documented int4 byte layout), and against the
pure-torch reference, with which all targets are designed to agree bit for bit.

Error bound. With s the block's float32 scale (absmax/qmax), an element is rounded to
the nearest multiple of s, so |x - q*s| <= s/2 in exact arithmetic. Float32 adds the
rounding of x/s (relative 2**-24 of |x|/s, i.e. <= 2**-24 |x| after multiplying back),
of s itself (absmax/qmax, relative 2**-24, times |q| <= qmax) and of q*s (2**-24 |x|):
we allow s/2 + 4 * 2**-24 * (|x| + absmax). Inputs are normal floats; blocks whose
absmax is below ~1e-36 would get subnormal scales and are not claimed.

Triton kernels run through Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors,
which executes one program per block in Python: those tests use few, small blocks. They
are also compiled for CUDA sm_80 (no GPU needed to compile) to check the lowering.
"""
from __future__ import annotations

import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: no GPU here

import pytest
import torch

from zero_core.accel_kernels import quant_cpu, quant_hpu, quant_reference, quant_triton

QMAX = {8: 127, 4: 7}
F32_U = 2.0 ** -24


def _triton_or_skip():
    try:
        quant_triton.kernels()
    except ImportError as exc:
        print(f"SKIP triton quantization tests: triton cannot be imported ({exc})")
        pytest.skip(f"triton cannot be imported: {exc}")
    return quant_triton


@pytest.fixture(params=["reference", "cpu", "hpu", "triton"])
def impl(request):
    if request.param == "triton":
        return _triton_or_skip()
    return {"reference": quant_reference, "cpu": quant_cpu, "hpu": quant_hpu}[request.param]


def is_triton(mod) -> bool:
    return mod is quant_triton


def sizes_for(mod, big):
    """Element counts to test: interpreted Triton gets the small ones only."""
    return [1, 7, 129, 250] if is_triton(mod) else big


# ---------------------------------------------------------------- independent checks


def block_absmax64(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-element float64 absmax of its block, computed here independently."""
    flat = x.reshape(-1).double()
    n = flat.numel()
    padded = torch.zeros(-(-n // block_size) * block_size, dtype=torch.float64)
    padded[:n] = flat.abs()  # zero padding cannot raise a block's absmax
    return padded.view(-1, block_size).amax(dim=1).repeat_interleave(block_size)[:n]


def check_error_bound(x, deq, scales, bits, block_size):
    n = x.numel()
    absmax = block_absmax64(x, block_size)
    per_elem_scale = scales.double().repeat_interleave(block_size)[:n]
    # the scale is absmax / qmax rounded to float32
    want_scale = (absmax / QMAX[bits]).float().double()
    assert torch.equal(per_elem_scale, want_scale), "scale is not float32(absmax / qmax)"
    xd = x.reshape(-1).double()
    err = (deq.double() - xd).abs()
    bound = per_elem_scale / 2 + 4 * F32_U * (xd.abs() + absmax)
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert worst <= 1.0, f"error {worst:.3f}x the half-step bound"


def assert_same(a, b, what):
    """Bitwise equality that treats NaN == NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} " \
                                                      f"vs {b.dtype}{tuple(b.shape)}"
    if a.is_floating_point():
        assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN positions differ"
        a, b = a.nan_to_num(), b.nan_to_num()
    assert torch.equal(a, b), f"{what}: differs from the reference"


def fresh(n, gen, dtype=torch.float32):
    # magnitudes spread over several decades, so blocks have very different scales
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)
    return x.to(dtype)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_within_half_step(impl, bits, block_size, dtype):
    gen = torch.Generator().manual_seed(bits * 1000 + block_size)
    for n in sizes_for(impl, [1, 7, 1023, 4099, 70_001]):
        x = fresh(n, gen, dtype)
        payload, scales = impl.quantize(x, bits, block_size)
        want_bytes = n if bits == 8 else (n + 1) // 2
        assert payload.dtype == (torch.int8 if bits == 8 else torch.uint8)
        assert payload.numel() == want_bytes
        assert scales.dtype == torch.float32 and scales.numel() == -(-n // block_size)
        deq = impl.dequantize(payload, scales, bits, block_size, n)
        assert deq.dtype == torch.float32 and deq.shape == (n,)
        check_error_bound(x.float(), deq, scales, bits, block_size)
        # other output dtypes are the float32 values rounded once
        for out_dtype in (torch.bfloat16, torch.float16):
            got = impl.dequantize(payload, scales, bits, block_size, n, out_dtype)
            assert_same(got, deq.to(out_dtype), f"dequantize to {out_dtype}")


@pytest.mark.parametrize("bits", [8, 4])
def test_matches_reference_bitwise(impl, bits):
    gen = torch.Generator().manual_seed(11 + bits)
    block_size = 32 if is_triton(impl) else 128
    for n in sizes_for(impl, [1, 2, 127, 128, 129, 5000, 100_003]):
        x = fresh(n, gen)
        want = quant_reference.quantize(x, bits, block_size)
        got = impl.quantize(x, bits, block_size)
        assert_same(got[0], want[0], f"payload n={n}")
        assert_same(got[1], want[1], f"scales n={n}")
        assert_same(impl.dequantize(*want, bits, block_size, n),
                     quant_reference.dequantize(*want, bits, block_size, n), f"values n={n}")


@pytest.mark.parametrize("bits", [8, 4])
def test_strided_and_2d_inputs_are_read_as_flat(impl, bits):
    gen = torch.Generator().manual_seed(12)
    base = fresh(2 * 96, gen)
    for x in (base[::2], base.view(12, 16).t()):
        want = quant_reference.quantize(x.contiguous().view(-1), bits, 32)
        got = impl.quantize(x, bits, 32)
        assert_same(got[0], want[0], "payload of a non-contiguous input")
        assert_same(got[1], want[1], "scales of a non-contiguous input")


def test_int4_layout_is_the_documented_one(impl):
    """Values that are exact multiples of the scale must pack to known bytes."""
    gen = torch.Generator().manual_seed(5)
    block_size = 16
    for n in (15, 16, 33):
        q = torch.randint(-7, 8, (n,), generator=gen)
        q[::block_size] = 7  # every block's absmax is exactly 7 steps: scale is the step
        step = torch.rand(-(-n // block_size), generator=gen) + 0.5
        x = q.float() * step.repeat_interleave(block_size)[:n]
        payload, scales = impl.quantize(x, 4, block_size)
        nib = q + 8
        if n % 2:
            nib = torch.cat([nib, torch.tensor([8])])
        want = (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8)
        assert torch.equal(payload, want), "int4 bytes are not (q_even+8) | (q_odd+8) << 4"
        deq = impl.dequantize(payload, scales, 4, block_size, n)
        assert torch.allclose(deq, x, rtol=1e-6, atol=0)


def test_int8_payload_is_rounded_quotient(impl):
    gen = torch.Generator().manual_seed(9)
    n, block_size = 200, 50
    x = fresh(n, gen)
    payload, scales = impl.quantize(x, 8, block_size)
    s = scales.repeat_interleave(block_size)
    want = torch.round(x / s).clamp(-127, 127).to(torch.int8)  # round half to even
    assert torch.equal(payload, want)
    assert payload.abs().max() == 127


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_blocks_give_zero_scale_and_exact_zeros(impl, bits):
    gen = torch.Generator().manual_seed(1)
    block_size = 16
    x = fresh(5 * block_size + 3, gen)
    x[block_size:3 * block_size] = 0.0  # blocks 1 and 2
    x[-3:] = 0.0  # the partial last block
    payload, scales = impl.quantize(x, bits, block_size)
    assert scales[1] == 0 and scales[2] == 0 and scales[-1] == 0
    deq = impl.dequantize(payload, scales, bits, block_size, x.numel())
    assert not deq.isnan().any()
    assert torch.equal(deq[block_size:3 * block_size], torch.zeros(2 * block_size))
    assert torch.equal(deq[-3:], torch.zeros(3))
    check_error_bound(x, deq, scales, bits, block_size)


@pytest.mark.parametrize("bits", [8, 4])
def test_outlier_coarsens_only_its_block(impl, bits):
    gen = torch.Generator().manual_seed(2)
    block_size = 32
    x = torch.randn(4 * block_size, generator=gen)
    x[40] = 1e6  # block 1
    payload, scales = impl.quantize(x, bits, block_size)
    deq = impl.dequantize(payload, scales, bits, block_size, x.numel())
    check_error_bound(x, deq, scales, bits, block_size)
    assert deq[40] == pytest.approx(1e6, rel=1e-6)
    # blocks without the outlier keep their fine scale
    for b in (0, 2, 3):
        assert scales[b] < 10 / QMAX[bits]
    assert scales[1] == pytest.approx(1e6 / QMAX[bits], rel=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_poisons_exactly_its_block(impl, bits, bad):
    gen = torch.Generator().manual_seed(3)
    block_size = 16
    n = 4 * block_size + 5
    x = fresh(n, gen)
    x[block_size + 3] = bad   # block 1
    x[n - 2] = bad            # the partial last block
    payload, scales = impl.quantize(x, bits, block_size)
    assert scales[1].isnan() and scales[-1].isnan()
    assert torch.isfinite(scales[[0, 2, 3]]).all()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        deq = impl.dequantize(payload, scales, bits, block_size, n, dtype)
        assert deq[block_size:2 * block_size].isnan().all()
        assert deq[4 * block_size:].isnan().all()
        good = torch.cat([torch.arange(0, block_size), torch.arange(2 * block_size,
                                                                    4 * block_size)])
        assert torch.isfinite(deq[good]).all()
    deq = impl.dequantize(payload, scales, bits, block_size, n)
    check_error_bound(x[:block_size], deq[:block_size], scales[:1], bits, block_size)


# ---------------------------------------------------------------- fused kernel


def composed_reference(payloads, scales, bits, block_size, numel):
    """Dequantize each sender, add in sender order in float32, quantize: the definition
    of the fused kernel written from the reference's public functions."""
    total = None
    for p, s in zip(payloads, scales):
        v = quant_reference.dequantize(p, s, bits, block_size, numel)
        total = v if total is None else total + v
    return quant_reference.quantize(total, bits, block_size), total


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_fused_equals_composition_of_reference_ops(impl, bits, k):
    gen = torch.Generator().manual_seed(100 + bits * 10 + k)
    block_size = 32 if is_triton(impl) else 256
    for n in sizes_for(impl, [1, 7, 1023, 4099, 70_001]):
        senders = [quant_reference.quantize(fresh(n, gen), bits, block_size)
                   for _ in range(k)]
        payloads, scales = [p for p, _ in senders], [s for _, s in senders]
        (want_p, want_s), total = composed_reference(payloads, scales, bits, block_size, n)
        got_p, got_s = impl.dequantize_reduce_requantize(payloads, scales, bits,
                                                         block_size, n)
        assert_same(got_p, want_p, f"fused payload n={n} k={k}")
        assert_same(got_s, want_s, f"fused scales n={n} k={k}")
        # and the result is within half a new step of the exact sum of what was sent
        exact = torch.zeros(n, dtype=torch.float64)
        for p, s in senders:
            exact += quant_reference.dequantize(p, s, bits, block_size, n).double()
        deq = impl.dequantize(got_p, got_s, bits, block_size, n)
        check_error_bound(total, deq, got_s, bits, block_size)
        assert (deq.double() - exact).abs().max() <= got_s.max() / 2 * (1 + 1e-5) + \
            1e-6 * exact.abs().max()


def test_fused_accepts_stacked_tensors_and_propagates_nan(impl):
    gen = torch.Generator().manual_seed(4)
    bits, block_size, n = 4, 16, 40
    xs = [fresh(n, gen) for _ in range(3)]
    xs[2][20] = float("nan")  # block 1 of sender 2
    senders = [quant_reference.quantize(x, bits, block_size) for x in xs]
    p2 = torch.stack([p for p, _ in senders])
    s2 = torch.stack([s for _, s in senders])
    payload, scales = impl.dequantize_reduce_requantize(p2, s2, bits, block_size)
    assert scales[1].isnan() and torch.isfinite(scales[[0, 2]]).all()
    deq = impl.dequantize(payload, scales, bits, block_size, n)
    assert deq[16:32].isnan().all() and torch.isfinite(deq[:16]).all()


def test_fused_overflow_to_inf_becomes_nan_block(impl):
    big = torch.full((8,), 3e38)
    senders = [quant_reference.quantize(big, 8, 8) for _ in range(2)]
    payload, scales = impl.dequantize_reduce_requantize(
        [p for p, _ in senders], [s for _, s in senders], 8, 8)
    assert scales.isnan().all()
    assert impl.dequantize(payload, scales, 8, 8, 8).isnan().all()


# ---------------------------------------------------------------- out= and errors


@pytest.mark.parametrize("bits", [8, 4])
def test_out_buffers_receive_the_result(impl, bits):
    gen = torch.Generator().manual_seed(6)
    n, block_size = 301, 64
    x = fresh(n, gen)
    want = quant_reference.quantize(x, bits, block_size)
    out = (torch.empty_like(want[0]), torch.empty_like(want[1]))
    res = impl.quantize(x, bits, block_size, out=out)
    assert_same(out[0], want[0], "out payload")
    assert_same(out[1], want[1], "out scales")
    assert res[0].data_ptr() == out[0].data_ptr()
    deq_out = torch.empty(n, dtype=torch.bfloat16)
    impl.dequantize(*want, bits, block_size, n, torch.bfloat16, out=deq_out)
    assert_same(deq_out, quant_reference.dequantize(*want, bits, block_size, n,
                                                    torch.bfloat16), "out values")
    fused_out = (torch.empty_like(want[0]), torch.empty_like(want[1]))
    impl.dequantize_reduce_requantize([want[0]] * 2, [want[1]] * 2, bits, block_size, n,
                                      out=fused_out)
    ref = quant_reference.dequantize_reduce_requantize([want[0]] * 2, [want[1]] * 2, bits,
                                                       block_size, n)
    assert_same(fused_out[0], ref[0], "fused out payload")


def test_bad_arguments_are_refused_with_a_reason(impl):
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        impl.quantize(x, 3, 4)
    with pytest.raises(ValueError, match="block_size=0 must be a positive int"):
        impl.quantize(x, 8, 0)
    with pytest.raises(ValueError, match="block_size=5 is odd"):
        impl.quantize(x, 4, 5)
    with pytest.raises(TypeError, match="quantize got dtype torch.int32"):
        impl.quantize(torch.ones(4, dtype=torch.int32), 8, 4)
    p, s = quant_reference.quantize(x, 4, 4)
    with pytest.raises(ValueError, match="payload has 5 bytes but 11 elements"):
        impl.dequantize(p, s, 4, 4, 11)
    with pytest.raises(TypeError, match="payload has dtype torch.uint8; 8-bit"):
        impl.dequantize(p, s, 8, 4, 5)
    with pytest.raises(ValueError, match="scales of payload must be 2 float32 values"):
        impl.dequantize(p, s, 4, 8, 10)
    with pytest.raises(TypeError, match="dequantize dtype"):
        impl.dequantize(p, s, 4, 4, 10, torch.int8)
    with pytest.raises(ValueError, match="same size"):
        impl.dequantize_reduce_requantize([p, p[:3]], [s, s], 4, 4)
    with pytest.raises(ValueError, match="out must be a tensor of 10 elements"):
        impl.dequantize(p, s, 4, 4, 10, out=torch.empty(9))


# ---------------------------------------------------------------- CPU path internals


def test_cpu_many_chunks_and_big_endian_fallback(monkeypatch):
    """Small chunks exercise the chunk loop and tail; the float-arithmetic int4 path used
    on big-endian hosts must give the same bytes as the int16 bit path."""
    gen = torch.Generator().manual_seed(8)
    monkeypatch.setattr(quant_cpu, "CHUNK_ELEMENTS", 96)
    for little in (True, False):
        monkeypatch.setattr(quant_cpu, "_LITTLE_ENDIAN", little)
        for bits in (8, 4):
            for n in (1, 95, 1000, 4097):
                x = fresh(n, gen)
                want = quant_reference.quantize(x, bits, 32)
                got = quant_cpu.quantize(x, bits, 32)
                assert_same(got[0], want[0], f"payload little={little} n={n}")
                assert_same(got[1], want[1], f"scales little={little} n={n}")
                assert_same(quant_cpu.dequantize(*want, bits, 32, n),
                            quant_reference.dequantize(*want, bits, 32, n), "values")
                fused = quant_cpu.dequantize_reduce_requantize([want[0]] * 3,
                                                               [want[1]] * 3, bits, 32, n)
                ref = quant_reference.dequantize_reduce_requantize([want[0]] * 3,
                                                                   [want[1]] * 3, bits, 32, n)
                assert_same(fused[0], ref[0], "fused payload")


def test_cpu_refuses_other_devices():
    with pytest.raises(ValueError, match="quant_cpu kernels run on CPU tensors"):
        quant_cpu.quantize(torch.zeros(4, device="meta"), 8, 4)


@pytest.fixture(autouse=True)
def _quiet_interpreter():
    # Triton's interpreter runs kernels through numpy, which warns about the NaN/inf
    # inputs the edge-case tests feed on purpose
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


# ---------------------------------------------------------------- Triton: CUDA lowering


CUDA_SIGNATURES = {  # kernel -> (argument types, constexprs) of one representative launch
    "quantize_int8_kernel": ("*fp32 *i8 *fp32 i32 i32", {"LANES": 256}),
    "quantize_int4_kernel": ("*bf16 *u8 *fp32 i32 i32", {"HALF_LANES": 128}),
    "dequantize_int8_kernel": ("*i8 *fp32 *bf16 i32 i32", {"LANES": 256}),
    "dequantize_int4_kernel": ("*u8 *fp32 *fp16 i32 i32", {"HALF_LANES": 128}),
    "reduce_int8_kernel": ("*i8 *fp32 *i8 *fp32 i32 i32 i32 i32 i32", {"LANES": 256}),
    "reduce_int4_kernel": ("*u8 *fp32 *u8 *fp32 i32 i32 i32 i32 i32", {"HALF_LANES": 128}),
}


_COMPILE_FOR_CUDA = r"""
import inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zero_core.accel_kernels import quant_triton_kernels as kernels
name, types, constexprs = sys.argv[1], sys.argv[2].split(), json.loads(sys.argv[3])
fn = getattr(kernels, name)
signature = dict(zip(inspect.signature(fn.fn).parameters, types))
signature.update({k: "constexpr" for k in constexprs})
compiled = triton.compile(ASTSource(fn, signature, constexprs),
                          target=GPUTarget("cuda", 80, 32), options={"enable_fp_fusion": False})
ptx = compiled.asm["ptx"]
print(json.dumps({"divisions": sorted(set(re.findall(r"\bdiv\.[a-z]+\.f32", ptx))),
                  "fma": len(re.findall(r"\bfma\.", ptx))}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CUDA_SIGNATURES))
def test_triton_kernel_compiles_for_cuda_with_ieee_division(name):
    """No GPU here, but Triton can still compile for one (sm_80): this catches lowering
    errors the interpreter cannot, and checks that the PTX divides with IEEE rounding
    (div.rn; Triton's plain ``/`` gives the approximate div.full) and has no FMA
    contraction, which the bit-for-bit agreement with the reference relies on. Runs in a
    subprocess because this process has TRITON_INTERPRET=1."""
    import json
    import subprocess
    import sys

    _triton_or_skip()
    types, constexprs = CUDA_SIGNATURES[name]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_CUDA, name, types,
                           json.dumps(constexprs)], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode and ("ptxas" in proc.stderr or "CUDA" in proc.stderr):
        print(f"SKIP CUDA lowering of {name}: {proc.stderr.strip().splitlines()[-1]}")
        pytest.skip("this triton cannot compile for CUDA here")
    assert proc.returncode == 0, f"compiling {name} for CUDA failed:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["divisions"]) <= {"div.rn.f32"}, f"non-IEEE division: {result}"
    assert result["fma"] == 0, f"FMA contraction in PTX: {result}"
