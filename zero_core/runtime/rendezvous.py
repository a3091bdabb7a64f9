"""Launcher-side rendezvous helper: a free TCP port for a launcher that sets MASTER_PORT.

Used by ``zero_core.testing.run_ranks`` when it starts ranks torchrun-style. The
rendezvous that torch.distributed needs at start-up (MASTER_ADDR/PORT under launchers that
do not set them, shared through MPI under mpirun) is part of starting torch.distributed
and lives with the torch.distributed communicators, in
``zero_core.backends.comm.torch_dist_init``, together with its own ``free_port``: the
layering rule (engine -> interfaces <- backends) lets neither side import the other, and
the helper is four lines.
"""
from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port the OS reports free on *host* ("" = every interface) right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
