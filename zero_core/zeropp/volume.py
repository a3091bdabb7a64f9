"""Inter-node bytes per rank and optimizer step of ZeRO-3 and ZeRO++, by the ledger's
convention (zero_core/ledger.py: a collective on a group that spans nodes counts all of
this rank's sent bytes as inter-node; ring all-gather sends (n-1)·B_in, reduce-scatter
and all-to-all (n-1)/n·B_in).

The ZeRO++ paper's per-rank figures, model size M (bytes of the 16-bit model), are 3M for
ZeRO-3 and 0.75M for ZeRO++ (qwZ 0.5M + hpZ 0 + qgZ 0.25M). With the ledger's exact
accounting on N = K·R ranks (K nodes of R), block b, every unit gathered once in forward
and once in backward, and one gradient reduction per step:

* ZeRO-3: 3·(N-1)/N·M — forward and backward all-gathers and the reduce-scatter, all on
  the world group (2.25M at N = 4; the paper rounds (N-1)/N to 1);
* ZeRO++: qwZ's forward all-gather of int8 plus one fp32 scale per b_w elements,
  (N-1)/N·(M/2)·(1 + 4/b_w); hpZ's backward all-gather stays in the node, 0; qgZ's hop 2
  sends (K-1) int4 slots of this rank's 1/N share, (K-1)/N·(M/4)·(1 + 8/b_g). At N = 4,
  K = 2, b_w = 256, b_g = 128: 0.3809M + 0.0664M = 0.4473M, i.e. 0.199× ZeRO-3 (the
  paper: 0.25×; its qgZ term counts a node's whole M/4, here it is split across R ranks
  and the world-group gathers' (N-1)/N factor is kept).

Functions take the fetch units' padded sizes (elements), so that the prediction matches
the engine's exact layout (padding included).
"""
from __future__ import annotations

from zero_core.zeropp.wire import QGZ_BITS, QGZ_BLOCK, QWZ_BITS, QWZ_BLOCK, slot_bytes


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def norm_allreduce_bytes(world_size: int) -> int:
    """The engine's one all-reduce per step of three float64: the squared gradient norm and
    the two sample-count sums of ``safety.check_batch_sizes`` (on by default)."""
    return 2 * (world_size - 1) * 3 * 8 // world_size


def zero3_inter_node_bytes(forward: list[int], backward: list[int], reduced: list[int],
                           world_size: int, elem_bytes: int) -> int:
    """ZeRO-3 per rank and step: an all-gather of P/N elements for every unit gathered in
    forward and for every unit gathered again in backward (padded sizes P in *forward* and
    *backward*), a reduce-scatter of P elements per reduced unit, *elem_bytes* each, all on
    the world group (which spans nodes); plus the norm all-reduce."""
    n = world_size
    total = sum((n - 1) * (p // n) * elem_bytes for p in list(forward) + list(backward))
    total += sum((n - 1) * p * elem_bytes // n for p in reduced)
    return total + norm_allreduce_bytes(n)


def zeropp_inter_node_bytes(forward: list[int], reduced: list[int], world_size: int,
                            ranks_per_node: int, qwz_block: int = QWZ_BLOCK,
                            qgz_block: int = QGZ_BLOCK) -> int:
    """ZeRO++ (qwZ + hpZ + qgZ) per rank and step: the forward's world-wide all-gather of
    an int8 slot per unit in *forward*; backward gathers inside the node (0 inter-node
    bytes); for every unit in *reduced*, qgZ's hop 2 among the K nodes, (K-1) int4 slots
    of its chunk padded to whole blocks; plus the norm all-reduce. (Units whose chunk is
    below one qgZ block fall back to the reduce-scatter: do not pass those.)"""
    n, k = world_size, world_size // ranks_per_node
    total = sum((n - 1) * slot_bytes(p // n, QWZ_BITS, qwz_block) for p in forward)
    total += sum((k - 1) * slot_bytes(_round_up(p // n, qgz_block), QGZ_BITS, qgz_block)
                 for p in reduced)
    return total + norm_allreduce_bytes(n)

