"""The one flat-buffer type: a 1-D tensor laid out by a :class:`GroupLayout`.

A buffer is either ``"full"`` (the whole padded group: model parameters, full gradients)
or ``"partition"`` (one rank's slice of every bucket, concatenated: master weights,
optimizer states, partitioned gradients). Everything else — bucket views, the rank's
slice of a bucket, parameter-shaped views — is a view into the one tensor, so nothing is
copied when the engine hands pieces to collectives, kernels or the model.
"""
from __future__ import annotations

import torch

from zero_core.errors import ConfigError
from zero_core.partitioning.layout import GroupLayout

KINDS = ("full", "partition")


class FlatBuffer:
    """A flat tensor of *dtype* on *device* covering a group (``kind="full"``) or one
    rank's partition of it (``kind="partition"``). Zero-initialised (padding stays 0)."""

    def __init__(self, layout: GroupLayout, kind: str, dtype: torch.dtype,
                 device: torch.device, rank: int):
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: use one of {KINDS}")
        self.layout, self.kind, self.rank = layout, kind, rank
        numel = layout.padded_numel if kind == "full" else layout.partition_numel
        self.data = torch.zeros(numel, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def bucket(self, k: int) -> torch.Tensor:
        """Bucket *k*: the whole bucket (full) or this rank's slice of it (partition)."""
        lay = self.layout
        if self.kind == "full":
            start, size = lay.bucket_starts[k], lay.bucket_sizes[k]
        else:
            start, size = lay.partition_start(k), lay.shard_size(k)
        return self.data.narrow(0, start, size)

    def shard(self, k: int, rank: int | None = None) -> torch.Tensor:
        """Slice *rank* (default: this rank) of bucket *k* of a full buffer."""
        if self.kind != "full":
            raise ValueError("shard() is for full buffers; a partition buffer's bucket() "
                             "already is this rank's slice")
        rank = self.rank if rank is None else rank
        lay = self.layout
        return self.data.narrow(0, lay.shard_start(k, rank), lay.shard_size(k))

    def param(self, i: int, shape: torch.Size) -> torch.Tensor:
        """Parameter *i* of a full buffer, viewed with *shape*."""
        if self.kind != "full":
            raise ValueError("param() is for full buffers")
        lay = self.layout
        return self.data.narrow(0, lay.offsets[i], lay.numels[i]).view(shape)


def check_master_handover(current: FlatBuffer | None, replacement: FlatBuffer) -> None:
    """Refuse handing a bf16 master to the offloaded optimizer, whose store keeps fp32: the
    bf16 master would silently become an fp32 one (the group buffers of every stage ask)."""
    if current is not None and current.dtype != replacement.dtype:
        raise ConfigError(
            f"bf16.bf16_master_weights_and_grads is not available with "
            f"zero_optimization.offload_optimizer yet: the offloaded optimizer keeps "
            f"{replacement.dtype} master weights in its store, not {current.dtype}. Remove "
            f"the bf16 master flags, or set offload_optimizer.device to 'none'")
