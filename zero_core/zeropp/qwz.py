"""qwZ: a fetch unit's all-gather carried as block-quantized int8 plus fp32 scales.

Each rank quantizes its partition (its slice of the unit, compute dtype) with the kernel
set's ``quantize`` into one byte slot (zeropp/wire.py), the slots are all-gathered, and on
arrival every rank's slot is dequantized with ``dequantize`` into its place of the
gathered buffer, in the compute dtype. Every rank dequantizes the same bytes, so every
rank computes with identical (quantized) weights.

Bytes per rank and gather, S = the unit's per-rank slice in elements, b = QWZ_BLOCK:
S + 4·ceil(S/b) (+ up to 3 pad bytes) instead of 2S (bf16/fp16) or 4S (fp32): the ledger
records these uint8 slots. Error: every element within half a step, absmax(block)/254,
of its value (accel_kernels/quant_layout.py); a block with inf/NaN arrives as NaN.
"""
from __future__ import annotations

import torch

from zero_core.interfaces.communicator import Communicator, Group
from zero_core.zeropp.handles import Then
from zero_core.zeropp.wire import QWZ_BITS, QWZ_BLOCK, SlotLayout


class QuantizedGather:
    """All-gathers of unit partitions as int8 slots (see module docstring)."""

    def __init__(self, comm: Communicator, kernels: dict, bits: int = QWZ_BITS,
                 block: int = QWZ_BLOCK):
        self.comm, self.bits, self.block = comm, bits, block
        self.quantize = kernels["quantize"]
        self.dequantize = kernels["dequantize"]
        self.gathers = 0

    def layout(self, shard_numel: int) -> SlotLayout:
        return SlotLayout(shard_numel, self.bits, self.block)

    def gather(self, part: torch.Tensor, full: torch.Tensor, group: Group | None = None) -> Then:
        """Start gathering every rank's *part* of *group* (default: world) into *full*
        (group order); the returned handle's ``wait()`` dequantizes on arrival."""
        group = group or self.comm.world
        n, shard = group.size, part.numel()
        lay = self.layout(shard)
        send = torch.empty(lay.nbytes, dtype=torch.uint8, device=part.device)
        self.quantize(part, self.bits, self.block, out=(lay.payload(send), lay.scales(send)))
        recv = torch.empty(n * lay.nbytes, dtype=torch.uint8, device=part.device)
        handle = self.comm.all_gather_into(recv, send, group=group, async_op=True)
        self.gathers += 1

        def dequantize_arrivals():
            for r in range(n):
                slot = lay.slot(recv, r)
                self.dequantize(lay.payload(slot), lay.scales(slot), self.bits, self.block,
                                shard, full.dtype, out=full.narrow(0, r * shard, shard))
        return Then(handle, dequantize_arrivals)

    def roundtrip(self, part: torch.Tensor) -> torch.Tensor:
        """What a quantized gather delivers for *part* (quantize, then dequantize), locally."""
        lay = self.layout(part.numel())
        slot = torch.empty(lay.nbytes, dtype=torch.uint8, device=part.device)
        self.quantize(part, self.bits, self.block, out=(lay.payload(slot), lay.scales(slot)))
        return self.dequantize(lay.payload(slot), lay.scales(slot), self.bits, self.block,
                               part.numel(), part.dtype)
