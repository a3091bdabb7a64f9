"""The network plumbing of the emulated cluster: namespaces, the veth link, tc shaping.

Small, stateless pieces that :mod:`zero_core.testing.emulated_cluster` builds its
``EmulatedCluster`` from: parsers of link rates and delays in tc notation, the tbf sizing,
``ip`` / ``tc`` calls that fail with a :class:`ClusterError` quoting the tool, and the
clean-up side: finding and removing the namespaces and links of a cluster prefix (ending
every process still inside them), the per-prefix lock that keeps a live cluster from being
taken for a leftover, and the check that a subnet is unused on this machine.

Needs root (CAP_NET_ADMIN / CAP_SYS_ADMIN), ``ip`` and ``tc`` (iproute2) for everything
but the parsers.
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from zero_core.errors import ZeroCoreError

DEFAULT_PREFIX = "zc"
DEFAULT_SUBNET = "10.231.7.0/30"
NUM_NODES = 2  # a veth pair joins exactly two namespaces
_TC_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_COMMAND_TIMEOUT_S = 30.0  # for each ip/tc call; they return in milliseconds normally


class ClusterError(ZeroCoreError):
    """The emulated cluster could not be set up, shaped, used or removed."""


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
def run_tool(cmd: list[str], check: bool = True, timeout: float = _COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
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


def ip_json(args: list[str], netns: str | None = None) -> list:
    cmd = ["ip"] + (["-n", netns] if netns else []) + ["-j"] + args
    out = run_tool(cmd).stdout.strip()
    return json.loads(out) if out else []


def list_namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    out = run_tool(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def node_names(prefix: str) -> tuple[list[str], list[str]]:
    return ([f"{prefix}-node{i}" for i in range(NUM_NODES)],
            [f"{prefix}-veth{i}" for i in range(NUM_NODES)])


def leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Namespaces and root-namespace links of clusters with *prefix* that exist now."""
    namespaces = [ns for ns in list_namespaces() if ns.startswith(f"{prefix}-node")]
    links = [link["ifname"] for link in ip_json(["link", "show"])
             if link.get("ifname", "").startswith(f"{prefix}-veth")]
    return namespaces + links


def kill_pids(pids: list[int], grace_s: float = 2.0) -> None:
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
        pids = [int(p) for p in run_tool(["ip", "netns", "pids", ns], check=False).stdout.split()]
        kill_pids(pids)
        run_tool(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    for link in ip_json(["link", "show"]):
        name = link.get("ifname", "")
        if name.startswith(f"{prefix}-veth"):  # a crash between `link add` and the move
            run_tool(["ip", "link", "del", name], check=False)
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


def subnet_conflicts(subnet: ipaddress.IPv4Network, own: set[str]) -> list[str]:
    """Addresses and routes on this machine (every namespace but ours) overlapping *subnet*."""
    found = []
    for ns in [None] + [n for n in list_namespaces() if n not in own]:
        where = f"namespace {ns}" if ns else "the root namespace"
        for link in ip_json(["-4", "addr", "show"], ns):
            for info in link.get("addr_info", []):
                net = ipaddress.ip_interface(f"{info['local']}/{info['prefixlen']}").network
                if net.overlaps(subnet):
                    found.append(f"{info['local']}/{info['prefixlen']} on {link['ifname']} in {where}")
        for route in ip_json(["-4", "route", "show", "table", "all"], ns):
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
