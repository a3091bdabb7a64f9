"""ZeRO-Offload / ZeRO-Infinity on real ranks: offloaded training is bit-identical to
training without offload.

The worker (tests/workers/offload_train.py) trains a small model with two parameter
groups, a frozen layer, gradient accumulation and active clipping, with tiny buckets,
sub-groups (1100 → 1024 elements, so sub-groups and buckets cut each other), three swap
slots and, at stage 3, small fetch units with a tight live window, so that every path of
the offloaded step runs: pieces of a bucket in two sub-groups, read-ahead across
parameter groups and across steps, write-behind, parameter units read ahead from disk,
staging buffers recycled, the max_in_cpu cache.

Why bit-identical and not "close": the offloaded step runs the same fused CPU kernel on
the same fp32 values (gradients are copied, then scaled, exactly as on the device), and
the kernel is element-wise with every piece starting on an alignment boundary; the
updated values are rounded to the compute dtype by a copy, as the kernel's ``param_lowp``
does. So any difference, even one ulp, is a bug (a stale read, a lost write, a piece
written to the wrong place). The runs without offload are themselves checked against
single-process references by tests/test_engine_multirank.py and
tests/test_stage3_multirank.py.
"""
from __future__ import annotations

import json
import os

import pytest

from zero_core.testing.ranks import mpirun_path, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "offload_train.py")
COMM = {"torchrun": "gloo", "mpirun": "mpi"}

pytestmark = pytest.mark.multirank

needs_mpirun = pytest.mark.skipif(mpirun_path() is None,
                                  reason="mpirun not installed: pip install 'zero-core[mpi]'")


def _train(name, stage, precision="fp32", opt="none", param="none"):
    return ["train", name, stage, precision, opt, param]


def _variants(stage, precision="fp32"):
    """The same run without offload and with each kind of offload."""
    runs = [_train(f"s{stage}-{precision}-none", stage, precision),
            _train(f"s{stage}-{precision}-cpu", stage, precision, "cpu"),
            _train(f"s{stage}-{precision}-nvme", stage, precision, "nvme")]
    if stage == 3:
        runs += [_train(f"s3-{precision}-nvme-pcpu", 3, precision, "nvme", "cpu"),
                 _train(f"s3-{precision}-cpu-pnvme", 3, precision, "cpu", "nvme"),
                 _train(f"s3-{precision}-nvme-pnvme", 3, precision, "nvme", "nvme")]
    return runs


PLANS = {
    ("torchrun", 2): (_variants(1) + _variants(2) + _variants(3) + _variants(2, "bf16")
                      + _variants(3, "bf16")
                      + [_train("s3-bf16m-none", 3, "bf16m"),
                         _train("s3-bf16m-nvme-pnvme", 3, "bf16m", "nvme", "nvme"),
                         _train("s3-bf16m-cpu-pcpu", 3, "bf16m", "cpu", "cpu")]
                      + [["resume", 2, "nvme", "none"], ["resume", 3, "nvme", "nvme"],
                         ["resume", 1, "cpu", "none"]]),
    ("mpirun", 2): _variants(1) + _variants(2) + _variants(3),
    ("torchrun", 4): _variants(3),
}
_CACHE: dict = {}


def launch(key, tmp_path_factory):
    if key not in _CACHE:
        scratch = tmp_path_factory.mktemp("offload_swap")
        launcher, n = key
        results = run_ranks(WORKER, n, launcher, args=[json.dumps(PLANS[key]), str(scratch)],
                            env={"ZERO_CORE_COMM": COMM[launcher]}, timeout=900)
        reports = [r.report for r in results]
        assert all(rep is not None for rep in reports), "a rank did not report"
        # every swap directory is gone once the ranks exited
        assert sorted(os.listdir(scratch)) == [] or all(
            name.startswith("ckpt_") for name in os.listdir(scratch)), os.listdir(scratch)
        _CACHE[key] = reports
    return _CACHE[key]


def by_name(reports):
    return {r["name"]: r for r in reports[0] if isinstance(r, dict) and "name" in r}


LAUNCHES = [pytest.param(("torchrun", 2), id="gloo-2"),
            pytest.param(("mpirun", 2), id="mpi-2", marks=needs_mpirun),
            pytest.param(("torchrun", 4), id="gloo-4")]


@pytest.mark.parametrize("key", LAUNCHES)
def test_offloaded_training_is_bit_identical_to_training_without_offload(key, tmp_path_factory):
    reports = launch(key, tmp_path_factory)
    runs = by_name(reports)
    checked = 0
    for name, run in runs.items():
        base = name.split("-")[0] + "-" + name.split("-")[1] + "-none"
        if name == base:
            continue
        ref = runs[base]
        assert run["losses"] == ref["losses"], (name, run["losses"], ref["losses"])
        assert run["grad_norm"] == ref["grad_norm"], name
        for param, vals in ref["values"].items():
            assert run["values"][param] == vals, f"{name}: {param} differs from {base}"
        # the run really was offloaded where it says
        opt = name.split("-")[2]
        assert run["offload"]["device"] == opt
        if opt == "nvme":
            assert run["offload"]["bytes_read"] > 0 and run["offload"]["bytes_written"] > 0
            assert run["dirs"], "no swap directory was registered"
        if name.endswith("pnvme"):
            params = run["offload"]["params"]
            assert params["device"] == "nvme" and params["bytes_read"] > 0
            assert params["read_ahead_hits"] > 0, params   # the disk was read ahead of use
            assert params["cached_bytes"] > 0              # max_in_cpu kept some in memory
        if "bf16m" in name:   # built in bf16: the master came from the parameter store
            assert run["master_from_store"] == [True, True], run["master_from_store"]
        elif "-bf16-" in name and name.endswith(("pnvme", "pcpu")):   # built in fp32
            assert not any(run["master_from_store"]), name
        checked += 1
    assert checked >= 2
    # ranks agree on the replicated result
    for rank_report in reports[1:]:
        for name, run in by_name(rank_report).items():
            assert run["values"] == runs[name]["values"], name


@pytest.mark.parametrize("key", [pytest.param(("torchrun", 2), id="gloo-2")])
def test_offloaded_state_checkpoints_and_resumes_exactly(key, tmp_path_factory):
    reports = launch(key, tmp_path_factory)
    resumes = [r for r in reports[0] if "a" in r]
    assert len(resumes) == 3
    for r in resumes:
        assert r["a"] == r["b"]


def _memory_run(tmp_path, device):
    plan = [["memory", 8_000_000, 262_144, 3, device]]
    res = run_ranks(WORKER, 1, "torchrun", args=[json.dumps(plan), str(tmp_path)],
                    env={"ZERO_CORE_COMM": "gloo"}, timeout=600)[0].report[0]
    assert res["reset_failed"] is None, res["reset_failed"]
    return res


def test_nvme_offload_bounds_host_memory_by_its_buffers(tmp_path):
    """One rank, 8M parameters: 96 MB of fp32 master weights and Adam states, sub-groups of
    256K elements, 3 slots. Measured against the same run with the states in host memory
    (device cpu), whose first step has the same one-time costs (send buffers, first kernel
    call): the NVMe run must hold the 96 MB less, and its first step may grow the resident
    set by at most the store's buffers (3 slots × 3 states × 1 MiB + a 1 MiB gradient
    buffer, of which the cpu store touches the gradient buffer too) plus 8 MiB (two worker
    threads: their stacks and per-thread allocator arenas; measured ~4.5 MiB) more than
    the cpu run's."""
    nvme = _memory_run(tmp_path, "nvme")
    host = _memory_run(tmp_path, "cpu")
    off = nvme["offload"]
    state_bytes = 3 * 4 * nvme["num_parameters"]
    assert off["host_bytes"] == (3 * 3 + 1) * 262_144 * 4
    assert off["bytes_written"] >= state_bytes   # the step really streamed the states
    assert off["bytes_read"] >= state_bytes - 3 * off["host_bytes"]
    grown_nvme = nvme["peak"] - nvme["before"]
    grown_host = host["peak"] - host["before"]
    assert grown_nvme - grown_host <= off["host_bytes"] + 8 * (1 << 20), (grown_nvme, grown_host)
    # whole-process view: the states are not in this process's memory
    assert nvme["peak"] <= host["peak"] - state_bytes + off["host_bytes"] + 8 * (1 << 20), (
        nvme["peak"], host["peak"])
