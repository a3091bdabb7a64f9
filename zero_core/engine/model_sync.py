"""Make every rank start from the same model: broadcast buffers, verify parameters.

Parameters are *verified* rather than broadcast: ranks that built different models (a
missing ``torch.manual_seed``, a rank-dependent init) are a bug in the training script
that a broadcast would hide, so the engine names the first parameter that differs.
"""
from __future__ import annotations

import torch

from zero_core.interfaces.communicator import Communicator
from zero_core.errors import ZeroCoreError


def broadcast_buffers(module: torch.nn.Module, comm: Communicator) -> None:
    """Copy every module buffer (running statistics, masks, ...) from rank 0, in place."""
    if comm.world_size == 1:
        return
    for buf in module.buffers():
        tmp = buf.detach()
        if tmp.dtype == torch.bool:
            tmp = tmp.to(torch.uint8)
        elif not tmp.is_contiguous():
            tmp = tmp.contiguous()
        comm.broadcast(tmp, src=0)
        if tmp.data_ptr() != buf.data_ptr():
            with torch.no_grad():
                buf.copy_(tmp)


def parameter_checksums(module: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names and a float64 ``[num_params, 3]`` tensor of checksums per parameter: the sum,
    the sum of squares and a position-weighted sum (catches permuted values)."""
    names, rows = [], []
    for name, p in module.named_parameters():
        x = p.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(x.numel(), dtype=torch.float64, device=x.device).remainder_(97).add_(1)
        rows.append(torch.stack([x.sum(), x.dot(x), x.dot(weights)]))
        names.append(name)
    if not rows:
        return names, torch.zeros(0, 3, dtype=torch.float64)
    return names, torch.stack(rows)


def check_parameters_match(module: torch.nn.Module, comm: Communicator) -> None:
    """Raise ZeroCoreError naming the first parameter whose values differ across ranks."""
    if comm.world_size == 1:
        return
    names, sums = parameter_checksums(module)
    if not names:
        return
    both = torch.cat([sums, -sums]).contiguous()
    comm.all_reduce(both, "max")
    hi, lo = both[: len(names)], -both[len(names):]
    differs = (hi != lo).any(dim=1)
    if bool(differs.any()):
        first = int(differs.nonzero()[0, 0])
        count = int(differs.sum())
        raise ZeroCoreError(
            f"parameter '{names[first]}' differs across ranks at initialization ({count} of "
            f"{len(names)} parameters differ; checksums range from {lo[first].tolist()} to "
            f"{hi[first].tolist()}). Every rank must build the same model: call "
            f"torch.manual_seed(<same seed>) before constructing it, or load the same "
            f"weights on every rank.")
