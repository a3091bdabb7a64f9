"""The CPU accelerator: always available, the target of ``mpirun`` CPU clusters.

Memory figures are the kernel's view of this process: the resident set size now
(``VmRSS``) and its peak (``VmHWM``), both from ``/proc/self/status``. Linux resets the
peak to the current RSS when "5" is written to ``/proc/self/clear_refs``; where that is
impossible (not Linux, or a sandbox that forbids it) the peak is the peak since the
process started, and ``memory_stats()["peak_since"]`` says so.
"""
from __future__ import annotations

import os
import resource
import sys
import warnings

import torch

from zero_core.interfaces.accelerator import Accelerator, module_present


_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_MEMINFO = "/proc/meminfo"

# The communicator a CPU job uses when none is configured. Under an MPI launcher it is MPI:
# on a quiet machine (session 2, docs/benchmarks.md "Communication") ci/bench/comm.py measured zero-core's MPI
# communicator faster than its gloo one on every collective of a mebibyte or more, and
# ci/bench/engine.py / ci/bench/stage3.py had stages 1-3 as fast or faster over MPI. (Session 1
# had chosen gloo from runs where 8 jobs shared 2 cores: Open MPI busy-polls while it waits,
# which costs most when cores are oversubscribed.) Otherwise gloo, which needs no MPI.
# "comm_backend" or ZERO_CORE_COMM selects either. This is the one place to flip the choice.
COMM_UNDER_MPI_LAUNCHER = "mpi"
COMM_OTHERWISE = "gloo"


def default_cpu_comm(launch) -> str:
    """The communicator for a CPU job launched as *launch* (a LaunchInfo or None)."""
    if launch is not None and launch.is_mpi and module_present("mpi4py"):
        return COMM_UNDER_MPI_LAUNCHER
    return COMM_OTHERWISE


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (e.g. "VmRSS") in bytes, None if unreadable."""
    try:
        with open(_STATUS) as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rusage_peak_bytes() -> int:
    """Peak RSS since process start from getrusage (kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """Resident set size of this process now, in bytes."""
    rss = _status_bytes("VmRSS")
    if rss is not None:
        return rss
    try:  # /proc/self/statm: size resident shared ... in pages
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        # no /proc (macOS...): the best figure available is the lifetime peak
        return _rusage_peak_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset (or process start), in bytes."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else _rusage_peak_bytes()


def reset_peak_rss() -> str | None:
    """Reset the kernel's peak-RSS counter to the current RSS; return None on success or
    the reason it cannot be reset here."""
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        return None
    except OSError as exc:
        return f"cannot write {_CLEAR_REFS} ({exc.strerror or exc})"


def total_memory_bytes() -> int:
    """Physical memory of the machine, in bytes (MemTotal)."""
    try:
        with open(_MEMINFO) as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return 0


class CpuAccelerator(Accelerator):
    """Host CPUs. Synchronous: streams and events are no-ops, pinning is pointless."""

    name = "cpu"
    priority = 0
    default_comm = COMM_OTHERWISE
    kernel_set = "cpu"

    def __init__(self):
        # None while resets work; the reason once one has failed (then peaks are lifetime)
        self._reset_unsupported: str | None = None

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return True, ""

    def device_type(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def device(self, local_rank: int = 0) -> torch.device:
        # every rank shares the host; tensors report their device as plain "cpu"
        return torch.device("cpu")

    def default_comm_for(self, launch) -> str:
        return default_cpu_comm(launch)

    # ---- memory -----------------------------------------------------------------------
    def memory_allocated(self) -> int:
        """Resident set size of this process, in bytes."""
        return rss_bytes()

    def max_memory_allocated(self) -> int:
        """Peak resident set size since the last reset, in bytes (see module docstring)."""
        return max(peak_rss_bytes(), rss_bytes())

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak: the peak becomes the current RSS (Linux)."""
        if self._reset_unsupported is not None:
            return
        why = reset_peak_rss()
        if why is not None:
            self._reset_unsupported = why
            warnings.warn(f"the CPU peak-memory counter cannot be reset here: {why}; "
                          f"max_memory_allocated() reports the peak since process start",
                          RuntimeWarning, stacklevel=2)

    def memory_stats(self) -> dict:
        """RSS now, peak RSS, total RAM (bytes) and what the peak is measured from."""
        return {"allocated": self.memory_allocated(), "peak": self.max_memory_allocated(),
                "total": self.total_memory(),
                "peak_since": ("last reset_peak_memory_stats()" if self._reset_unsupported is None
                               else f"process start ({self._reset_unsupported})")}

    def total_memory(self) -> int:
        """Physical RAM of the machine, in bytes."""
        return total_memory_bytes()

    def describe(self) -> dict:
        facts = super().describe()
        facts.update(cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                     total_memory=self.total_memory())
        return facts
