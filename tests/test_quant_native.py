"""The compiled CPU quantization kernels (quant_native.c through quant_cpu) against the
pure-torch reference, bit for bit, on fresh random inputs.

Every instruction-set level the machine runs (AVX-512, AVX2, baseline; see
quant_native.c) is checked, and quant_cpu's torch path with the same inputs. Inputs mix,
block by block: Gaussian values of random magnitude, zero blocks, blocks with one
outlier, blocks holding NaN / +-inf, blocks whose values are exact rounding ties
(round-half-even), blocks so small that the scale underflows, for sizes that are not a
multiple of the block. Seeds come from os.urandom and are printed in every failure.

ZERO_CORE_REQUIRE_NATIVE=1 (set by ci/test.sh) turns a missing library into a failure,
so that CI proves the built library is what runs; without it a missing library is
reported as a warning with the loader's reason.
"""
from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch

from zero_core.accel_kernels import quant_cpu, quant_native, quant_reference

QMAX = {8: 127, 4: 7}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16, torch.int8: torch.int8, torch.uint8: torch.uint8}


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(fresh_seed())  # gen.initial_seed() tells it


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str, gen) -> None:
    """Equal dtype, shape and bits; NaNs must be at the same places (any NaN encoding:
    torch's own fp16/bf16 conversions do not agree on one)."""
    where = f"{what} (seed {gen.initial_seed()})"
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{where}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    if got.is_floating_point():
        nan_got, nan_want = got.isnan(), want.isnan()
        assert torch.equal(nan_got, nan_want), f"{where}: NaN positions differ"
        got, want = got[~nan_got], want[~nan_want]
    diff = (got.view(INT_VIEW[got.dtype]) != want.view(INT_VIEW[want.dtype])).nonzero()
    assert diff.numel() == 0, (f"{where}: {diff.numel()} elements differ, first at "
                               f"{diff[0].item()}: {got[diff[0]].item()!r} vs "
                               f"{want[diff[0]].item()!r}")


def mixed_input(n: int, block_size: int, gen, dtype=torch.float32) -> torch.Tensor:
    """n values whose blocks are of randomly chosen kinds (see the module docstring)."""
    nb = -(-n // block_size)
    x = torch.randn(nb, block_size, generator=gen)
    kind = torch.randint(0, 8, (nb,), generator=gen)
    # magnitudes from 1e-6 to 1e6 (fp16 overflows at the top: those blocks become inf)
    x *= 10.0 ** (torch.rand(nb, 1, generator=gen) * 12 - 6)
    x[kind == 1] = 0.0
    rows = torch.arange(nb)
    col = torch.randint(0, block_size, (nb,), generator=gen)
    outlier = kind == 2
    x[rows[outlier], col[outlier]] *= 1e4
    specials = torch.tensor([float("nan"), float("inf"), float("-inf")])
    bad = kind == 3
    x[rows[bad], col[bad]] = specials[torch.randint(0, 3, (int(bad.sum()),), generator=gen)]
    # exact ties: absmax 127 * 2^e (int8: scale exactly 2^e) and values (k + 1/2) * 2^e
    tie = (kind == 4).nonzero().flatten()
    for r in tie.tolist():
        e = int(torch.randint(-20, 20, (1,), generator=gen))
        k = torch.randint(-127, 127, (block_size,), generator=gen).float()
        x[r] = (k + 0.5) * 2.0 ** e
        x[r, 0] = 127 * 2.0 ** e
    # int4 ties: absmax 7 * 2^e
    tie4 = (kind == 5).nonzero().flatten()
    for r in tie4.tolist():
        e = int(torch.randint(-20, 20, (1,), generator=gen))
        k = torch.randint(-7, 7, (block_size,), generator=gen).float()
        x[r] = (k + 0.5) * 2.0 ** e
        x[r, -1] = -7 * 2.0 ** e
    # tiny: absmax / qmax is subnormal or underflows to 0
    tiny = kind == 6
    x[tiny] = torch.randn(int(tiny.sum()), block_size, generator=gen) * 1e-40
    return x.reshape(-1)[:n].to(dtype)


def random_payload(n: int, bits: int, block_size: int, gen):
    """Arbitrary bytes (int8 -128 and int4 nibble 0, i.e. -8, included) and scales that
    include zero, NaN and inf: dequantize must still agree with the reference."""
    if bits == 8:
        payload = torch.randint(-128, 128, (n,), dtype=torch.int8, generator=gen)
    else:
        payload = torch.randint(0, 256, (-(-n // 2),), dtype=torch.uint8, generator=gen)
    nb = -(-n // block_size)
    scales = torch.rand(nb, generator=gen) * 10.0 ** float(torch.randint(-30, 30, (1,),
                                                                        generator=gen))
    pick = torch.randint(0, 10, (nb,), generator=gen)
    scales[pick == 0] = 0.0
    scales[pick == 1] = float("nan")
    scales[pick == 2] = float("inf")
    return payload, scales


def sizes(block_size: int, gen) -> list[int]:
    """Sizes around the block: single elements, partial blocks, odd and even tails, and
    one random size up to 300K elements (several chunks on the native path)."""
    return [1, block_size - 1, block_size + 1, 3 * block_size + 7, 5 * block_size,
            int(torch.randint(1, 300_000, (1,), generator=gen))]


PATHS = ([f"native-level{lv}" for lv in quant_native.levels()] if quant_native.available()
         else ["native-unavailable"]) + ["torch"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Run quant_cpu's public functions on one path: the native library at one
    instruction-set level, or the torch path."""
    name = request.param
    if name == "native-unavailable":
        pytest.skip(f"native library not loaded: {quant_native.REASON}")
    if name == "torch":
        monkeypatch.setattr(quant_native, "LIB", None)
        assert not quant_cpu.native_in_use()
    else:
        monkeypatch.setattr(quant_native, "LEVEL", int(name.removeprefix("native-level")))
        assert quant_cpu.native_in_use()
    return name


# ---------------------------------------------------------------- the library is in use


def test_native_library_loaded_or_fallback_explained():
    info = quant_cpu.backend_info()
    if os.environ.get("ZERO_CORE_REQUIRE_NATIVE") == "1":
        assert quant_cpu.native_in_use(), (
            f"ZERO_CORE_REQUIRE_NATIVE=1 but quant_cpu runs its torch path: "
            f"{quant_native.REASON}")
    if quant_cpu.native_in_use():
        assert info["quantize_path"].startswith("native C library")
        assert quant_native.library_path() in info["quantize_path"]
        assert quant_native.LEVEL == quant_native.levels()[-1]
    else:
        reason = quant_native.REASON
        # the reason must say what is wrong and how to fix it
        assert isinstance(reason, str) and len(reason) > 30
        assert ("pip install" in reason or "ZERO_CORE_QUANT_NATIVE" in reason
                or "big-endian" in reason), reason
        assert info["quantize_native_missing"] == reason
        warnings.warn(f"quant_cpu runs its torch path: {reason}", RuntimeWarning)


def test_loader_explains_disabled_and_stale(monkeypatch):
    monkeypatch.setenv(quant_native.ENV_DISABLE, "0")
    lib, reason = quant_native._load()
    assert lib is None and "ZERO_CORE_QUANT_NATIVE=0" in reason
    monkeypatch.delenv(quant_native.ENV_DISABLE)
    if quant_native.library_path() is None:
        lib, reason = quant_native._load()
        assert lib is None and "was not built" in reason and "pip install" in reason
        return
    monkeypatch.setattr(quant_native, "_source_sha256", lambda: "0" * 64)
    lib, reason = quant_native._load()
    assert lib is None and "stale build" in reason and "pip install" in reason


@pytest.mark.skipif(not quant_native.available(),
                    reason=f"native library not loaded: {quant_native.REASON}")
def test_native_refuses_a_level_the_cpu_lacks():
    x = torch.randn(64)
    p, s = quant_reference.quantize(x, 8, 32)
    with pytest.raises(RuntimeError, match="invalid arguments"):
        quant_native.quantize_blocks(x, 8, 32, 0, 2, p, s, level=quant_native.LEVEL + 1)


# ---------------------------------------------------------------- bit identity


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_is_bit_identical(path, rng, bits, dtype):
    block_sizes = [256, 2 * int(torch.randint(1, 200, (1,), generator=rng))]
    if bits == 8:
        block_sizes.append(2 * int(torch.randint(1, 200, (1,), generator=rng)) + 1)  # odd
    for bs in block_sizes:
        for n in sizes(bs, rng):
            x = mixed_input(n, bs, rng, dtype)
            got = quant_cpu.quantize(x, bits, bs)
            want = quant_reference.quantize(x, bits, bs)
            assert_same_bits(got[0], want[0], f"{path} payload int{bits} n={n} bs={bs}", rng)
            assert_same_bits(got[1], want[1], f"{path} scales int{bits} n={n} bs={bs}", rng)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_is_bit_identical(path, rng, bits, dtype):
    bs = 2 * int(torch.randint(1, 200, (1,), generator=rng))
    for n in sizes(bs, rng):
        quantized = quant_reference.quantize(mixed_input(n, bs, rng), bits, bs)
        for payload, scales in (quantized, random_payload(n, bits, bs, rng)):
            got = quant_cpu.dequantize(payload, scales, bits, bs, n, dtype)
            want = quant_reference.dequantize(payload, scales, bits, bs, n, dtype)
            assert_same_bits(got, want, f"{path} int{bits} -> {dtype} n={n} bs={bs}", rng)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [2, 3, 4, 5, 9])
def test_fused_is_bit_identical(path, rng, bits, k):
    # a random even block size, and a multiple of 128 (the AVX-512 level's own path)
    for bs in (2 * int(torch.randint(1, 200, (1,), generator=rng)),
               128 * int(torch.randint(1, 5, (1,), generator=rng))):
        check_fused(path, rng, bits, k, bs)


def check_fused(path, rng, bits, k, bs):
    for n in sizes(bs, rng):
        senders = [quant_reference.quantize(mixed_input(n, bs, rng), bits, bs)
                   for _ in range(k - 1)]
        senders.append(random_payload(n, bits, bs, rng))  # arbitrary bytes and scales
        order = torch.randperm(k, generator=rng).tolist()
        payloads = [senders[i][0] for i in order]
        scales = [senders[i][1] for i in order]
        got = quant_cpu.dequantize_reduce_requantize(payloads, scales, bits, bs, n)
        want = quant_reference.dequantize_reduce_requantize(payloads, scales, bits, bs, n)
        what = f"{path} fused int{bits} k={k} n={n} bs={bs}"
        assert_same_bits(got[0], want[0], what + " payload", rng)
        assert_same_bits(got[1], want[1], what + " scales", rng)


def exact_scales(nb: int, gen, low: int = -140, high: int = 100) -> torch.Tensor:
    """nb float32 scales m * 2^e with m < 2^15 (so that qmax * a and (k + 1/2) * a are
    exact in float32, subnormals included), e random in [low, high)."""
    m = torch.randint(1, 1 << 15, (nb,), generator=gen, dtype=torch.float64)
    e = torch.randint(low, high, (nb,), generator=gen, dtype=torch.float64)
    return (m * torch.pow(2.0, e)).float()


def step_ulps(x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """x moved by steps[i] float32 ulps (nextafter), elementwise, |steps| <= 3."""
    x = x.clone()
    for j in range(1, 4):
        up, down = steps >= j, steps <= -j
        x[up] = torch.nextafter(x[up], torch.full_like(x[up], float("inf")))
        x[down] = torch.nextafter(x[down], torch.full_like(x[down], float("-inf")))
    return x


def near_tie_input(nb: int, bs: int, qmax: int, gen) -> torch.Tensor:
    """nb blocks whose scale is exactly a (absmax qmax * a) and whose other values are
    (k + 1/2) * a, exact rounding ties, or 1-3 ulps beside one: the cases where dividing
    by the scale and any shortcut for it could round differently. Random data almost never
    lands there."""
    a = exact_scales(nb, gen)
    k = torch.randint(-qmax, qmax, (nb, bs), generator=gen).float()
    x = step_ulps((k + 0.5) * a[:, None], torch.randint(-3, 4, (nb, bs), generator=gen))
    x[:, 0] = qmax * a * torch.where(torch.rand(nb, generator=gen) < 0.5, 1.0, -1.0)
    return x.reshape(-1)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_near_ties(path, rng, bits):
    for bs in (256, 128 * 3, 64):
        x = near_tie_input(150, bs, QMAX[bits], rng)
        got = quant_cpu.quantize(x, bits, bs)
        want = quant_reference.quantize(x, bits, bs)
        assert_same_bits(got[1], want[1], f"{path} scales int{bits} bs={bs}", rng)
        assert_same_bits(got[0], want[0], f"{path} payload int{bits} bs={bs}", rng)


def near_tie_senders(nb: int, bs: int, bits: int, gen):
    """Two senders whose sum lands on or 1-3 ulps beside rounding ties of its own scale.
    Sender 0 holds q0 with scale a, sender 1 an odd q1 with scale b = a / 2 moved by 0-3
    ulps, so the sum is (q0 + q1 / 2) * a plus a few ulps; one element per block holds
    q0 = +-qmax, q1 = 0, so the block's absmax is qmax * a and its scale a."""
    qmax = QMAX[bits]
    a = exact_scales(nb, gen, -120, 100)
    b = step_ulps(a / 2, torch.randint(-3, 4, (nb,), generator=gen))
    odd = torch.tensor([-3, -1, 1, 3])
    q1 = odd[torch.randint(0, 4, (nb, bs), generator=gen)]
    q0 = torch.randint(-qmax + 2, qmax - 2, (nb, bs), generator=gen)
    q0[:, 0] = qmax * (2 * torch.randint(0, 2, (nb,), generator=gen) - 1)
    q1[:, 0] = 0
    if bits == 8:
        payloads = [q0.reshape(-1).to(torch.int8), q1.reshape(-1).to(torch.int8)]
    else:
        payloads = [quant_reference.pack_int4(q0), quant_reference.pack_int4(q1)]
    return payloads, [a, b]


@pytest.mark.parametrize("bits", [8, 4])
def test_fused_near_ties(path, rng, bits):
    for bs in (256, 128 * 3, 64):
        nb = 150
        payloads, scales = near_tie_senders(nb, bs, bits, rng)
        for order in ([0, 1], [1, 0]):
            p = [payloads[i] for i in order]
            s = [scales[i] for i in order]
            got = quant_cpu.dequantize_reduce_requantize(p, s, bits, bs, nb * bs)
            want = quant_reference.dequantize_reduce_requantize(p, s, bits, bs, nb * bs)
            what = f"{path} fused int{bits} bs={bs} order {order}"
            assert_same_bits(got[1], want[1], what + " scales", rng)
            assert_same_bits(got[0], want[0], what + " payload", rng)


def test_near_tie_inputs_hit_ties(rng):
    """The inputs above do what they claim: quotients on exact ties and within a few ulps
    of one, in both tests (checked where the scale is normal: a subnormal scale is not
    exactly absmax / qmax)."""
    x = near_tie_input(40, 256, 7, rng).view(40, 256)
    scale = x.abs().amax(dim=1, keepdim=True) / 7
    frac = ((x / scale).abs() % 1.0)[(scale >= 2.0 ** -126).flatten()]
    assert (frac == 0.5).float().mean() > 0.05
    assert ((frac - 0.5).abs() < 1e-5).float().mean() > 0.9
    payloads, scales = near_tie_senders(40, 256, 4, rng)
    total = sum(quant_reference.unpack_int4(p, 40 * 256).float().view(40, 256) * s[:, None]
                for p, s in zip(payloads, scales))
    scale = total.abs().amax(dim=1, keepdim=True) / 7
    frac = ((total / scale).abs() % 1.0)[(scale >= 2.0 ** -126).flatten()]
    assert (frac == 0.5).float().mean() > 0.05
    assert ((frac[:, 1:] - 0.5).abs() < 1e-5).float().mean() > 0.9


def test_fused_overflow_and_sender_order(path, rng):
    """Sums that overflow float32 give NaN blocks; the sum is sender 0 first (float32
    addition is not associative, so another order would show in the bits)."""
    bs, n = 64, 64 * 40 + 2
    big = torch.full((n,), 3e38)
    p, s = quant_reference.quantize(big, 8, bs)
    got = quant_cpu.dequantize_reduce_requantize([p, p], [s, s], 8, bs, n)
    assert got[1].isnan().all()
    xs = [mixed_input(n, bs, rng) * 10.0 ** (3 * i) for i in range(3)]
    qs = [quant_reference.quantize(x, 4, bs) for x in xs]
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        got = quant_cpu.dequantize_reduce_requantize([qs[i][0] for i in order],
                                                     [qs[i][1] for i in order], 4, bs, n)
        want = quant_reference.dequantize_reduce_requantize([qs[i][0] for i in order],
                                                            [qs[i][1] for i in order], 4, bs,
                                                            n)
        assert_same_bits(got[1], want[1], f"{path} scales, order {order}", rng)
        assert_same_bits(got[0], want[0], f"{path} payload, order {order}", rng)


@pytest.mark.parametrize("bits", [8, 4])
def test_out_buffers(path, rng, bits):
    bs, n = 128, 128 * 300 + 77
    x = mixed_input(n, bs, rng)
    want = quant_reference.quantize(x, bits, bs)
    out = (torch.full_like(want[0], 3), torch.full_like(want[1], 5.0))
    got = quant_cpu.quantize(x, bits, bs, out=out)
    assert got[0].data_ptr() == out[0].data_ptr() and got[1].data_ptr() == out[1].data_ptr()
    assert_same_bits(out[0], want[0], f"{path} out payload", rng)
    assert_same_bits(out[1], want[1], f"{path} out scales", rng)
    for dtype in (torch.float32, torch.bfloat16):
        deq_out = torch.full((n,), 7.0, dtype=dtype)
        got = quant_cpu.dequantize(*want, bits, bs, n, dtype, out=deq_out)
        assert got is deq_out
        assert_same_bits(deq_out, quant_reference.dequantize(*want, bits, bs, n, dtype),
                         f"{path} dequantize out {dtype}", rng)
    other = quant_reference.quantize(mixed_input(n, bs, rng), bits, bs)
    fused_out = (torch.full_like(want[0], 1), torch.full_like(want[1], 2.0))
    got = quant_cpu.dequantize_reduce_requantize(torch.stack([want[0], other[0]]),
                                                 torch.stack([want[1], other[1]]), bits, bs,
                                                 n, out=fused_out)
    assert got[0].data_ptr() == fused_out[0].data_ptr()
    assert got[1].data_ptr() == fused_out[1].data_ptr()
    ref = quant_reference.dequantize_reduce_requantize([want[0], other[0]],
                                                       [want[1], other[1]], bits, bs, n)
    assert_same_bits(fused_out[0], ref[0], f"{path} fused out payload", rng)
    assert_same_bits(fused_out[1], ref[1], f"{path} fused out scales", rng)


# ---------------------------------------------------------------- chunks and threads


@pytest.mark.skipif(not quant_native.available(),
                    reason=f"native library not loaded: {quant_native.REASON}")
def test_native_chunks_run_on_torch_num_threads_workers(monkeypatch, rng):
    """Chunks go to torch.get_num_threads() worker threads (none for 1 thread), each
    native call does one chunk, and many small chunks still give the reference's bits."""
    monkeypatch.setattr(quant_cpu, "NATIVE_CHUNK_ELEMENTS", 4 * 64)
    monkeypatch.setattr(quant_cpu, "NATIVE_MIN_PARALLEL_ELEMENTS", 0)
    threads_seen = []
    real = quant_native.quantize_blocks

    def recording(*args, **kwargs):
        threads_seen.append(threading.current_thread().name)
        return real(*args, **kwargs)
    monkeypatch.setattr(quant_native, "quantize_blocks", recording)
    x = mixed_input(64 * 100 + 5, 64, rng)
    want = quant_reference.quantize(x, 4, 64)
    before = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            threads_seen.clear()
            got = quant_cpu.quantize(x, 4, 64)
            assert_same_bits(got[0], want[0], f"payload, {n_threads} threads", rng)
            assert_same_bits(got[1], want[1], f"scales, {n_threads} threads", rng)
            assert len(threads_seen) == 26  # 101 blocks in chunks of 4
            names = set(threads_seen)
            if n_threads == 1:
                assert names == {threading.current_thread().name}
            else:
                assert all(t.startswith("zero-core-quant") for t in names)
                assert 1 <= len(names) <= n_threads
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bits, ulps", [(8, 128), (4, 8)])
def test_subnormal_block_maximum_stays_within_qmax(path, bits, ulps):
    """A block whose largest magnitude is subnormal: absmax / qmax loses bits, and x / scale
    rounds past qmax (to 128 for int8, 8 for int4) unless clamped, as the reference does.
    Found by the fresh-random bit-identity test (seed 1253638694575935167: -128 vs -127)."""
    m = float(torch.tensor([ulps], dtype=torch.int32).view(torch.float32))
    x = torch.tensor([-m, m, m / 3, 0.0], dtype=torch.float32)
    got = quant_cpu.quantize(x, bits, 4)
    want = quant_reference.quantize(x, bits, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (got, want)
