"""How a block-quantized tensor travels: its payload and scales packed into one byte slot.

ZeRO++ moves quantized values with the ordinary collectives (``all_gather_into``,
``all_to_all_single``), which split their buffers into equal contiguous pieces per rank.
So that one collective carries both parts, each piece (a *slot*) holds one quantized
tensor::

    | payload (int8: numel bytes; int4: numel/2 bytes) | pad to 4 | scales (fp32, one per block) |

The pad keeps the scales 4-byte aligned, so they are read in place as float32. The wire
format of payload and scales is the kernels' (``accel_kernels.quant_layout``); this module
only places them. Slots are ``torch.uint8`` so the ledger counts exactly the bytes sent.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: qwZ: int8 weights, one fp32 scale per 256 elements (1.6% overhead on the int8 bytes)
QWZ_BITS, QWZ_BLOCK = 8, 256
#: qgZ: int4 gradients, one fp32 scale per 128 elements (6% overhead on the int4 bytes; smaller
#: blocks than qwZ because 4 bits leave only 15 levels per block)
QGZ_BITS, QGZ_BLOCK = 4, 128
#: the int4 byte that holds two zeros (each nibble stores q + 8)
INT4_ZERO_BYTE = 0x88


def num_blocks(numel: int, block: int) -> int:
    """Blocks (= scales) of *numel* elements; the last block may be partial."""
    return -(-numel // block)


@dataclass(frozen=True)
class SlotLayout:
    """Where payload and scales of *numel* elements quantized to *bits* sit in a slot."""

    numel: int
    bits: int
    block: int

    @property
    def payload_bytes(self) -> int:
        return self.numel if self.bits == 8 else -(-self.numel // 2)

    @property
    def scales_offset(self) -> int:
        return -(-self.payload_bytes // 4) * 4

    @property
    def num_scales(self) -> int:
        return num_blocks(self.numel, self.block)

    @property
    def nbytes(self) -> int:
        """Bytes of one slot: payload, alignment pad, scales."""
        return self.scales_offset + 4 * self.num_scales

    def payload(self, slot: torch.Tensor) -> torch.Tensor:
        """The payload inside a uint8 *slot*: int8 values (8 bits) or packed uint8 (4 bits)."""
        p = slot.narrow(0, 0, self.payload_bytes)
        return p.view(torch.int8) if self.bits == 8 else p

    def scales(self, slot: torch.Tensor) -> torch.Tensor:
        """The float32 scales inside a uint8 *slot* (a view, no copy)."""
        return slot.narrow(0, self.scales_offset, 4 * self.num_scales).view(torch.float32)

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Slot *i* of a buffer of consecutive slots."""
        return buffer.narrow(0, i * self.nbytes, self.nbytes)


def slot_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes one quantized tensor of *numel* elements occupies on the wire (see module doc)."""
    return SlotLayout(numel, bits, block).nbytes
