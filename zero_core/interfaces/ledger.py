"""The communication ledger: what this rank really sent through its communicator.

Every collective that goes through a :class:`~zero_core.interfaces.communicator.Communicator` is
recorded here, once, by the communicator base class — so quantized payloads and their
scales are counted as the bytes they are, not as the fp32 they stand for.

``sent_bytes`` is what this rank puts on the wire under a bandwidth-optimal algorithm
(ring / pairwise exchange), the same convention nccl-tests use for bus bandwidth:

=================  ====================================  (n = group size, B = bytes)
all_gather_into    (n-1) * B_in        every rank sends its shard to n-1 peers
reduce_scatter     (n-1)/n * B_in      it sends n-1 of its n chunks once
all_reduce         2 (n-1)/n * B       reduce-scatter then all-gather
all_to_all_single  (n-1)/n * B_in      everything but the chunk it keeps
broadcast          B on the source, 0 elsewhere (pipelined trees forward it, but the
                   source's send is the one that counts once per byte)
barrier            0
=================  ====================================

Collectives on device tensors that a host-only communicator carries are staged through
pinned host buffers (:mod:`zero_core.interfaces.staging`); the device<->host copies they cost
are recorded per op as ``staged_bytes`` (both directions) and ``staging_s`` (seconds).

Host<->device copies that are not collectives — the offloaded optimizer's gradients going
to the host and updated parameters coming back, offloaded parameter partitions fetched for a
gather — are recorded with :meth:`CommLedger.record_copy` under a name ("offload_optimizer",
"offload_param"): ``snapshot()["transfers"][name] = {"h2d": bytes, "d2h": bytes}``, counted
as the bytes written on the destination side (a copy that also converts the dtype counts its
output). Copies that stay on one side of the bus are not counted (on the CPU nothing ever
crosses).

A group "spans nodes" when its ranks sit on more than one node of the topology; its
bytes are counted as inter-node. That is the link class ZeRO++'s claims are about.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class LedgerEntry:
    op: str
    group: str
    dtype: str
    payload_bytes: int   # bytes of the tensor handed to the collective (input side)
    sent_bytes: int      # bytes this rank sends, by the table above
    inter_node: bool


def sent_bytes(op: str, group_size: int, payload_bytes: int, is_source: bool = False) -> int:
    """Bytes one rank sends for *op* on a group of *group_size* ranks (see module docstring)."""
    n = group_size
    if n <= 1 or op == "barrier":
        return 0
    if op == "all_gather_into":
        return (n - 1) * payload_bytes
    if op in ("reduce_scatter", "all_to_all_single"):
        return (n - 1) * payload_bytes // n
    if op == "all_reduce":
        return 2 * (n - 1) * payload_bytes // n
    if op == "broadcast":
        return payload_bytes if is_source else 0
    raise ValueError(f"unknown collective {op!r}")


class CommLedger:
    """Per-rank record of collectives. Thread-safe: async ops may record from helpers."""

    def __init__(self, keep_entries: int = 0):
        self._lock = threading.Lock()
        self._keep = keep_entries
        self.entries: list[LedgerEntry] = []
        self._totals: dict[tuple[str, bool], list[int]] = defaultdict(lambda: [0, 0, 0])
        self._staging: dict[str, list] = defaultdict(lambda: [0, 0.0])
        self._transfers: dict[tuple[str, str], int] = defaultdict(int)

    def record(self, entry: LedgerEntry) -> None:
        with self._lock:
            t = self._totals[(entry.op, entry.inter_node)]
            t[0] += 1
            t[1] += entry.payload_bytes
            t[2] += entry.sent_bytes
            if self._keep and len(self.entries) < self._keep:
                self.entries.append(entry)

    def record_staging(self, op: str, nbytes: int, seconds: float) -> None:
        """Device<->host copies made to carry one *op* through host buffers."""
        with self._lock:
            t = self._staging[op]
            t[0] += nbytes
            t[1] += seconds

    def record_copy(self, what: str, dst, src) -> None:
        """Count ``dst.copy_(src)`` (or ``src.to(dst.device)``) under *what* when it crosses
        between host and device; same-side copies are free and not counted."""
        if dst.device.type == src.device.type:
            return
        direction = "d2h" if dst.device.type == "cpu" else "h2d"
        with self._lock:
            self._transfers[(what, direction)] += dst.numel() * dst.element_size()

    def snapshot(self) -> dict:
        """Totals so far: ``{"ops": {op: {"calls", "payload_bytes", "sent_bytes",
        "inter_node_bytes", "intra_node_bytes", "staged_bytes", "staging_s"}},
        "sent_bytes", "inter_node_bytes", "intra_node_bytes", "staged_bytes", "staging_s"}``."""
        with self._lock:
            ops: dict[str, dict[str, int]] = {}
            for (op, inter), (calls, payload, sent) in self._totals.items():
                d = ops.setdefault(op, dict(calls=0, payload_bytes=0, sent_bytes=0,
                                            inter_node_bytes=0, intra_node_bytes=0))
                d["calls"] += calls
                d["payload_bytes"] += payload
                d["sent_bytes"] += sent
                d["inter_node_bytes" if inter else "intra_node_bytes"] += sent
            for d in ops.values():
                d.setdefault("staged_bytes", 0)
                d.setdefault("staging_s", 0.0)
            for op, (staged, seconds) in self._staging.items():
                if op in ops:
                    ops[op]["staged_bytes"], ops[op]["staging_s"] = staged, seconds
            transfers: dict[str, dict[str, int]] = {}
            for (what, direction), nbytes in self._transfers.items():
                transfers.setdefault(what, {"h2d": 0, "d2h": 0})[direction] = nbytes
        return {
            "ops": ops,
            "transfers": transfers,
            "sent_bytes": sum(d["sent_bytes"] for d in ops.values()),
            "inter_node_bytes": sum(d["inter_node_bytes"] for d in ops.values()),
            "intra_node_bytes": sum(d["intra_node_bytes"] for d in ops.values()),
            "staged_bytes": sum(d["staged_bytes"] for d in ops.values()),
            "staging_s": sum(d["staging_s"] for d in ops.values()),
        }

    @staticmethod
    def difference(after: dict, before: dict) -> dict:
        """What happened between two snapshots (for per-step reports)."""
        ops = {}
        for op, d in after["ops"].items():
            b = before["ops"].get(op, {})
            ops[op] = {k: v - b.get(k, 0) for k, v in d.items()}
        ops = {op: d for op, d in ops.items() if d["calls"]}
        transfers = {}
        for what, d in after.get("transfers", {}).items():
            b = before.get("transfers", {}).get(what, {})
            moved = {k: v - b.get(k, 0) for k, v in d.items()}
            if any(moved.values()):
                transfers[what] = moved
        return {
            "ops": ops,
            "transfers": transfers,
            "sent_bytes": after["sent_bytes"] - before["sent_bytes"],
            "inter_node_bytes": after["inter_node_bytes"] - before["inter_node_bytes"],
            "intra_node_bytes": after["intra_node_bytes"] - before["intra_node_bytes"],
            "staged_bytes": after.get("staged_bytes", 0) - before.get("staged_bytes", 0),
            "staging_s": after.get("staging_s", 0.0) - before.get("staging_s", 0.0),
        }

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()
            self._staging.clear()
            self._transfers.clear()
            self.entries.clear()
