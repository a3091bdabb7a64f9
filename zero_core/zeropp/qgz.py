"""qgZ: a unit's gradient reduction as a two-hop, int4 block-quantized all-to-all.

Replaces the stage-3 reducer's ``reduce_scatter`` (``reduce_unit(u, output, input)``):
*input* is this rank's full flat gradient of the unit (N chunks of S elements, compute
dtype); *output* must receive the sum over all ranks of chunk ``rank``. With N = K nodes
× R ranks per node, rank (node k, local l) = k·R + l:

1. quantize: the chunks are regrouped by the local rank that reduces them inside the node
   — slot l' holds chunks {k'·R + l' : k' = 0..K-1} — and each chunk is quantized to int4
   (QGZ_BLOCK elements per fp32 scale, chunks padded to whole blocks with zeros);
2. hop 1, intra-node ``all_to_all_single``: slot l' goes to local rank l';
3. the kernel set's fused ``dequantize_reduce_requantize`` sums the R slots received
   (float32, sender order) and requantizes the node's partial sums of K chunks;
4. hop 2, inter-node ``all_to_all_single`` among the ranks with this local rank: chunk k'
   goes to node k';
5. the K node sums received are dequantized and added in float32 (node order) and
   written to *output* in the compute dtype. The loss was already scaled by 1/N before
   backward (engine/core.py), so this sum is the average gradient.

Only hop 2 crosses nodes: (K-1) slots of S/2 bytes + scales per rank, against (N-1)/N·2S·N
bytes of a bf16 reduce-scatter on the world group (ledger convention).

Error, per element: each quantization is within half a step (absmax(block)/14) of its
input — R senders' hop-1 quantizations and K requantizations of node sums; the last hop
adds only float32 rounding. inf/NaN anywhere in a block gives NaN for that block (the
kernels' rule), so fp16 overflow checks still see it.

Fallbacks to the ordinary reduce-scatter, each logged once (per unit) with its reason:

* one node (K = 1): nothing crosses nodes, so quantizing would cost accuracy for no gain;
* a unit whose per-rank chunk S is smaller than one quantization block: padding and scales
  would outweigh the int4 payload (small units, e.g. persistent biases and norms);
* a communicator that cannot carry uint8 all-to-alls.
"""
from __future__ import annotations

import logging

import torch

from zero_core.interfaces.communicator import Communicator
from zero_core.zeropp.handles import Then
from zero_core.zeropp.wire import INT4_ZERO_BYTE, QGZ_BITS, QGZ_BLOCK, SlotLayout

log = logging.getLogger("zero_core.zeropp")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class TwoHopGradientReduce:
    """The ``reduce_unit`` strategy of qgZ (see module docstring)."""

    def __init__(self, comm: Communicator, kernels: dict, bits: int = QGZ_BITS,
                 block: int = QGZ_BLOCK):
        self.comm, self.bits, self.block = comm, bits, block
        self.quantize = kernels["quantize"]
        self.dequantize = kernels["dequantize"]
        self.fused = kernels["dequantize_reduce_requantize"]
        topo = comm.topology
        self.R, self.K = topo.ranks_per_node, topo.num_nodes
        self.topology_reason = None
        if self.K == 1:
            self.topology_reason = ("all ranks are on one node, so no gradient byte crosses "
                                    "nodes and int4 would cost accuracy for nothing")
        elif not comm.supports("all_to_all_single", torch.uint8):
            self.topology_reason = (f"the {comm.name} communicator cannot carry uint8 "
                                    f"all-to-alls")
        if self.topology_reason is None:
            self.intra = comm.intra_node_group()
            self.inter = comm.inter_node_group()
        self._logged: set = set()
        self.quantized_reductions = 0
        self.fallback_reductions = 0

    # ---- planning ---------------------------------------------------------------------------
    def fallback_reason(self, u) -> str | None:
        """Why unit *u* cannot take the two-hop path (None: it can)."""
        if self.topology_reason is not None:
            return self.topology_reason
        chunk = u.padded_numel // self.comm.world_size
        if chunk < self.block:
            return (f"each rank's share of its gradient ({chunk} elements) is smaller than one "
                    f"int4 block of {self.block}, so padding and scales would outweigh the "
                    f"payload")
        return None

    def _fall_back(self, u, output, input, reason):
        if u.index not in self._logged:
            self._logged.add(u.index)
            name = u.names[0] if u.names else f"unit {u.index}"
            log.info("qgZ: gradients of fetch unit %d (%s, %d elements) use the ordinary "
                     "reduce-scatter: %s", u.index, name, u.padded_numel, reason)
        self.fallback_reductions += 1
        return self.comm.reduce_scatter(output, input, "sum", async_op=True)

    # ---- the reduction ---------------------------------------------------------------------
    def __call__(self, u, output: torch.Tensor, input: torch.Tensor):
        """Reduce *input* (the unit's full flat gradient) so that *output* gets this rank's
        summed chunk; returns a handle whose ``wait()`` completes both hops."""
        reason = self.fallback_reason(u)
        if reason is not None:
            return self._fall_back(u, output, input, reason)
        self.quantized_reductions += 1
        R, K, block, bits = self.R, self.K, self.block, self.bits
        S = output.numel()
        Sp = round_up(S, block)
        hop1 = SlotLayout(K * Sp, bits, block)   # one slot per local rank of the node
        send = torch.empty(R * hop1.nbytes, dtype=torch.uint8, device=input.device)
        for lp in range(R):
            slot = hop1.slot(send, lp)
            payload, scales = hop1.payload(slot), hop1.scales(slot)
            if Sp != S:
                payload.fill_(INT4_ZERO_BYTE)   # the zero padding of every chunk
            for kp in range(K):
                chunk = input.narrow(0, (kp * R + lp) * S, S)
                self.quantize(chunk, bits, block, out=(
                    payload.narrow(0, kp * Sp // 2, -(-S // 2)),
                    scales.narrow(0, kp * Sp // block, -(-S // block))))
        if R == 1:
            return Then(None, lambda: self._second_hop(send, hop1, S, Sp, output))
        recv = torch.empty_like(send)
        handle = self.comm.all_to_all_single(recv, send, group=self.intra, async_op=True)
        return Then(handle, lambda: self._second_hop(recv, hop1, S, Sp, output))

    def _second_hop(self, recv: torch.Tensor, hop1: SlotLayout, S: int, Sp: int,
                    output: torch.Tensor):
        R, K, block, bits = self.R, self.K, self.block, self.bits
        slots = [hop1.slot(recv, i) for i in range(R)]
        if R == 1:
            payload, scales = hop1.payload(slots[0]), hop1.scales(slots[0])
        else:
            payload, scales = self.fused([hop1.payload(s) for s in slots],
                                         [hop1.scales(s) for s in slots], bits, block, K * Sp)
        hop2 = SlotLayout(Sp, bits, block)   # one slot per node
        send = torch.empty(K * hop2.nbytes, dtype=torch.uint8, device=recv.device)
        for kp in range(K):
            slot = hop2.slot(send, kp)
            hop2.payload(slot).copy_(payload.narrow(0, kp * Sp // 2, Sp // 2))
            hop2.scales(slot).copy_(scales.narrow(0, kp * Sp // block, Sp // block))
        got = torch.empty_like(send)
        handle = self.comm.all_to_all_single(got, send, group=self.inter, async_op=True)

        def add_node_sums():
            total = None
            for kp in range(K):
                slot = hop2.slot(got, kp)
                part = self.dequantize(hop2.payload(slot), hop2.scales(slot), bits, block, Sp,
                                       torch.float32)
                total = part if total is None else total.add_(part)
            output.copy_(total.narrow(0, 0, S))
        return Then(handle, add_node_sums)
