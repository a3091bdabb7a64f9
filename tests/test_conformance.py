"""The conformance suite (zero_core.conformance), run for real against the built-in
communicators — gloo launched torchrun-style and MPI under mpirun, 2 ranks and 4 ranks as
2 emulated nodes x 2 — plus a deliberately broken plugin that the suite must catch, and
unit tests of the suite's own judging (merging, tolerances)."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch

from zero_core.conformance.data import (compare_exact, compare_reduction, expected_sent_bytes,
                                        rank_input)
from zero_core.conformance.results import (FAIL, PASS, SKIP, UNSUPPORTED, Abort, Recorder,
                                           Unsupported, merge)
from zero_core.testing.ranks import mpirun_path, run_ranks

SUITE = ("-m", "zero_core.conformance")


def run_suite(nprocs, launcher, *args, env=None, timeout=240):
    results = run_ranks(SUITE[0], nprocs, launcher=launcher, args=[SUITE[1], "--timeout", "60", *args],
                        env=env, timeout=timeout, check=False)
    return results


def statuses(report):
    return {name: r["status"] for name, r in report["results"].items()}


def failing(report):
    return {name: r["detail"] for name, r in report["results"].items() if r["status"] == FAIL}


def assert_conformant(results, comm, world, rpn):
    log = results[0].log[-8000:]
    reports = [r.report for r in results]
    assert all(rep is not None for rep in reports), f"a rank reported nothing:\n{log}"
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}: {failing(r.report)}\n{log}"
    rep = reports[0]
    assert rep["ok"] and not failing(rep) and not rep["aborted"], failing(rep)
    # every rank reached the same merged verdicts
    assert all(statuses(other) == statuses(rep) for other in reports[1:])
    assert (rep["comm"], rep["world_size"], rep["ranks_per_node"]) == (comm, world, rpn)
    st = statuses(rep)
    # the full list ran: 11 collective checks per dtype, barrier, 8 refusals, 2 async,
    # 4 group and 5 ledger checks, topology
    assert len([n for n in st if not n.startswith("accelerator/")]) == 5 * 11 + 1 + 8 + 2 + 4 + 5 + 1
    # fp32 is what ZeRO runs on: it may not be "unsupported"; nothing may be skipped on >= 2 ranks
    assert all(s == PASS for n, s in st.items() if "fp32" in n), st
    assert all(s in (PASS, UNSUPPORTED) for s in st.values()), st
    for kind in ("world", "intra_node", "inter_node"):
        assert st[f"ledger/{kind}"] == PASS
    notes = {n: r["detail"] for n, r in rep["results"].items()}
    inter = world // rpn > 1
    assert ("inter-node" if inter else "intra-node") in notes["ledger/inter_node"]
    assert "intra-node" in notes["ledger/intra_node"]
    return rep


# ---- real runs -----------------------------------------------------------------------------
needs_mpi = pytest.mark.skipif(mpirun_path() is None,
                               reason="mpirun not installed: pip install 'zero-core[mpi]'")


@pytest.mark.multirank
def test_gloo_2_ranks_with_accelerator_checks():
    results = run_suite(2, "torchrun", "--comm", "gloo")
    rep = assert_conformant(results, "gloo", 2, 2)
    st = statuses(rep)
    acc = sorted(n for n in st if n.startswith("accelerator/cpu/"))
    assert len(acc) == 7 and all(st[n] == PASS for n in acc), {n: st[n] for n in acc}


@pytest.mark.multirank
def test_gloo_4_ranks_as_2_nodes():
    results = run_suite(4, "torchrun", "--comm", "gloo", "--comm-only",
                        env={"ZERO_CORE_RANKS_PER_NODE": "2"})
    assert_conformant(results, "gloo", 4, 2)


@needs_mpi
@pytest.mark.multirank
def test_mpi_2_ranks():
    results = run_suite(2, "mpirun", "--comm", "mpi", "--comm-only")
    assert_conformant(results, "mpi", 2, 2)


@needs_mpi
@pytest.mark.multirank
def test_mpi_4_ranks_as_2_nodes():
    results = run_suite(4, "mpirun", "--comm", "mpi", "--comm-only",
                        env={"ZERO_CORE_RANKS_PER_NODE": "2"})
    assert_conformant(results, "mpi", 4, 2)


@pytest.mark.multirank
@pytest.mark.parametrize("launcher,comm", [("torchrun", "gloo"),
                                           pytest.param("mpirun", "mpi", marks=needs_mpi)])
def test_vdev_device_tensors_through_host_communicators(launcher, comm):
    """On the vdev accelerator (examples/vdev) every collective runs on vdev tensors, which
    gloo and MPI carry through pinned host buffers: the suite's results must be the same,
    and vdev's own accelerator checks pass."""
    results = run_suite(2, launcher, "--comm", comm, "--accelerator", "vdev",
                        env={"ZERO_CORE_ACCELERATOR": "vdev"})
    rep = assert_conformant(results, comm, 2, 2)
    st = statuses(rep)
    acc = sorted(n for n in st if n.startswith("accelerator/vdev/"))
    assert len(acc) == 7 and all(st[n] == PASS for n in acc), {n: st[n] for n in acc}
    assert "vdev" in rep["results"]["accelerator/vdev/identity"]["detail"]


BROKEN_PLUGIN = '''
"""A gloo communicator with three planted bugs and one declared gap."""
import torch
from zero_core.backends.comm.torch_dist import GlooCommunicator
from zero_core.interfaces.hookspecs import hookimpl


class BrokenGloo(GlooCommunicator):
    name = "broken_gloo"

    def supports(self, op, dtype):  # a declared gap: must show as "unsupported"
        return dtype != torch.uint8 and super().supports(op, dtype)

    def _all_reduce(self, tensor, op, group):  # bug: max computed as a sum
        return super()._all_reduce(tensor, "sum" if op == "max" else op, group)

    def _all_gather_into(self, output, input, group):  # bug: "async" that blocks
        handle = super()._all_gather_into(output, input, group)
        handle.wait()
        return handle

    def _reduce_scatter(self, output, input, op, group):  # bug: under-reports its bytes
        handle = super()._reduce_scatter(output, input, op, group)
        handle.wire_payload_bytes = input.numel() * input.element_size() // 2
        return handle


@hookimpl
def zero_core_communicators():
    return [BrokenGloo]
'''


@pytest.mark.multirank
def test_suite_catches_a_broken_communicator(tmp_path):
    (tmp_path / "broken_gloo_plugin.py").write_text(textwrap.dedent(BROKEN_PLUGIN))
    picks = ["all_reduce[max] fp32", "all_reduce[sum] fp32", "reduce_scatter[sum] fp32",
             "all_gather_into fp32", "async/returns_early", "all_reduce[sum] uint8",
             "broadcast[every src] uint8"]
    args = ["--plugin", "broken_gloo_plugin", "--comm", "broken_gloo", "--comm-only"]
    for p in picks:
        args += ["-k", p]
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    results = run_suite(2, "torchrun", *args, env={"PYTHONPATH": pythonpath})
    log = results[0].log[-8000:]
    assert all(r.report is not None for r in results), log
    assert [r.returncode for r in results] == [1, 1], log  # every rank says the run failed
    rep = results[0].report
    st = statuses(rep)
    assert set(st) == set(picks), st  # -k ran exactly these
    assert st["all_reduce[max] fp32"] == FAIL
    assert st["reduce_scatter[sum] fp32"] == FAIL and "ledger" in rep["results"]["reduce_scatter[sum] fp32"]["detail"]
    assert st["async/returns_early"] == FAIL
    assert "all_gather_into call took" in rep["results"]["async/returns_early"]["detail"]
    # what the bugs do not touch still passes, and a declared gap is not a failure
    assert st["all_reduce[sum] fp32"] == PASS and st["all_gather_into fp32"] == PASS
    assert st["all_reduce[sum] uint8"] == UNSUPPORTED and st["broadcast[every src] uint8"] == UNSUPPORTED
    assert rep["counts"] == {PASS: 2, FAIL: 3, UNSUPPORTED: 2, SKIP: 0}
    assert "conformance: 2 passed, 3 failed, 2 unsupported" in results[0].log


# ---- the suite's own judging, in-process ---------------------------------------------------
def test_merge_requires_every_rank():
    def r(name, status, detail=""):
        return {"name": name, "status": status, "detail": detail, "seconds": 0.1}
    per_rank = [
        [r("a", PASS), r("b", PASS), r("c", UNSUPPORTED, "no int8"), r("d", PASS), r("e", SKIP), r("f", PASS)],
        [r("a", PASS), r("b", FAIL, "off by one"), r("c", UNSUPPORTED, "no int8"), r("d", UNSUPPORTED),
         r("e", SKIP)],
    ]
    merged = {m.name: m for m in merge(per_rank)}
    assert merged["a"].status == PASS
    assert merged["b"].status == FAIL and merged["b"].detail == "rank 1: off by one"
    assert merged["c"].status == UNSUPPORTED
    assert merged["d"].status == FAIL  # ranks disagree on support: a failure
    assert merged["e"].status == SKIP
    assert merged["f"].status == FAIL and "ranks [1]" in merged["f"].detail


def test_recorder_outcomes_and_abort():
    rec = Recorder(select=["keep"], agree=lambda flag: [flag, False])

    def passes(check):
        check.expect(True, "never")

    def soft_fails(check):
        check.expect(1 == 2, "one is not two")
        check.expect(True, "fine")

    def unsupported(check):
        raise Unsupported("declared")

    def raises(check):
        raise RuntimeError("backend exploded")

    assert rec.run("skip me", passes) is None  # not selected
    assert rec.run("keep/pass", passes).status == PASS
    res = rec.run("keep/soft", soft_fails)
    assert (res.status, res.detail) == (FAIL, "one is not two")
    assert rec.run("keep/unsupported", unsupported).status == UNSUPPORTED
    # this rank raised and the other did not: the peers may be out of step
    with pytest.raises(Abort, match="ranks \\[0\\] raised"):
        rec.run("keep/raise", raises)
    assert rec.results[-1].status == FAIL and "backend exploded" in rec.results[-1].detail


def test_reduction_tolerance_accepts_rounding_and_catches_errors():
    n = 4
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ins = [rank_input(7, "tol", r, 500, dtype, n) for r in range(n)]
        # a reduction done in the dtype itself, in another order: rounding only
        acc = ins[3].clone()
        for t in (ins[2], ins[1], ins[0]):
            acc = acc + t
        assert compare_reduction(acc, ins, "sum") is None
        assert compare_reduction(acc / n, ins, "avg") is None
        wrong = acc.clone()
        wrong[123] += 0.5
        assert "first at [123]" in compare_reduction(wrong, ins, "sum")
        assert compare_reduction(acc, ins, "avg") is not None  # a sum is not an average
        mx = torch.stack(ins).max(0).values
        assert compare_reduction(mx, ins, "max") is None
        assert compare_reduction(torch.stack(ins).min(0).values, ins, "max") is not None
    for dtype in (torch.int8, torch.uint8):
        ins = [rank_input(7, "tol", r, 500, dtype, n) for r in range(n)]
        total = sum(t.to(torch.int64) for t in ins)
        assert int(total.abs().max()) <= torch.iinfo(dtype).max  # inputs cannot overflow
        assert compare_reduction(total.to(dtype), ins, "sum") is None
        floor_avg = torch.div(total, n, rounding_mode="floor").to(dtype)
        assert compare_reduction(floor_avg, ins, "avg") is None
        assert compare_reduction((total // n + 2).to(dtype), ins, "avg") is not None


def test_inputs_are_reproducible_and_distinct():
    a = rank_input(11, "x", 0, 64, torch.float32, 2)
    assert torch.equal(a, rank_input(11, "x", 0, 64, torch.float32, 2))
    assert not torch.equal(a, rank_input(11, "x", 1, 64, torch.float32, 2))
    assert not torch.equal(a, rank_input(12, "x", 0, 64, torch.float32, 2))
    assert compare_exact(a, a.clone()) is None
    assert "1/64" in compare_exact(a, torch.cat([a[:5], a[5:6] + 1, a[6:]]))


def test_suite_restates_the_ledger_table():
    from zero_core.interfaces.ledger import sent_bytes
    for op in ("all_gather_into", "reduce_scatter", "all_reduce", "all_to_all_single",
               "broadcast", "barrier"):
        for n in (1, 2, 3, 4):
            for payload in (0, 12, 4100):
                for src in (False, True):
                    assert expected_sent_bytes(op, n, payload, src) == sent_bytes(op, n, payload, src)


@needs_mpi
@pytest.mark.multirank
def test_run_ranks_timeout_leaves_no_rank_behind(tmp_path):
    """A hung job is stopped at its timeout with every rank (the suite relies on it when a
    backend hangs); a killed mpirun alone would orphan its ranks on the shared cores."""
    script = tmp_path / "hang_forever.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    results = run_ranks(str(script), 2, launcher="mpirun", timeout=4, check=False)
    assert [r.returncode for r in results] == [None, None]
    assert "stopped after its timeout" in results[0].log
    leftovers = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if str(script).encode() in fh.read():
                    leftovers.append(int(entry))
        except OSError:
            continue
    assert leftovers == []
