"""A training step makes no host-device synchronization (issue 30): counted by the vdev
device across the engine matrix, in its asynchronous mode.

On a GPU, every value the host reads back from the device (``.item()``, a norm, an overflow
flag, a blocking copy) stops the host until the device has caught up, so it cannot queue the
next kernels: the step becomes host-bound. vdev counts each synchronization the way CUDA's
sync debug mode sees them (blocking copies, host reads of device values, stream/event/device
waits; csrc/streams.h). tests/workers/sync_count.py trains every scenario on 2 ranks over
vdev-gloo (device memory on the wire, as nccl: nothing staged through the host) with
batches in pinned memory, then counts two more optimizer steps (2 micro-steps each,
gradient clipping on).

* stages 0-3, fp32/bf16/fp16 (dynamic loss scale), zero_core.Init, activation checkpointing
  to host memory, qwZ, hpZ, qgZ, and stage 2 printing the steps_per_print progress line at
  every step (wall_clock_breakdown off): **0** per step;
* a step with an inf gradient: skipped on the device (found_inf), still no synchronization
  at that step; naming the parameter it hit, at the next update, reads a few bytes back;
* ``wall_clock_breakdown`` on (a diagnostic): the timers synchronize at each end of each
  phase (zero_core/engine/timers.py), 2 waits per phase — fwd, bwd, bwd_inner, bwd_allreduce
  per micro-step, step per optimizer step — and nothing else;
* what must decide on the host, documented in docs/ARCHITECTURE.md ("a step without
  synchronizations"): a torch.optim optimizer (1 wait: the verdict), Lamb (+1 copy: its
  trust ratios), offload_optimizer / offload_param (the verdict, plus the blocking copies of
  gradients down and parameters up, all in zero_core/offload/).
"""
from __future__ import annotations

import os

import pytest

from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "sync_count.py")
FREE = ("s0", "s1", "s2", "s3", "s2_bf16", "s3_bf16", "s2_fp16", "s3_fp16", "s3_init",
        "s3_actckpt", "zpp_qwz", "zpp_hpz", "zpp_qgz", "progress_every_step")
HOST_DECIDES = {"torch_opt": {"copies": 0, "reads": 0, "waits": 1},
                "lamb": {"copies": 1, "reads": 0, "waits": 1}}
OFFLOAD = ("off_opt_cpu", "off_param_cpu", "off_opt_nvme")
VERDICT_READ = "zero_core/engine/update.py"

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    names = ",".join(FREE + tuple(HOST_DECIDES) + OFFLOAD + ("nonfinite_skip", "wall_clock_on"))
    scratch = str(tmp_path_factory.mktemp("sync"))
    env = {"ZERO_CORE_ACCELERATOR": "vdev", "ZERO_CORE_COMM": "vdev-gloo", "VDEV_ASYNC": "1"}
    results = run_ranks(WORKER, 2, "torchrun", args=[names, scratch], env=env, timeout=900)
    assert all(r.report is not None for r in results), "a rank did not report"
    return [r.report for r in results]


@pytest.mark.parametrize("name", FREE)
def test_the_step_never_waits_for_the_device(counts, name):
    for rank, rep in enumerate(counts):
        r = rep[name]
        assert r["async"] and r["device"].startswith("vdev:"), r
        assert r["per_step"]["total"] == 0, (name, rank, r["per_step"], r["sites"])


def test_a_skipped_step_is_decided_on_the_device(counts):
    for rep in counts:
        r = rep["nonfinite_skip"]
        assert r["skipped"] == 1, r
        # the poisoned step itself: nothing; the next update reads a few bytes back to name
        # the parameter the inf hit (rank 0 logs it)
        assert r["each_step"][0] == 0 and r["each_step"][1] > 0, r


@pytest.mark.parametrize("name", sorted(HOST_DECIDES))
def test_optimizers_that_decide_on_the_host_wait_once(counts, name):
    for rep in counts:
        r = rep[name]
        got = {k: v for k, v in r["per_step"].items() if k != "total"}
        assert got == HOST_DECIDES[name], (name, r["per_step"], r["sites"])


@pytest.mark.parametrize("name", OFFLOAD)
def test_offload_waits_only_for_its_own_transfers(counts, name):
    for rep in counts:
        r = rep[name]
        assert r["per_step"]["waits"] == 1 and r["per_step"]["reads"] == 0, r
        assert all("zero_core/offload/" in s or VERDICT_READ in s for s in r["sites"]), r["sites"]


def test_the_wall_clock_breakdown_waits_only_at_its_phase_ends(counts):
    for rep in counts:
        r = rep["wall_clock_on"]
        waits = 2 * (4 * r["gas"] + 1)
        assert r["per_step"] == {"copies": 0, "reads": 0, "waits": waits, "total": waits}, r
