"""Launch discovery: which rank am I, how many are we, and who launched us.

Read in the order of DESIGN §3: torchrun, Open MPI, MPICH / Intel MPI / Hydra,
PMIx, Slurm; with none of them set we are a single process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as its launcher told it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # "torchrun", "openmpi", "mpich", "pmix", "slurm" or "single"

    @property
    def is_mpi(self) -> bool:
        """True when an MPI launcher started us (so MPI_Init is possible)."""
        return self.launcher in ("openmpi", "mpich", "pmix")


def _int(env, key, default=None):
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from exc


def discover(env: dict | None = None) -> LaunchInfo:
    """Read the launcher's environment variables (``os.environ`` unless *env* is given)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return LaunchInfo(_int(env, "RANK"), world, _int(env, "LOCAL_RANK", 0),
                          _int(env, "LOCAL_WORLD_SIZE", world), "torchrun")
    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        return LaunchInfo(_int(env, "OMPI_COMM_WORLD_RANK"), world,
                          _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
                          _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world), "openmpi")
    if "PMI_RANK" in env:
        world = _int(env, "PMI_SIZE")
        return LaunchInfo(_int(env, "PMI_RANK"), world, _int(env, "MPI_LOCALRANKID", 0),
                          _int(env, "MPI_LOCALNRANKS", world), "mpich")
    if "PMIX_RANK" in env:
        # PMIx alone does not export the job size; Open MPI 5 sets OMPI_* alongside it, and
        # other PMIx launchers set PMIX_SIZE or Slurm's variables.
        world = _int(env, "PMIX_SIZE", _int(env, "SLURM_NTASKS"))
        if world is None:
            raise ValueError("PMIX_RANK is set but the job size is not: set PMIX_SIZE "
                             "(or launch with mpirun / srun, which export it)")
        return LaunchInfo(_int(env, "PMIX_RANK"), world,
                          _int(env, "PMIX_LOCAL_RANK", _int(env, "SLURM_LOCALID", 0)),
                          _int(env, "PMIX_LOCAL_SIZE", world), "pmix")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        local_size = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        return LaunchInfo(_int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0),
                          int(local_size) if local_size.isdigit() else world, "slurm")
    return LaunchInfo(0, 1, 0, 1, "single")
