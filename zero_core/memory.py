"""Memory: ARCHITECTURE §4's formulas for model-state bytes per rank, and the engine's ledger of
what it really allocated.

Notation: Ψ parameters, N data-parallel ranks, b bytes per low-precision element (2 for
bf16/fp16, 4 for fp32 training), k bytes of optimizer state per parameter *including* an
fp32 master copy (Adam: 4 master + 4 m + 4 v = 12; SGD with momentum: 8; plain SGD: 4).
In fp32 training the parameters are their own master copy, so optimizer states cost
``k - 4`` bytes per parameter.

=====  =================================  ===============  ================
stage  partitioned                        mixed precision  fp32
=====  =================================  ===============  ================
0      nothing                            (2b + k) Ψ       (8 + k - 4) Ψ
1      optimizer states (+ master)        2bΨ + kΨ/N       8Ψ + (k-4)Ψ/N
2      + gradients                        bΨ + (b + k)Ψ/N  4Ψ + (k)Ψ/N
=====  =================================  ===============  ================

With b = 2, k = 12 that is the ARCHITECTURE §4 table's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N; fp32: 16Ψ, 8Ψ + 8Ψ/N,
4Ψ + 12Ψ/N.

bf16 master weights (``bf16.bf16_master_weights_and_grads``, stages 1-3) store the master
in 2 bytes instead of 4, and bf16 optimizer states (``bf16.bf16_optimizer_states``) the
k - 4 state bytes at half size: with Adam at stage 2, 2Ψ + (2 + 2 + 8)Ψ/N, or
2Ψ + (2 + 2 + 4)Ψ/N with both flags (``master_dtype`` / ``states_dtype`` below).
"""
from __future__ import annotations

from collections import defaultdict

import torch

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: ledger categories (model states first, then working memory)
CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states",
              "frozen_parameters", "buffers", "communication_buffers")


def _check(stage: int, world_size: int, precision: str):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: use 0, 1, 2 or 3")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r}: use one of {sorted(PRECISION_BYTES)}")


def model_state_breakdown(stage: int, num_params: int, world_size: int, precision: str,
                          k: int = 12, master_dtype: str = "fp32",
                          states_dtype: str = "fp32", grads_dtype: str | None = None) -> dict:
    """Bytes per rank of parameters, gradients, master weights and optimizer states
    (the table in the module docstring, without padding). *k*: optimizer bytes per
    parameter including the fp32 master copy (12 for Adam). *master_dtype* /
    *states_dtype*: "bf16" for ``bf16.bf16_master_weights_and_grads`` /
    ``bf16.bf16_optimizer_states`` (bf16 training, stages 1-3), else "fp32". *grads_dtype*:
    the accumulated gradients' dtype (``data_types.grad_accum_dtype``; None = *precision*)."""
    _check(stage, world_size, precision)
    for name, value in (("master_dtype", master_dtype), ("states_dtype", states_dtype)):
        if value not in ("fp32", "bf16"):
            raise ValueError(f"{name}={value!r}: use 'fp32' or 'bf16'")
    if (master_dtype, states_dtype) != ("fp32", "fp32") and (precision != "bf16" or stage == 0):
        raise ValueError(f"bf16 master weights/states need bf16 precision at stage 1-3 "
                         f"(got precision={precision!r}, stage={stage})")
    if states_dtype == "bf16" and master_dtype != "bf16":
        raise ValueError("states_dtype='bf16' needs master_dtype='bf16' (DeepSpeed's rule)")
    psi, n = num_params, world_size
    b = PRECISION_BYTES[precision]
    mixed = precision != "fp32"
    master = PRECISION_BYTES[master_dtype] if mixed else 0
    states = (k - 4) * PRECISION_BYTES[states_dtype] // 4
    part = lambda nbytes, partitioned: nbytes * psi / n if partitioned else nbytes * psi  # noqa: E731
    return {
        "parameters": part(b, stage >= 3),
        "gradients": part(PRECISION_BYTES[grads_dtype or precision], stage >= 2),
        "master_weights": part(master, stage >= 1),
        "optimizer_states": part(states, stage >= 1),
    }


def model_state_bytes(stage: int, num_params: int, world_size: int, precision: str,
                      k: int = 12, master_dtype: str = "fp32", states_dtype: str = "fp32",
                      grads_dtype: str | None = None) -> float:
    """Model-state bytes per rank (ARCHITECTURE §4 table; *k* = 12 for Adam)."""
    return sum(model_state_breakdown(stage, num_params, world_size, precision, k,
                                     master_dtype, states_dtype, grads_dtype).values())


def optimizer_k(optimizer_type: str, momentum: float = 0.0) -> int:
    """Bytes of optimizer state per parameter including the fp32 master copy (the k of
    the formulas): Adam/AdamW/Lamb 12, SGD with momentum 8, SGD without 4."""
    name = optimizer_type.lower()
    if name in ("adam", "adamw", "lamb"):
        return 12
    if name == "sgd":
        return 8 if momentum else 4
    raise ValueError(f"no k known for optimizer {optimizer_type!r}")


def comm_bytes_per_step(stage: int, num_params: int, world_size: int, precision: str) -> float:
    """Bytes one rank sends per optimizer step (ledger convention, ring algorithms): stage 0
    all-reduces the gradients, 2 (N-1)/N · bΨ; stages 1 and 2 reduce-scatter gradients and
    all-gather parameters, (N-1)/N · bΨ each — the same 2Ψ elements; stage 3 all-gathers the
    parameters in forward and again in backward and reduce-scatters the gradients, 3Ψ
    elements. For stage 3 this is the upper bound: parameters that persist
    (stage3_param_persistence_threshold) or are kept from forward to backward
    (stage3_max_reuse_distance) are not gathered twice."""
    _check(stage, world_size, precision)
    n, b = world_size, PRECISION_BYTES[precision]
    passes = 3 if stage == 3 else 2
    return passes * (n - 1) / n * b * num_params


class MemoryLedger:
    """What the engine allocated, by category, in bytes (this rank only). Tensors are
    recorded once, by storage, so views of one buffer are not counted twice."""

    def __init__(self):
        self._bytes: dict[str, int] = defaultdict(int)
        self._seen: set[int] = set()

    def track(self, category: str, tensor: torch.Tensor | None) -> None:
        """Count *tensor*'s storage under *category* (no-op for None or if seen)."""
        if tensor is None:
            return
        if category not in CATEGORIES:
            raise ValueError(f"category {category!r}: use one of {CATEGORIES}")
        key = tensor.untyped_storage().data_ptr()
        if key in self._seen and tensor.numel():
            return
        self._seen.add(key)
        self._bytes[category] += tensor.untyped_storage().nbytes()

    def report(self) -> dict:
        """Bytes per category plus ``model_states`` (the first four categories summed)."""
        out = {c: int(self._bytes.get(c, 0)) for c in CATEGORIES}
        out["model_states"] = sum(out[c] for c in CATEGORIES[:4])
        return out
