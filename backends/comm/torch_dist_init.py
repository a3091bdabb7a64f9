"""Starting torch.distributed: the env:// rendezvous and ``init_process_group``.

Owned here, next to the torch.distributed communicators, because starting torch.distributed
is a backend's job: the torch.distributed communicators start their default group with it,
the oneCCL communicator uses it to carry its unique id when no MPI is around, and the
runtime — which may import no backend — asks the registry's ``gloo`` communicator class to
start it (:meth:`~zero_core.interfaces.communicator.Communicator.start_torch_distributed`),
so that user code calling ``torch.distributed`` works whatever carries ZeRO's traffic.

Rendezvous under launchers that do not set MASTER_ADDR/PORT: under ``mpirun``, rank 0
picks its address and a free port and shares them through MPI (ARCHITECTURE §3), so
``mpirun -np N python train.py`` needs no extra environment. MPI itself is imported
through :func:`.mpi.import_mpi`, the MPI communicator's discovery (one install hint).
``zero_core.testing.ranks.free_port`` is the launcher-side twin of :func:`free_port`
(for torchrun-style test jobs): the layering rule lets neither side import the other.
"""
from __future__ import annotations

import datetime
import os
import socket

from zero_core.errors import BackendUnavailable

from .mpi import import_mpi


def free_port(host: str = "") -> int:
    """A TCP port the OS reports free on *host* ("" = every interface) right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _interface_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of every non-loopback interface that has one (Linux)."""
    import fcntl
    import struct
    found = []
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name[:15].encode()))
            except OSError:  # interface without an IPv4 address
                continue
        found.append((name, socket.inet_ntoa(packed[20:24])))
    return found


def _own_address() -> str:
    """An address of this host that peers on other hosts can reach.

    Order: ZERO_CORE_MASTER_IFNAME's address (or GLOO_SOCKET_IFNAME's, the interface gloo
    is told to use), the host name if it resolves to a non-loopback address, else the first
    non-loopback interface address. Hosts whose names do not resolve are common in clusters
    and containers, so the host name alone is not trusted.
    """
    wanted = os.environ.get("ZERO_CORE_MASTER_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME")
    addresses = []
    try:
        addresses = _interface_addresses()
    except (ImportError, OSError):
        pass
    if wanted:
        for name, addr in addresses:
            if name == wanted.split(",")[0]:
                return addr
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    if addresses:
        return addresses[0][1]
    raise BackendUnavailable(
        "cannot find an address of this host that other hosts can reach (its name does not "
        "resolve and no interface has an IPv4 address): export MASTER_ADDR and MASTER_PORT, "
        "or ZERO_CORE_MASTER_IFNAME=<interface>")


def ensure_master_addr(launch) -> None:
    """Set MASTER_ADDR / MASTER_PORT for torch.distributed's env:// rendezvous if unset."""
    if launch.world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return
    if not launch.is_mpi:
        raise BackendUnavailable(
            f"launched by {launch.launcher} with {launch.world_size} ranks but MASTER_ADDR / "
            f"MASTER_PORT are not set: export them (rank 0's address and a free port) or "
            f"launch with torchrun or mpirun, which provide them")
    comm = import_mpi().COMM_WORLD
    # One address for all ranks on the same host as rank 0 is not enough on several hosts:
    # rank 0 decides, everyone uses its answer.
    addr_port = None
    if comm.Get_rank() == 0:
        hosts = comm.gather(socket.gethostname(), root=0)
        single_host = len(set(hosts)) == 1
        addr_port = ("127.0.0.1" if single_host else _own_address(), free_port())
    else:
        comm.gather(socket.gethostname(), root=0)
    addr, port = comm.bcast(addr_port, root=0)
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def init_torch_distributed(launch, backend: str, timeout: float, device=None) -> None:
    """Initialize torch.distributed (if not yet) with *backend*, rendezvousing through the
    launcher; used by the torch.distributed communicators and, with gloo, alongside any
    other communicator so that user code calling torch.distributed keeps working."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    ensure_master_addr(launch)
    kwargs = {}
    if device is not None and device.type != "cpu":
        kwargs["device_id"] = device
    store = _elastic_attempt_store(launch, timeout)
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend=backend, rank=launch.rank, world_size=launch.world_size,
                            timeout=datetime.timedelta(seconds=timeout), **kwargs)


def _elastic_attempt_store(launch, timeout: float):
    """Under torchrun's elastic agent (which keeps one store for all restarts of the
    workers): the agent's store with a prefix of this restart, or None elsewhere.

    Why: with torch's own env:// rendezvous, the first restart after a worker was killed
    often fails in gloo's connectFullMesh with "Connection refused" — the new ranks find
    addresses the killed attempt published (reproduced with plain torch 2.13 and
    ``--rdzv-backend c10d``). Keys of this attempt under their own prefix cannot meet the
    dead attempt's."""
    import torch.distributed as dist
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                launch.world_size, False,
                                timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(f"/zero_core/{run}/attempt_{attempt}", agent_store)
