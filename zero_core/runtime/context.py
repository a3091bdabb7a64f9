"""The process-wide runtime: launch info, topology, accelerator, communicator, kernels.

``init_distributed()`` is called by ``zero_core.initialize`` and may be called directly.
It is idempotent: the first call decides, later calls return the same runtime (and
refuse conflicting arguments).

Backends are reached through the plugin registry only, never imported: starting
torch.distributed (which the runtime promises next to every communicator, so that user
code calling it works) is done by the registry's ``gloo`` communicator class through
:meth:`Communicator.start_torch_distributed
<zero_core.interfaces.communicator.Communicator.start_torch_distributed>`; the start-up
code and its MPI rendezvous live with the torch.distributed communicators
(``zero_core.backends.comm.torch_dist_init``).

It also installs the failure report (``runtime/failures.py``): an uncaught error in a
multi-rank job is printed once, by the first rank to raise it.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from zero_core.runtime import registry as _registry
from zero_core.interfaces.accelerator import Accelerator
from zero_core.interfaces.communicator import Communicator
from zero_core.errors import ConfigError
from zero_core.interfaces.kernels import KernelSet
from zero_core.runtime.failures import install_failure_report
from zero_core.runtime.launch import LaunchInfo, discover, env_setting
from zero_core.runtime.partition_comm import forget as forget_partition_groups
from zero_core.runtime.topology import Topology, resolve_ranks_per_node

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class Runtime:
    launch: LaunchInfo
    topology: Topology
    accelerator: Accelerator
    comm: Communicator
    kernels: KernelSet
    device: torch.device

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size


_RUNTIME: Runtime | None = None


def comm_timeout(value: float | None = None) -> float:
    """Collective timeout in seconds: *value*, else ZERO_CORE_COMM_TIMEOUT, else 300."""
    if value is None:
        value = env_setting("ZERO_CORE_COMM_TIMEOUT", float, "a number of seconds")
    value = DEFAULT_TIMEOUT_S if value is None else float(value)
    if value <= 0:
        raise ConfigError(f"comm_timeout={value} must be a positive number of seconds")
    return value


def init_distributed(accelerator: str | None = None, comm_backend: str | None = None,
                     timeout: float | None = None, ranks_per_node: int | None = None) -> Runtime:
    """Pick the accelerator and communicator (config → environment → auto-detect), connect
    to the peers, and return the process-wide :class:`Runtime`."""
    global _RUNTIME
    # scripts and integrations that start here rather than in initialize() get the
    # once-per-job error report too (idempotent)
    install_failure_report()
    if _RUNTIME is not None:
        rt = _RUNTIME
        if accelerator and accelerator != rt.accelerator.name:
            raise ConfigError(f"accelerator {accelerator!r} asked for, but this process already "
                              f"runs on {rt.accelerator.name!r}; use one accelerator per process")
        if comm_backend and comm_backend != rt.comm.name:
            raise ConfigError(f"comm_backend {comm_backend!r} asked for, but this process already "
                              f"communicates through {rt.comm.name!r}; use one per process")
        if ranks_per_node is not None and ranks_per_node != rt.topology.ranks_per_node:
            raise ConfigError(f"topology.ranks_per_node={ranks_per_node} asked for, but this "
                              f"process already runs with {rt.topology.ranks_per_node} ranks per "
                              f"node; the topology is fixed by the first initialization")
        if timeout is not None and comm_timeout(timeout) != rt.comm.timeout:
            raise ConfigError(f"comm_timeout={timeout} asked for, but this process's communicator "
                              f"already uses {rt.comm.timeout:g} s; it is fixed by the first "
                              f"initialization")
        return rt
    reg = _registry.load()
    launch = discover()
    acc_cls = reg.accelerator_class(accelerator)
    acc = acc_cls()
    comm_cls = reg.communicator_class(comm_backend, default=acc.default_comm_for(launch))
    topology = resolve_ranks_per_node(launch.world_size, launch.local_world_size, ranks_per_node)
    acc.set_device(launch.local_rank)
    device = acc.device(launch.local_rank)
    comm = comm_cls(launch, topology, timeout=comm_timeout(timeout))
    # tensors the communicator cannot reach (device tensors over gloo/MPI, host tensors over
    # nccl) go through stand-in buffers on the other side
    comm.enable_staging(acc, device)
    # user scripts and libraries expect torch.distributed to answer get_rank()/barrier():
    # the gloo communicator starts it (a no-op if the communicator already did)
    reg.communicator_class("gloo").start_torch_distributed(launch, comm.timeout)
    kernels = reg.kernel_set(acc.kernel_set)
    _RUNTIME = Runtime(launch, topology, acc, comm, kernels, device)
    return _RUNTIME


def get_runtime() -> Runtime:
    """The runtime made by :func:`init_distributed` (which it calls with defaults if needed)."""
    return _RUNTIME if _RUNTIME is not None else init_distributed()


def shutdown() -> None:
    """Tear down the communicator and torch.distributed (for tests and clean exits)."""
    global _RUNTIME
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Tear down together: a rank that closes its gloo connections while a peer's
        # background threads still serve them can make that peer abort at exit
        # ("terminate called without an active exception", seen under torchrun).
        try:
            dist.barrier()
        except Exception:  # a dead peer: nothing left to synchronize with
            pass
    comm = None
    if _RUNTIME is not None:
        comm = _RUNTIME.comm
        forget_partition_groups(comm)
        comm.shutdown()
        _RUNTIME = None
    if dist.is_initialized():
        dist.destroy_process_group()
    if comm is not None:
        comm.release_groups()
        gc.collect()   # the process groups go now, not during interpreter finalization
