"""Launch discovery: which rank am I, how many are we, and who launched us.

Read in the order of ARCHITECTURE §3: torchrun, Open MPI, MPICH / Intel MPI / Hydra,
PMIx, Slurm; with none of them set we are a single process, which
:func:`single_process_notice` says once (a user who meant several ranks sees it at once).
Also here: :func:`env_setting` and :func:`env_flag`, zero-core's readers of its own
environment variables.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from zero_core.errors import ConfigError


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


_REQUIRED = object()


def _int(env, key, default=_REQUIRED):
    """Integer value of *key*; *default* when unset (a missing required key is an error)."""
    value = env.get(key)
    if value is None or value == "":
        if default is _REQUIRED:
            raise ConfigError(f"environment variable {key} is not set although the other "
                              f"variables of its launcher are; launch through the launcher "
                              f"itself or set {key} too")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {key}={value!r} is not an integer; "
                          f"fix or unset it (it is read to find this process's rank)") from None


def env_setting(name: str, convert, what: str, env: dict | None = None):
    """A zero-core setting from environment variable *name* converted by *convert*; None
    when unset or empty. A value *convert* refuses is an error saying it is not *what*."""
    value = (os.environ if env is None else env).get(name)
    if not value:
        return None
    try:
        return convert(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not {what}") from None


def _slurm_tasks_on_node(env, world: int) -> int:
    """Tasks on this rank's node under Slurm.

    ``SLURM_NTASKS_PER_NODE`` is only set with ``--ntasks-per-node``; the always-present
    ``SLURM_TASKS_PER_NODE`` is a compressed per-node list such as ``"2(x3),1"`` (three
    nodes with 2 tasks, then one with 1), indexed by ``SLURM_NODEID``.
    """
    explicit = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if explicit.isdigit():
        return int(explicit)
    counts: list[int] = []
    for item in filter(None, env.get("SLURM_TASKS_PER_NODE", "").split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            return world  # unknown format: treat the job as one node rather than guess
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not counts:
        return world
    node = _int(env, "SLURM_NODEID", 0)
    return counts[node] if 0 <= node < len(counts) else counts[0]


def _checked(info: LaunchInfo, variables: str) -> LaunchInfo:
    """Refuse launcher values that cannot describe a real job (e.g. a stale RANK)."""
    if not (info.world_size >= 1 and 0 <= info.rank < info.world_size
            and 1 <= info.local_world_size <= info.world_size
            and 0 <= info.local_rank < info.local_world_size):
        raise ConfigError(
            f"{info.launcher} launch variables are inconsistent: rank={info.rank}, "
            f"world_size={info.world_size}, local_rank={info.local_rank}, local_world_size="
            f"{info.local_world_size} (need 0 <= rank < world_size and 0 <= local_rank < "
            f"local_world_size <= world_size). Check or unset {variables}.")
    return info


def discover(env: dict | None = None) -> LaunchInfo:
    """Read the launcher's environment variables (``os.environ`` unless *env* is given).

    Raises :class:`~zero_core.errors.ConfigError` (a ValueError) when a variable is not
    an integer or the values are inconsistent.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return _checked(LaunchInfo(_int(env, "RANK"), world, _int(env, "LOCAL_RANK", 0),
                                   _int(env, "LOCAL_WORLD_SIZE", world), "torchrun"),
                        "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE")
    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        return _checked(LaunchInfo(_int(env, "OMPI_COMM_WORLD_RANK"), world,
                                   _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
                                   _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world), "openmpi"),
                        "OMPI_COMM_WORLD_*")
    if "PMI_RANK" in env:
        world = _int(env, "PMI_SIZE")
        return _checked(LaunchInfo(_int(env, "PMI_RANK"), world, _int(env, "MPI_LOCALRANKID", 0),
                                   _int(env, "MPI_LOCALNRANKS", world), "mpich"),
                        "PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS")
    if "PMIX_RANK" in env:
        # PMIx alone does not export the job size; Open MPI 5 sets OMPI_* alongside it, and
        # other PMIx launchers set PMIX_SIZE or Slurm's variables.
        world = _int(env, "PMIX_SIZE", _int(env, "SLURM_NTASKS", None))
        if world is None:
            raise ConfigError("PMIX_RANK is set but the job size is not: set PMIX_SIZE "
                              "(or launch with mpirun / srun, which export it)")
        return _checked(LaunchInfo(_int(env, "PMIX_RANK"), world,
                                   _int(env, "PMIX_LOCAL_RANK", _int(env, "SLURM_LOCALID", 0)),
                                   _int(env, "PMIX_LOCAL_SIZE",
                                        _slurm_tasks_on_node(env, world)), "pmix"),
                        "PMIX_RANK, PMIX_SIZE, PMIX_LOCAL_RANK, PMIX_LOCAL_SIZE")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        return _checked(LaunchInfo(_int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0),
                                   _slurm_tasks_on_node(env, world), "slurm"),
                        "SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_TASKS_PER_NODE")
    return LaunchInfo(0, 1, 0, 1, "single")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str, env: dict | None = None, strict: bool = True) -> bool:
    """A yes/no setting from environment variable *name* (unset: no). A value that is
    neither is an error naming the accepted ones; with *strict* False it counts as no
    (for code that must not raise, such as the failure report's exception hook)."""
    raw = (os.environ if env is None else env).get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE or not strict:
        return False
    raise ConfigError(f"{name}={raw!r} is not a yes/no value: set it to one of "
                      f"{'/'.join(_TRUE[:3])} or {'/'.join(_FALSE[1:4])}, or unset it")


QUIET_ENV = "ZERO_CORE_QUIET"
_noticed = False  # once per process, however many engines it builds


def single_process_notice(launch: LaunchInfo, enabled: bool = True) -> None:
    """Say once, on stderr, that no launcher started this process, so a user who meant to
    train on several ranks sees at once that it runs on one. Silenced by *enabled* False
    (config ``"safety": {"launcher_notice": false}``) or ``ZERO_CORE_QUIET=1``."""
    global _noticed
    if _noticed or launch.launcher != "single" or not enabled or env_flag(QUIET_ENV):
        return
    _noticed = True
    print("zero-core: single process (world size 1): no launcher found — start with "
          "`mpirun -np N` or `torchrun --nproc-per-node N` for more ranks (silence: "
          f"{QUIET_ENV}=1 or config \"safety\": {{\"launcher_notice\": false}})",
          file=sys.stderr, flush=True)
