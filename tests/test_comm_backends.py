"""Backend specifics of the gloo and MPI communicators (the generic contract is checked by
the conformance suite in tests/conformance).

Multi-rank tests launch real processes with ``zero_core.testing.ranks.run_ranks``; their rank
programs are in tests/workers/comm_*.py.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from zero_core.backends.comm import ScratchPool, reduce_rows_into, refuse_integer_average
from zero_core.backends.comm.mpi import MpiCommunicator
from zero_core.backends.comm.torch_dist import (CclCommunicator, GlooCommunicator,
                                                HcclCommunicator, NcclCommunicator,
                                                XcclCommunicator)
from zero_core.interfaces.communicator import Group
from zero_core.errors import CommError
from zero_core.testing.ranks import run_ranks

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
LAUNCHER = {"gloo": "torchrun", "mpi": "mpirun"}


def _worker(name: str) -> str:
    return os.path.join(WORKERS, name)


# ---- single process ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_16bit_rows_are_accumulated_in_fp32_and_rounded_once(dtype, op):
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    rows = (torch.randn(4, 4096, generator=g, dtype=torch.float64) * 3).to(dtype)
    out = torch.empty(4096, dtype=dtype)
    reduce_rows_into(out, rows, op)
    exact = rows.to(torch.float64).sum(0)
    if op == "avg":
        exact = exact / 4
    # an fp32 sum of 4 16-bit values is exact up to fp32 rounding; the only visible error
    # is the final rounding to 16 bits: at most half an ulp of the dtype
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((out.to(torch.float64) - exact).abs() <= ulp * 0.5 + 1e-6 * exact.abs()).all()
    # and it is strictly better than summing in the 16-bit dtype itself on these inputs
    naive = rows[0].clone()
    for r in rows[1:]:
        naive += r
    if op == "avg":
        naive /= 4
    ours = (out.to(torch.float64) - exact).abs().sum()
    assert ours <= (naive.to(torch.float64) - exact).abs().sum()


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_min_rows_pick_an_input_value(op):
    rows = torch.randn(3, 100).to(torch.bfloat16)
    out = torch.empty(100, dtype=torch.bfloat16)
    reduce_rows_into(out, rows, op)
    want = rows.amax(0) if op == "max" else rows.amin(0)
    assert torch.equal(out, want)


def test_integer_average_is_refused_with_a_fix():
    group = Group("g", (0, 1), 0, False)
    with pytest.raises(CommError, match="op='sum' and divide"):
        refuse_integer_average("all_reduce", "avg", torch.int32, group)
    refuse_integer_average("all_reduce", "avg", torch.bfloat16, group)
    refuse_integer_average("all_reduce", "sum", torch.int8, group)


def test_scratch_buffers_are_reused_but_never_shared_while_taken():
    pool = ScratchPool(max_free=2)
    a, a_buf = pool.take(1000, torch.float32)
    b, b_buf = pool.take(1000, torch.float32)
    assert a.data_ptr() != b.data_ptr()          # both in flight: distinct memory
    assert a.dtype == torch.float32 and a.numel() == 1000
    pool.give_back(a_buf)
    c, c_buf = pool.take(1500, torch.bfloat16)   # 3000 bytes fit in a's 4000
    assert c.data_ptr() == a.data_ptr() and c.numel() == 1500
    d, _ = pool.take(2000, torch.float32)        # nothing free fits: a new buffer
    assert d.data_ptr() not in (b.data_ptr(), c.data_ptr())
    for buf in (b_buf, c_buf):
        pool.give_back(buf)
    pool.give_back(torch.empty(10, dtype=torch.uint8))
    assert len(pool._free) == 2 and min(x.numel() for x in pool._free) == 4000


def test_cpu_backends_are_available_here():
    assert GlooCommunicator.availability() == (True, "")
    assert MpiCommunicator.availability() == (True, "")


@pytest.mark.parametrize("cls, words", [
    (NcclCommunicator, "CUDA"), (HcclCommunicator, "habana"),
    (CclCommunicator, "oneccl"), (XcclCommunicator, "XPU")])
def test_hardware_backends_say_why_they_are_unavailable(cls, words):
    ok, why = cls.availability()
    assert not ok
    assert words.lower() in why.lower()
    assert "install" in why or "visible" in why  # says what to do about it


# ---- multi-rank -------------------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("nprocs", [2, 4])
def test_every_collective_matches_float64_reference(backend, nprocs):
    """All collectives, 7 dtypes, 4 reduce ops, world + two kinds of subgroups, async ops
    in flight together; bf16/fp16 reductions within the rounding bound; and each
    backend's other route (gloo's own all-gather/reduce-scatter, MPI's composite
    all-reduce for every dtype)."""
    seed = random.randrange(1 << 20)
    results = run_ranks(_worker("comm_collectives.py"), nprocs, launcher=LAUNCHER[backend],
                        args=[backend, seed], timeout=400)
    for r in results:
        assert r.report is not None, r.log[-3000:]
        assert r.report["failures"] == [], f"seed {seed}: {r.report['failures'][:10]}"
        assert r.report["checks"] > 200
    # on the world, with each backend's default routes, every reduce-scatter went as the
    # all-to-all it is carried by, and the ledger says so
    ops = results[0].report["ledger_world_default_routes"]["ops"]
    assert "reduce_scatter" not in ops
    assert ops["all_to_all_single"]["calls"] > 0 and ops["all_gather_into"]["sent_bytes"] > 0


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_async_collectives_progress_while_the_caller_computes(backend):
    """Rank 0 starts each collective asynchronously and runs matmuls for 1.5 s; rank 1
    joins synchronously. With real background progress rank 1 is done long before rank 0
    stops computing (Open MPI's Iallreduce without a progress thread took >= the compute
    time in the same setup, which is why the MPI communicator uses a worker thread)."""
    compute = 1.5
    results = run_ranks(_worker("comm_overlap.py"), 2, launcher=LAUNCHER[backend],
                        args=[backend, compute], timeout=300)
    peer = results[1].report["peer_seconds"]
    assert set(peer) == {"all_reduce", "all_gather_into", "reduce_scatter", "all_to_all_single"}
    for op, seconds in peer.items():
        assert seconds < compute / 2, f"{op}: the peer waited {seconds:.2f} s for rank 0's compute"
    if backend == "mpi":
        assert all(results[0].report["done_before_wait"].values())


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_runtime_under_mpirun_without_master_addr(backend):
    """mpirun sets no MASTER_ADDR/PORT: rank 0's address and a free port are shared through
    MPI, and torch.distributed works next to the communicator (even with one of its
    collectives in flight)."""
    results = run_ranks(_worker("comm_runtime.py"), 2, launcher="mpirun", args=[backend],
                        timeout=300)
    reports = [r.report for r in results]
    assert all(rep["env_before"] == {"MASTER_ADDR": None, "MASTER_PORT": None} for rep in reports)
    assert reports[0]["master"] == reports[1]["master"] and reports[0]["master"][1]
    for i, rep in enumerate(reports):
        assert rep["comm"] == backend
        assert rep["dist_initialized"] and rep["dist_rank"] == i and rep["dist_world"] == 2
        assert rep["dist_sum"] == 3.0 and rep["comm_sum"] == 3.0
        assert rep["dist_gather"] == [0.0, 1.0]


@pytest.mark.multirank
def test_bench_comm_runs_and_reports_nccl_tests_bandwidths(tmp_path):
    """ci/bench/comm.py --launch 2 re-launches itself under mpirun and prints the table."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_json = tmp_path / "bench.json"
    out = subprocess.run([sys.executable, os.path.join(root, "ci", "bench", "comm.py"), "--launch",
                          "2", "--quick", "--max-size", "64K", "--iters", "3", "--json",
                          str(out_json)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        assert f"**{op}**" in out.stdout
    data = json.loads(out_json.read_text())
    assert data["world_size"] == 2
    assert {r["bytes"] for r in data["results"]} == {4096, 65536}
    for row in data["results"]:
        factor = 2 * (2 - 1) / 2 if row["op"] == "all_reduce" else (2 - 1) / 2
        for name, m in row["measurements"].items():
            assert m["time_ms"] > 0
            assert m["algbw_GBps"] == pytest.approx(row["bytes"] / (m["time_ms"] / 1e3) / 1e9)
            assert m["busbw_GBps"] == pytest.approx(m["algbw_GBps"] * factor)


def test_a_device_only_backend_starts_torch_distributed_with_gloo_beside_it():
    """nccl/hccl/xccl carry device tensors only: the default group they start must also
    have a host backend, or host-side torch.distributed calls (user code, the conformance
    suite's control plane) fail with "no backend type associated with device type cpu"."""
    from zero_core.backends.comm.torch_dist import default_group_backend, uses_backend
    assert default_group_backend("gloo", ("cpu",)) == "gloo"
    assert default_group_backend("ccl", ("xpu", "cpu")) == "ccl"
    assert default_group_backend("nccl", ("cuda",)) == "cpu:gloo,cuda:nccl"
    assert default_group_backend("hccl", ("hpu",)) == "cpu:gloo,hpu:hccl"
    assert uses_backend("cpu:gloo,cuda:nccl", "nccl") and uses_backend("nccl", "nccl")
    assert uses_backend("gloo", "gloo") and not uses_backend("gloo", "nccl")
