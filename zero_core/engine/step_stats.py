"""What every rank must agree on at an optimizer step, carried by the step's one all-reduce.

:func:`all_reduce_step_stats` reduces three float64 — this rank's squared gradient norm, and
Σn, Σn² of the samples it fed ``engine(...)`` since the last update — so that the global
norm, the overflow decision (inf/NaN survive the sum) and the equal-batch check
(N·Σn² = (Σn)² iff every rank saw the same n) cost one collective (ARCHITECTURE §4, step 3).
They stay on the device: engine/update.py decides from them without the host reading
anything. :func:`raise_batch_mismatch` names each rank's count, only when something is wrong;
:func:`leading_dim` is how many samples one ``engine(...)`` call fed.
"""
from __future__ import annotations

import torch

from zero_core.errors import ZeroCoreError


def all_reduce_step_stats(comm, local_sumsq: torch.Tensor, samples: int, world_size: int,
                          reduce_norm: bool, check_batches: bool) -> torch.Tensor:
    """``[global squared norm, Σn, Σn²]``, float64 on the norm's device. *reduce_norm*: the
    squared norm is this rank's share (stages 1-3) and must be summed; stage 0's gradients
    are complete already, so only the sample counts travel then."""
    local = local_sumsq.reshape(1).to(torch.float64)
    n = float(samples)
    # made on the device (a fill, not a copy from the host: that would synchronize)
    counts = torch.full((2,), n, dtype=torch.float64, device=local.device)
    counts[1:].mul_(n)
    if not (reduce_norm or check_batches):
        return torch.cat([local, counts])
    stats = torch.cat([local if reduce_norm else torch.zeros_like(local), counts])
    comm.all_reduce(stats, "sum")
    if not reduce_norm:
        stats[0:1] = local
    return stats


def batches_differ(stats: torch.Tensor, world_size: int) -> torch.Tensor:
    """On the device: whether the ranks fed different sample counts (0-dim bool). All equal
    <=> N·Σn² = (Σn)² (Cauchy–Schwarz); exact while the numbers are below 2**53."""
    total, total_sq = stats[1], stats[2]
    return (total * total < 2.0 ** 53) & (world_size * total_sq != total * total)


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


def leading_dim(args, kwargs) -> int:
    """Samples in one forward call: the leading dimension of the first tensor argument
    (positional first, then keyword, in order); 0 when there is none."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return int(v.shape[0]) if v.dim() else 1
    return 0
