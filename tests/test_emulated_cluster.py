"""The emulated two-node cluster (zero_core/testing/emulated_cluster.py): shaping, placement,
clean-up, and run_ranks(cluster=...) starting the ranks inside its nodes.

Run as a script, this file is the rank program the tests launch inside the namespaces
(``bandwidth`` / ``crash`` / ``hang`` modes, see ``_rank_main``).

These tests need root (network namespaces, tc). CI runs as root; elsewhere they FAIL with
the reason rather than skip, because a skipped test would hide a harness that cannot run.
Timings are checked only in the direction the shaping guarantees (a shaped transfer cannot
beat its rate) or with wide margins (an unshaped one is far faster), so that load from
other jobs on the machine cannot make them flaky.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CLUSTER_CLI = [sys.executable, "-m", "zero_core.testing.emulated_cluster"]
# a prefix and subnet of the tests' own, so that a benchmark cluster ("zc", 10.231.7.0/30)
# running at the same time is neither waited for nor disturbed
PREFIX = "zctest"
SUBNET = "10.231.9.0/30"
PAYLOAD_BYTES = 4 << 20
SEED = 20240611


def _rank_main(argv: list[str]) -> None:
    """The rank program. ``bandwidth BYTES ITERS [COMM]``: time an all-gather of BYTES per
    rank between the two nodes' local rank 0 (crosses the link), then inside each node
    (does not), checking the gathered data, through communicator COMM (default gloo);
    ``crash``: the last rank dies after setup;
    ``hang``: every rank sleeps (to be killed at the timeout)."""
    import torch

    from zero_core.runtime import registry
    from zero_core.runtime.launch import discover
    from zero_core.runtime.context import comm_timeout
    from zero_core.testing.ranks import report
    from zero_core.runtime.topology import resolve_ranks_per_node

    mode = argv[0]
    if mode == "hang":
        time.sleep(3600)
    launch = discover()
    topology = resolve_ranks_per_node(launch.world_size, launch.local_world_size)
    backend = argv[3] if mode == "bandwidth" and len(argv) > 3 else "gloo"
    comm = registry.load().communicator_class(backend)(launch, topology, timeout=comm_timeout())
    rank, rpn = comm.rank, topology.ranks_per_node
    if mode == "crash":
        comm.barrier()
        if rank == comm.world_size - 1:
            os._exit(3)
        comm.all_reduce(torch.ones(1 << 20))  # the peer is gone: this must fail, not hang
        report({"rank": rank, "survived": True})
        return
    size, iters = int(argv[1]), int(argv[2])
    numel = size // 4
    inter = comm.new_group([0, rpn], name="pair")            # node 0 <-> node 1
    intra = comm.split(topology.intra_node_partition(), "node")

    def data(r: int, it: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(SEED + 1000 * it + r))

    def timed(group, it: int) -> float:
        comm.barrier()
        if not group.is_member or group.size == 1:
            comm.barrier()
            return 0.0
        out = torch.empty(numel * group.size)
        start = time.perf_counter()
        comm.all_gather_into(out, data(rank, it), group=group)
        elapsed = time.perf_counter() - start
        want = torch.cat([data(r, it) for r in group.ranks])
        assert torch.equal(out, want), f"all_gather on {group.name} delivered wrong data"
        comm.barrier()
        return elapsed

    before = comm.ledger.snapshot()
    inter_s = [timed(inter, it) for it in range(iters)]
    after_inter = comm.ledger.snapshot()
    intra_s = [timed(intra, 100 + it) for it in range(iters)]
    report({"rank": rank, "inter_s": inter_s, "intra_s": intra_s,
            "netns": os.readlink("/proc/self/ns/net"), "launcher": launch.launcher,
            "local_rank": launch.local_rank,
            "inter_ledger": comm.ledger.difference(after_inter, before),
            "intra_ledger": comm.ledger.difference(comm.ledger.snapshot(), after_inter)})
    comm.barrier()
    comm.shutdown()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
    sys.exit(0)

# ---- the tests (pytest) -------------------------------------------------------------------
import pytest  # noqa: E402

from zero_core.testing import emulated_cluster as ec  # noqa: E402
from zero_core.testing import netns  # noqa: E402
from zero_core.testing.ranks import MultiRankError, run_ranks  # noqa: E402


@pytest.fixture(scope="module")
def privileged():
    """Fail (not skip) when this machine cannot host the cluster, saying why."""
    problems = []
    if os.geteuid() != 0:
        problems.append(f"tests run as uid {os.geteuid()}, not root")
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            problems.append(f"`{tool}` (iproute2) is not installed")
    if problems:
        pytest.fail("the emulated-cluster tests need root and iproute2 to create network "
                    "namespaces and shape links (CI runs as root): " + "; ".join(problems),
                    pytrace=False)
    netns.cleanup(PREFIX)
    yield
    assert netns.leftovers(PREFIX) == [], "a test left namespaces or links behind"


def _cluster(**kw):
    kw.setdefault("prefix", PREFIX)
    kw.setdefault("subnet", SUBNET)
    kw.setdefault("lock_timeout", 120)
    return ec.EmulatedCluster(**kw)


# ---- pure functions -----------------------------------------------------------------------
def test_rate_and_delay_parsing():
    assert netns.parse_rate("10gbit") == 10 * 10**9
    assert netns.parse_rate("100mbit") == 10**8
    assert netns.parse_rate("2.5gbit") == 25 * 10**8
    assert netns.parse_rate("none") is None
    assert netns.format_rate(netns.parse_rate("100mbit")) == "100mbit"
    assert netns.format_rate(netns.parse_rate("2.5gbit")) == "2.5gbit"
    assert netns.parse_delay("2ms") == pytest.approx(2e-3)
    assert netns.parse_delay("150us") == pytest.approx(150e-6)
    for bad in ("fast", "10GB", "-5mbit", "0mbit"):
        with pytest.raises(ec.ClusterError, match="not understood|positive"):
            netns.parse_rate(bad)


def test_tbf_parameters_hold_a_gso_packet_and_a_millisecond():
    for rate in ("100mbit", "1gbit", "10gbit", "40gbit"):
        bps = netns.parse_rate(rate)
        burst, limit = netns.tbf_parameters(bps)
        assert burst >= 64 << 10 and burst >= bps / 8 * 1e-3
        assert limit >= burst


def test_bad_prefix_and_subnet_are_refused():
    with pytest.raises(ec.ClusterError, match="prefix"):
        ec.EmulatedCluster(prefix="Bad-Prefix!")
    with pytest.raises(ec.ClusterError, match="private"):
        ec.EmulatedCluster(subnet="8.8.8.0/30")
    with pytest.raises(ec.ClusterError, match="/30"):
        ec.EmulatedCluster(subnet="10.231.9.0/31")


def test_run_ranks_refuses_an_uneven_spread_and_a_cluster_that_is_down():
    cluster = ec.EmulatedCluster(prefix=PREFIX, subnet=SUBNET)  # not entered: not up
    with pytest.raises(ValueError, match="multiple of 2"):
        run_ranks(__file__, 3, args=["hang"], cluster=cluster)
    with pytest.raises(ec.ClusterError, match="needs the cluster up"):
        run_ranks(__file__, 2, args=["hang"], cluster=cluster)


def test_cli_help_runs():
    out = subprocess.run([*CLUSTER_CLI, "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("run", "hold", "cleanup", "check"):
        assert command in out.stdout


# ---- the cluster ----------------------------------------------------------------------
def test_subnet_in_use_is_refused(privileged):
    # loopback's 127.0.0.1/8 exists on every Linux machine
    with pytest.raises(ec.ClusterError, match="already used.*127.0.0.1/8"):
        with _cluster(subnet="127.0.0.0/30"):
            pass
    assert netns.leftovers(PREFIX) == []


def test_layout_and_shaping_as_configured(privileged):
    with _cluster(rate="100mbit") as cluster:
        namespaces = netns.list_namespaces()
        for node in cluster.nodes:
            assert node.namespace in namespaces
            addrs = netns.ip_json(["-4", "addr", "show", "dev", node.interface], node.namespace)
            assert addrs[0]["addr_info"][0]["local"] == node.address
            links = {l["ifname"]: l for l in netns.ip_json(["link", "show"], node.namespace)}
            assert set(links) == {"lo", node.interface}
            assert "UP" in links["lo"]["flags"]
        # the pair is not in the root namespace
        assert not any(l["ifname"].startswith(PREFIX) for l in netns.ip_json(["link", "show"]))
        for shown in cluster.qdiscs().values():
            assert "tbf" in shown and "100Mbit" in shown
        cluster.set_rate("1gbit")
        for shown in cluster.qdiscs().values():
            assert "tbf" in shown and "1Gbit" in shown
        cluster.set_rate("none")
        for shown in cluster.qdiscs().values():
            assert "tbf" not in shown
        env = cluster.rank_env(3, ranks_per_node=2, port=29555)
        assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == cluster.nodes[0].address
        assert env["GLOO_SOCKET_IFNAME"] == cluster.nodes[1].interface
        assert env["ZERO_CORE_RANKS_PER_NODE"] == "2"
    assert netns.leftovers(PREFIX) == []


def _bandwidth_run(cluster, iters: int):
    before = cluster.link_bytes()
    results = run_ranks(__file__, 4, args=["bandwidth", PAYLOAD_BYTES, iters], timeout=120,
                        cluster=cluster)
    after = cluster.link_bytes()
    crossed = {k: after[k] - before[k] for k in after}
    return {r.rank: r.report for r in results}, crossed


@pytest.mark.multirank
@pytest.mark.slow
def test_link_rate_shapes_inter_node_traffic_only(privileged):
    iters = 2
    with _cluster(rate="100mbit") as cluster:
        slow, crossed = _bandwidth_run(cluster, iters)
        burst, _ = netns.tbf_parameters(cluster.rate_bps)
        rate_bytes_s = cluster.rate_bps / 8
        # a shaped transfer cannot beat the rate (beyond one bucket of burst)
        floor_s = (PAYLOAD_BYTES - burst) / rate_bytes_s
        implied_s = PAYLOAD_BYTES / rate_bytes_s
        for rank in (0, 2):  # local rank 0 of each node: the pair across the link
            fastest = min(slow[rank]["inter_s"])
            assert fastest >= floor_s, (rank, fastest, floor_s)
            # ... and it gets the rate (or close to it): 2x covers gloo sending each
            # direction in turn, the rest is slack for a loaded machine
            assert fastest <= 3 * implied_s, (rank, fastest, implied_s)
            assert slow[rank]["inter_ledger"]["inter_node_bytes"] == iters * PAYLOAD_BYTES
        # intra-node all-gathers move as much per rank but do not touch the link: the fastest
        # of them beats the link's floor by far (the slowest only shows how loaded the two
        # cores were: 97 ms once, with three other jobs running)
        for rank in range(4):
            assert min(slow[rank]["intra_s"]) < 0.25 * implied_s, (rank, slow[rank]["intra_s"])
            assert slow[rank]["intra_ledger"]["inter_node_bytes"] == 0
            assert slow[rank]["intra_ledger"]["intra_node_bytes"] == iters * PAYLOAD_BYTES
        # what crossed the veth each way: the pair's payload plus headers, and not the
        # intra-node all-gathers (which would double it)
        for direction, sent in crossed.items():
            assert iters * PAYLOAD_BYTES <= sent <= 1.25 * iters * PAYLOAD_BYTES, (direction, sent)

        cluster.set_rate("10gbit")
        fast, _ = _bandwidth_run(cluster, iters)
        for rank in (0, 2):
            assert min(fast[rank]["inter_s"]) < 0.3 * min(slow[rank]["inter_s"]), (
                fast[rank]["inter_s"], slow[rank]["inter_s"])
    assert netns.leftovers(PREFIX) == []


@pytest.mark.multirank
def test_crashed_and_hung_ranks_leave_nothing_behind(privileged):
    with _cluster(rate="1gbit") as cluster:
        results = run_ranks(__file__, 2, args=["crash"], timeout=60, check=False,
                            env={"ZERO_CORE_COMM_TIMEOUT": "20"}, cluster=cluster)
        assert results[1].returncode == 3
        assert results[0].returncode not in (0, None), results[0].log  # noticed, did not hang
        assert results[0].report is None
        with pytest.raises(MultiRankError, match="killed at the timeout"):
            run_ranks(__file__, 2, args=["hang"], timeout=2, cluster=cluster)
        for node in cluster.nodes:  # the hung ranks are gone, not just abandoned
            pids = subprocess.run(["ip", "netns", "pids", node.namespace], capture_output=True,
                                  text=True).stdout.split()
            assert pids == []
    assert netns.leftovers(PREFIX) == []


@pytest.mark.multirank
def test_mpirun_places_ranks_in_both_nodes_and_mpi_traffic_is_shaped(privileged):
    size = 2 << 20
    with _cluster(rate="100mbit") as cluster:
        before = cluster.link_bytes()
        results = run_ranks(__file__, 2, launcher="mpirun", args=["bandwidth", size, 1, "mpi"],
                            timeout=90, cluster=cluster)
        crossed = {k: v - before[k] for k, v in cluster.link_bytes().items()}
        reports = [r.report for r in results]
        assert [r["launcher"] for r in reports] == ["openmpi", "openmpi"]
        assert [r["local_rank"] for r in reports] == [0, 0]
        assert reports[0]["netns"] != reports[1]["netns"]  # one rank in each node
        burst, _ = netns.tbf_parameters(cluster.rate_bps)
        floor_s = (size - burst) / (cluster.rate_bps / 8)
        for rep in reports:
            assert min(rep["inter_s"]) >= floor_s, (rep["inter_s"], floor_s)
            assert rep["inter_ledger"]["inter_node_bytes"] == size
        for direction, sent in crossed.items():
            assert size <= sent <= 1.25 * size + (256 << 10), (direction, sent)
    assert netns.leftovers(PREFIX) == []


def test_exception_inside_removes_the_cluster(privileged):
    with pytest.raises(RuntimeError, match="boom"):
        with _cluster(rate="1gbit"):
            assert len(netns.leftovers(PREFIX)) == 2
            raise RuntimeError("boom")
    assert netns.leftovers(PREFIX) == []


def test_leftovers_of_a_killed_run_are_removed_at_start(privileged):
    # what a SIGKILLed run can leave: a namespace with a process still in it, and a veth
    # still in the root namespace (killed between creating the pair and moving it)
    ns, link = f"{PREFIX}-node0", f"{PREFIX}-veth0"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", link, "type", "veth", "peer", "name", f"{PREFIX}-veth1"],
                   check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"])
    try:
        time.sleep(0.2)
        assert set(netns.leftovers(PREFIX)) >= {ns, link}
        with _cluster(rate="1gbit") as cluster:
            assert sleeper.wait(timeout=10) is not None  # ended by the clean-up
            assert len(netns.leftovers(PREFIX)) == 2  # just the fresh namespaces
            assert "tbf" in cluster.qdiscs()[ns]
        assert netns.leftovers(PREFIX) == []
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
        netns.cleanup(PREFIX)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + 15), (signal.SIGINT, 128 + 2),
                                       (signal.SIGKILL, -9)])
def test_signals_remove_the_cluster(privileged, sig, code):
    """SIGTERM/SIGINT: the process removes its cluster on the way out. SIGKILL cannot be
    caught: the next cluster of the same prefix removes what is left when it starts."""
    # SIGINT at its default disposition in the child: a job that a non-interactive shell
    # started in the background (`cmd &`) inherits SIGINT ignored, and Python then never
    # raises KeyboardInterrupt
    proc = subprocess.Popen([*CLUSTER_CLI, "hold", "--prefix", PREFIX,
                             "--subnet", SUBNET, "--rate", "100mbit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()  # printed once the cluster is up
        assert line.startswith("up:"), (line, proc.stderr.read() if proc.poll() is not None else "")
        assert len(netns.leftovers(PREFIX)) == 2
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == code, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGKILL:
        assert len(netns.leftovers(PREFIX)) == 2
        with _cluster(rate="1gbit"):
            # `ip netns add` of the same names succeeded: the old ones were removed first
            assert len(netns.leftovers(PREFIX)) == 2
    assert netns.leftovers(PREFIX) == []
