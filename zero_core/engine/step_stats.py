"""What every rank must agree on at an optimizer step, carried by the step's one all-reduce.

:func:`all_reduce_step_stats` reduces three float64 — this rank's squared gradient norm, and
Σn, Σn² of the samples it fed ``engine(...)`` since the last update — so that the global
norm, the overflow decision (inf/NaN survive the sum) and the equal-batch check
(N·Σn² = (Σn)² iff every rank saw the same n) cost one collective (ARCHITECTURE §4, step 3).
The rest runs only when something is wrong: :func:`raise_batch_mismatch` names each rank's
count, :func:`first_nonfinite_parameter` the first parameter whose gradient is not finite.
"""
from __future__ import annotations

import torch

from zero_core.checkpoint.engine_state import layout_fragments, parameter_names
from zero_core.errors import ZeroCoreError


def all_reduce_step_stats(comm, local_sumsq: torch.Tensor, samples: int, world_size: int,
                          reduce_norm: bool, check_batches: bool) -> tuple[float, bool]:
    """``(global squared norm, batches differ)``. *reduce_norm*: the squared norm is this
    rank's share (stages 1-3) and must be summed; stage 0's gradients are complete already,
    so only the sample counts travel then."""
    n = float(samples)
    if not (reduce_norm or check_batches):
        return float(local_sumsq.item()), False
    # on the norm's device: the collective carries one tensor, wherever gradients live
    counts = torch.tensor([n, n * n], dtype=torch.float64, device=local_sumsq.device)
    stats = torch.cat([(local_sumsq if reduce_norm else torch.zeros_like(local_sumsq))
                       .reshape(1), counts])
    comm.all_reduce(stats, "sum")
    sumsq, total, total_sq = stats.tolist()  # one device-to-host copy
    # all equal <=> N·Σn² = (Σn)² (Cauchy–Schwarz); exact while the numbers are below 2**53
    differ = (check_batches and total * total < 2.0 ** 53
              and world_size * total_sq != total * total)
    return (sumsq if reduce_norm else float(local_sumsq.item())), differ


def raise_batch_mismatch(comm, samples: int, world_size: int, step: int) -> None:
    """Collective (every rank saw the same sums): raise an error naming each rank's sample
    count."""
    everyone = torch.empty(world_size, dtype=torch.float64)
    comm.all_gather_into(everyone, torch.tensor([float(samples)], dtype=torch.float64))
    counts = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(everyone.tolist()))
    raise ZeroCoreError(
        f"step {step}: ranks saw different numbers of samples since the last "
        f"update ({counts}; the leading dimension of the first tensor given to "
        f"engine(...)). Each rank's loss is a mean over its own samples, so uneven "
        f"batches would weight samples unequally. Give every rank the same micro-batch "
        f"size (DataLoader(drop_last=True) with a DistributedSampler). If the first input "
        f"is not batch-first (e.g. a sequence-first tensor padded per rank), set config "
        f"\"safety\": {{\"check_batch_sizes\": false}}. The weights were not updated")


def first_nonfinite_parameter(module, buffers: list, comm, rank: int,
                              world_size: int) -> str | None:
    """Collective: the first parameter (``module.named_parameters()`` order) whose reduced
    gradient holds inf/NaN on any rank; only called on a non-finite step."""
    names = parameter_names(module)
    order = {name: i for i, name in enumerate(names.values())}
    first = len(order)
    for gb in buffers:
        if gb is None:
            continue
        grads = getattr(gb, "grad_part", None)
        grads = grads if grads is not None else gb.grad_buf
        for f in layout_fragments(gb.layout, gb.params, names, {"g": grads}, rank, [rank]):
            if order[f.name] < first and not bool(torch.isfinite(f.tensors["g"]).all()):
                first = order[f.name]
    if world_size > 1:
        t = torch.tensor([first], dtype=torch.int64)
        comm.all_reduce(t, "min")
        first = int(t)
    return list(order)[first] if first < len(order) else None
