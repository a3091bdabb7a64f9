"""Launch discovery (zero_core.runtime.launch) on the environment each launcher really exports."""
import pytest

from zero_core.errors import ConfigError
from zero_core.runtime.launch import LaunchInfo, discover


def info(rank, world, local_rank, local_world, launcher):
    return LaunchInfo(rank, world, local_rank, local_world, launcher)


@pytest.mark.parametrize("env, expected", [
    # torchrun --nnodes 2 --nproc-per-node 4, third process of the second node
    ({"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
      "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, info(6, 8, 2, 4, "torchrun")),
    # a hand-made torch.distributed launch without the local variables: one node
    ({"RANK": "1", "WORLD_SIZE": "3"}, info(1, 3, 0, 3, "torchrun")),
    # Open MPI: mpirun -np 6 on 3 hosts of 2 slots
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     info(5, 6, 1, 2, "openmpi")),
    # MPICH / Intel MPI through Hydra
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     info(3, 4, 1, 2, "mpich")),
    # Hydra without the local variables (older MPICH): one node assumed
    ({"PMI_RANK": "2", "PMI_SIZE": "4"}, info(2, 4, 0, 4, "mpich")),
    # a PMIx launcher that exports its own sizes
    ({"PMIX_RANK": "3", "PMIX_SIZE": "4", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "2"},
     info(3, 4, 1, 2, "pmix")),
    # srun --mpi=pmix: PMIx rank, Slurm's sizes
    ({"PMIX_RANK": "2", "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
      "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}, info(2, 4, 0, 2, "pmix")),
    # Slurm with --ntasks-per-node
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
      "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODEID": "1"}, info(5, 8, 1, 4, "slurm")),
    # Slurm without --ntasks-per-node: the compressed per-node list, indexed by node
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0",
      "SLURM_TASKS_PER_NODE": "3(x2),1", "SLURM_NODEID": "2"}, info(6, 7, 0, 1, "slurm")),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1",
      "SLURM_TASKS_PER_NODE": "3(x2),1", "SLURM_NODEID": "1"}, info(4, 7, 1, 3, "slurm")),
    # nothing set: a single process
    ({}, info(0, 1, 0, 1, "single")),
    # unrelated variables do not make a launch
    ({"PATH": "/usr/bin", "RANK": "3"}, info(0, 1, 0, 1, "single")),
    # Slurm allocation (salloc) without srun: SLURM_PROCID alone is not a job step
    ({"SLURM_PROCID": "0", "SLURM_JOB_ID": "77"}, info(0, 1, 0, 1, "single")),
])
def test_each_launcher(env, expected):
    assert discover(env) == expected


def test_order_torchrun_first_then_open_mpi():
    """torchrun launched inside an mpirun/srun job: torchrun's variables describe the
    processes that will communicate, so they win (ARCHITECTURE §3 order)."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert discover(env).launcher == "torchrun"


def test_open_mpi_5_sets_pmix_too_and_open_mpi_wins():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "PMIX_RANK": "1"}
    got = discover(env)
    assert got == info(1, 2, 1, 2, "openmpi")
    assert got.is_mpi


def test_mpich_before_pmix_and_slurm():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMIX_RANK": "0", "PMIX_SIZE": "9",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "9"}
    assert discover(env) == info(1, 2, 0, 2, "mpich")


def test_is_mpi_only_for_mpi_launchers():
    assert discover({"PMI_RANK": "0", "PMI_SIZE": "1"}).is_mpi
    assert discover({"PMIX_RANK": "0", "PMIX_SIZE": "1"}).is_mpi
    assert not discover({"RANK": "0", "WORLD_SIZE": "1"}).is_mpi
    assert not discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).is_mpi
    assert not discover({}).is_mpi


def test_reads_os_environ_by_default(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    got = discover()
    assert (got.rank, got.world_size, got.launcher) == (2, 5, "torchrun")


@pytest.mark.parametrize("env, words", [
    ({"RANK": "one", "WORLD_SIZE": "2"}, ["RANK", "'one'", "not an integer"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": ""}, ["OMPI_COMM_WORLD_SIZE", "not set"]),
    ({"PMI_RANK": "0"}, ["PMI_SIZE", "not set"]),
    ({"PMIX_RANK": "0"}, ["PMIX_SIZE"]),
    ({"RANK": "4", "WORLD_SIZE": "4"}, ["rank=4", "world_size=4", "RANK"]),
    ({"RANK": "-1", "WORLD_SIZE": "4"}, ["rank=-1"]),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ["world_size=0"]),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["local_rank=2"]),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, ["local_world_size=4"]),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, ["slurm", "rank=3", "SLURM_PROCID"]),
])
def test_bad_values_are_refused_with_the_variable_named(env, words):
    with pytest.raises(ConfigError) as err:
        discover(env)
    assert isinstance(err.value, ValueError)  # callers that catch ValueError keep working
    for word in words:
        assert word in str(err.value)


def test_slurm_unknown_tasks_per_node_format_means_one_node():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "weird"}
    assert discover(env).local_world_size == 2
