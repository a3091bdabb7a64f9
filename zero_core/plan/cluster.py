"""Where a planned run would go: :class:`Cluster`, its checks, and its presets.

Units: bytes, bytes per second, FLOP per second — per rank unless the field says per node.
``inter_bandwidth`` is what one rank can push across nodes (a GPU's own NIC share), the
bandwidth the ring collectives of the ledger's convention see; ``intra_bandwidth`` is one
rank's share inside a node (NVLink, or shared memory between CPU processes).

Presets:

- ``gpu-cluster``: 8 GPUs per node with 80 GB each (A100/H100 80GB class), 2 TB host memory
  and 15 TB NVMe per node, 400 Gbit/s per GPU across nodes (one 400G NIC per GPU, as on
  DGX H100), 300 GB/s NVLink per GPU per direction (A100's NVLink 3: 600 GB/s both
  directions), PCIe 4 x16 host↔device 25 GB/s, 300 TFLOP/s of bf16 (dense peak 312 on A100;
  ~50 % of peak is the usual achieved figure for large transformer training, so the
  rate used is ``flops × efficiency`` = 150 TFLOP/s), compute/communication overlap 0.5;
  the optimizer step: a fused Adam on the GPU reads and writes ~28 bytes per element at
  ~2.8 TB/s, 1e11 elements/s; offloaded to the host, 2.5e8 elements/s per rank (a node's
  ~2e9 of a vectorised CPU Adam shared by 8 ranks);
- ``this-machine``: this host's memory and disk from the OS, ranks = its CPUs; the rates
  come from ``zero-core plan --measure`` (``measure.py``): ``flops`` is the measured
  training rate of a GPT block (``train_flops``), the optimizer rates the measured Adam
  step; device memory is host memory (a CPU "device"), shared by the ranks of the node.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, replace

from zero_core.plan.model import PlanError

GB = 10 ** 9
GBIT = 10 ** 9 / 8


@dataclass(frozen=True)
class Cluster:
    """A cluster's sizes and rates (see the module docstring for the units)."""

    name: str
    ranks: int
    ranks_per_node: int
    device_memory: float          # bytes per rank (device)
    host_memory: float            # bytes per node
    disk: float                   # bytes per node (NVMe / local disk for ZeRO-Infinity)
    intra_bandwidth: float        # bytes/s per rank, inside a node
    inter_bandwidth: float        # bytes/s per rank, across nodes
    host_device_bandwidth: float  # bytes/s per rank, device <-> host memory
    disk_bandwidth: float         # bytes/s per node (shared by its ranks)
    flops: float                  # FLOP/s per rank, peak of the compute dtype
    efficiency: float = 1.0       # fraction of *flops* a training step achieves
    overlap: float = 0.0          # fraction of communication hidden behind compute
    shared_host_device: bool = False  # device memory *is* host memory (CPU ranks)
    optimizer_rate: float = 1e11      # elements/s per rank, optimizer step on the device
    host_optimizer_rate: float = 2.5e8  # elements/s per rank, optimizer step on the host

    def __post_init__(self):
        if self.ranks < 1 or self.ranks_per_node < 1:
            raise PlanError(f"cluster {self.name}: ranks={self.ranks} and ranks_per_node="
                            f"{self.ranks_per_node} must be positive")
        if self.ranks % self.ranks_per_node:
            raise PlanError(f"cluster {self.name}: ranks_per_node={self.ranks_per_node} does not "
                            f"divide ranks={self.ranks}; every node must hold the same number "
                            f"of ranks (e.g. --ranks {self.ranks_per_node * -(-self.ranks // self.ranks_per_node)})")
        for key in ("device_memory", "host_memory", "intra_bandwidth", "inter_bandwidth",
                    "host_device_bandwidth", "disk_bandwidth", "flops", "optimizer_rate",
                    "host_optimizer_rate"):
            if not getattr(self, key) > 0:
                raise PlanError(f"cluster {self.name}: {key}={getattr(self, key)} must be "
                                f"positive (measure it with --measure or give it explicitly)")
        if not 0 < self.efficiency <= 1 or not 0 <= self.overlap <= 1:
            raise PlanError(f"cluster {self.name}: efficiency={self.efficiency} must be in "
                            f"(0, 1] and overlap={self.overlap} in [0, 1]")

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node

    def with_ranks(self, ranks: int, ranks_per_node: int | None = None) -> "Cluster":
        """The same hardware with another number of ranks (extrapolation)."""
        rpn = ranks_per_node or min(self.ranks_per_node, ranks)
        return replace(self, ranks=ranks, ranks_per_node=rpn)

    def describe(self) -> dict:
        return asdict(self)


def gpu_cluster(ranks: int = 64, ranks_per_node: int = 8) -> Cluster:
    """The stated GPU cluster of the module docstring."""
    return Cluster(name="gpu-cluster", ranks=ranks, ranks_per_node=ranks_per_node,
                   device_memory=80 * GB, host_memory=2000 * GB, disk=15000 * GB,
                   intra_bandwidth=300 * GB, inter_bandwidth=400 * GBIT,
                   host_device_bandwidth=25 * GB, disk_bandwidth=25 * GB, flops=300e12,
                   efficiency=0.5, overlap=0.5)


def host_facts(path: str = ".") -> dict:
    """This machine's CPUs, memory and free disk (at *path*) from the OS."""
    pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return {"cpus": os.cpu_count() or 1, "host_memory": pages * page,
            "disk": shutil.disk_usage(path).free}


def this_machine(measured: dict | None, ranks: int | None = None,
                 ranks_per_node: int | None = None, disk_dir: str = ".") -> Cluster:
    """This host as a cluster of CPU ranks; *measured*: ``measure.measure()``'s result
    (without it the rates are unknown and this is an error naming --measure); the disk is
    the free space at *disk_dir*."""
    if not measured:
        raise PlanError("the 'this-machine' cluster needs measured rates: run "
                        "`zero-core plan --measure` (about 30 s; --save-measurement FILE keeps "
                        "them for --measurement FILE), or pick --cluster gpu-cluster")
    if "train_flops" not in measured or "optimizer_rate" not in measured:
        raise PlanError("the measured rates predate the training-rate measurement (no "
                        "'train_flops' / 'optimizer_rate'): measure again with "
                        "`zero-core plan --measure --save-measurement FILE`")
    facts = host_facts(disk_dir)
    ranks = ranks or measured.get("ranks") or 2
    rpn = ranks_per_node or ranks
    return Cluster(name="this-machine", ranks=ranks, ranks_per_node=rpn,
                   device_memory=facts["host_memory"] / rpn, host_memory=facts["host_memory"],
                   disk=facts["disk"], intra_bandwidth=measured["intra_bandwidth"],
                   # a CPU cluster of such hosts would need its network measured; this
                   # assumes the same rate as between local ranks until then
                   inter_bandwidth=measured.get("inter_bandwidth", measured["intra_bandwidth"]),
                   host_device_bandwidth=measured["memcpy_bandwidth"],
                   disk_bandwidth=measured["disk_bandwidth"], flops=measured["train_flops"],
                   efficiency=1.0, overlap=0.0, shared_host_device=True,
                   optimizer_rate=measured["optimizer_rate"],
                   host_optimizer_rate=measured["optimizer_rate"])


PRESETS = ("this-machine", "gpu-cluster")
