"""Seeded inputs and independent references for the communicator checks.

Every rank can rebuild every other rank's input from (run seed, check tag, rank), so the
expected result of a collective is computed locally, in float64, from the same values the
peers sent — no trust in the backend under test is needed to know the right answer.
"""
from __future__ import annotations

import zlib
from fractions import Fraction

import torch

#: the dtypes every collective is checked on, by short name
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "int8": torch.int8, "uint8": torch.uint8,
}


def stream_seed(seed: int, tag: str, rank: int) -> int:
    """A 63-bit generator seed for one (run, check, rank); stable across processes
    (``hash()`` is salted per process, crc32 is not)."""
    return (seed * 1_000_003 + zlib.crc32(f"{tag}/{rank}".encode())) % (1 << 63)


def rank_input(seed: int, tag: str, rank: int, numel: int, dtype: torch.dtype,
               group_size: int) -> torch.Tensor:
    """The input global *rank* contributes to check *tag*: *numel* random values of *dtype*.

    Floats are uniform in [-4, 4) rounded to *dtype*. Integers are bounded so that the sum
    over *group_size* ranks cannot overflow (overflow behaviour is not part of the contract).
    """
    g = torch.Generator().manual_seed(stream_seed(seed, tag, rank))
    if dtype.is_floating_point:
        return (torch.rand(numel, generator=g, dtype=torch.float64) * 8 - 4).to(dtype)
    info = torch.iinfo(dtype)
    n = max(group_size, 1)
    lo, hi = (0, info.max // n) if info.min == 0 else (-(info.max // n), info.max // n)
    return torch.randint(lo, hi + 1, (numel,), generator=g, dtype=torch.int64).to(dtype)


def reduce_reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Element-wise reduction of *inputs* in float64 (the exact answer for these values)."""
    stacked = torch.stack([t.to(torch.float64) for t in inputs])
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.sum(0) / len(inputs)
    if op == "max":
        return stacked.max(0).values
    if op == "min":
        return stacked.min(0).values
    raise ValueError(op)


def compare_reduction(got: torch.Tensor, inputs: list[torch.Tensor], op: str) -> str | None:
    """None if *got* is an acceptable result of reducing *inputs* with *op*, else why not.

    max/min and integer sums must be exact. Integer averages may round either way (the
    interface does not fix a rounding mode), so they must be within 1 of the true mean.
    Floating-point sums and averages may differ from the float64 answer by the rounding
    of a reduction done in the dtype itself: at most n·eps·Σ|x| per element (plus one
    rounding of the quotient for avg).
    """
    ref = reduce_reference(inputs, op)
    g64 = got.to(torch.float64)
    dtype = got.dtype
    if g64.shape != ref.shape:
        return f"shape {tuple(g64.shape)}, expected {tuple(ref.shape)}"
    err = (g64 - ref).abs()
    if op in ("max", "min") or (not dtype.is_floating_point and op == "sum"):
        tol = torch.zeros_like(ref)
    elif not dtype.is_floating_point:  # integer avg
        tol = torch.full_like(ref, 1.0 - 1e-9)
    else:
        eps = torch.finfo(dtype).eps
        abs_sum = torch.stack([t.to(torch.float64).abs() for t in inputs]).sum(0)
        if op == "avg":
            abs_sum = abs_sum / len(inputs)
        tol = len(inputs) * eps * abs_sum + eps * ref.abs()
    bad = err > tol
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0])
    return (f"{int(bad.sum())}/{ref.numel()} elements wrong; first at [{i}]: got "
            f"{g64[i].item():.6g}, expected {ref[i].item():.6g} (tolerance {tol[i].item():.3g}, "
            f"inputs {[t[i].item() for t in inputs]})")


def compare_exact(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if *got* equals *want* bit for bit (data movement only), else why not."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    bad = got.view(-1) != want.view(-1)
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0])
    return (f"{int(bad.sum())}/{want.numel()} elements differ; first at [{i}]: got "
            f"{got.view(-1)[i].item()}, expected {want.view(-1)[i].item()}")


# ---- the ledger's table, restated independently of zero_core.interfaces.ledger ---------------------
def expected_sent_bytes(op: str, n: int, payload: int, is_source: bool) -> int:
    """Bytes a rank sends under the table of zero_core/ledger.py (floored to whole bytes)."""
    if n <= 1:
        return 0
    share = {
        "all_gather_into": Fraction(n - 1),
        "reduce_scatter": Fraction(n - 1, n),
        "all_reduce": Fraction(2 * (n - 1), n),
        "all_to_all_single": Fraction(n - 1, n),
        "broadcast": Fraction(1 if is_source else 0),
        "barrier": Fraction(0),
    }[op]
    return int(share * payload)
