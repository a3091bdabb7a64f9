"""SuperOffload (``offload_optimizer.super_offload``, zero_core/offload/speculative.py): the
speculative host step gives the non-speculative offloaded step's numbers, bit for bit —
also on a step that clipping forces to be redone and a step whose overflow forces the
speculation to be rolled back (both counted, so the test sees those paths ran).

Bit-identical, no tolerance: an accepted speculation ran the same kernel on the same fp32
values with the same factor; a rejected one is undone by restoring copies (never by
inverting arithmetic) and stepped again as the plain path steps it.
"""
from __future__ import annotations

import sys
import threading

import pytest

import zero_core
from zero_core.errors import ConfigError
from test_offload_partial import Net, batch, config, nvme, params, same, train

SUPER = {"super_offload": True, "cpuadam_cores_perc": 0.5}


@pytest.mark.parametrize("stage,precision,ratio", [(3, "fp32", 1.0), (3, "bf16", 1.0),
                                                   (2, "bf16", 1.0), (3, "bf16", 0.5),
                                                   (3, "fp16", 1.0)])
def test_speculation_equals_plain_offload_with_clip_and_overflow(stage, precision, ratio):
    # gradient norms are about 0.8: step 3 (×10) clips (redo), the others do not (accept);
    # step 1 overflows (rollback)
    kw = dict(steps=5, poison=1, boost=3)
    _, plain = train(config(stage, ratio, precision, clip=1.0), **kw)
    _, ref = train(config(stage, None, precision, clip=1.0), **kw)
    eng, spec = train(config(stage, ratio, precision, clip=1.0, extra=SUPER), **kw)
    counts = eng.memory_report()["offload"]["super_offload"]
    assert counts["speculated"] == 5, counts
    assert counts["rolled_back"] >= 1 and counts["redone"] >= 1 and counts["accepted"] >= 1, counts
    assert eng.skipped_steps == 1
    same(spec, plain)
    same(spec, ref)


def test_with_parameter_offload():
    kw = dict(steps=4, poison=1, boost=2)
    _, ref = train(config(3, None, "bf16", clip=1.0), **kw)
    _, spec = train(config(3, 0.5, "bf16", clip=1.0, extra=SUPER, param=True), **kw)
    same(spec, ref)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_checkpoint_between_backward_and_step_rolls_back(device, tmp_path):
    def cfg(extra=None):
        c = config(3, 1.0, clip=0.0, extra=extra)
        return nvme(c, tmp_path / "swap") if device == "nvme" else c
    eng, _ = train(cfg(SUPER), steps=1)
    ref, _ = train(cfg(), steps=1)
    for e in (eng, ref):
        for k in range(2):   # the second backward is the boundary's: it speculates
            x, y = batch(3, 9, k)
            e.backward(e(x, y))
            if k == 0:
                e.step()
    eng.save_checkpoint(str(tmp_path / "a"), tag="t")   # touches the states: rollback
    ref.save_checkpoint(str(tmp_path / "b"), tag="t")
    assert eng.memory_report()["offload"]["super_offload"]["rolled_back"] == 1
    a, *_ = zero_core.initialize(model=Net(5), config=config(3, None))
    b, *_ = zero_core.initialize(model=Net(6), config=config(3, None))
    a.load_checkpoint(str(tmp_path / "a"), tag="t")
    b.load_checkpoint(str(tmp_path / "b"), tag="t")
    _, ha = train(None, engine=a, steps=1, start=1)
    _, hb = train(None, engine=b, steps=1, start=1)
    same(ha, hb)


@pytest.mark.parametrize("stage,ratio", [(3, 1.0), (2, 0.5)])
def test_nvme_equals_plain_nvme_offload(stage, ratio, tmp_path):
    """Swap-file states, rollback snapshots in swap files: plain NVMe offload's numbers
    through an accepted, a redone (clipped) and a rolled-back (overflow) speculation."""
    kw = dict(steps=4, poison=1, boost=3)
    _, plain = train(nvme(config(stage, 1.0, "bf16", clip=1.0), tmp_path), **kw)
    eng, spec = train(nvme(config(stage, ratio, "bf16", clip=1.0, extra=SUPER), tmp_path), **kw)
    rep = eng.memory_report()["offload"]
    counts = rep["super_offload"]
    assert rep["device"] == "nvme" and rep["bytes_written"] > 0
    assert counts["rolled_back"] >= 1 and counts["redone"] >= 1 and counts["accepted"] >= 1, counts
    same(spec, plain)


@pytest.mark.parametrize("stage", [2, 3])
def test_host_step_starts_during_the_boundary_backward(stage):
    """Observed, not timed: the hook on the input's gradient (among the last things the
    backward computes) waits for the worker to begin a host step; it only can if a
    sub-group was started while the backward ran. Non-boundary micro-steps start none."""
    cfg = config(stage, 1.0, "bf16", clip=1.0, extra=SUPER)
    # every bucket lands at once; buckets (stage 2) small enough that the last layers'
    # fill whole sub-groups
    cfg["zero_optimization"].update(overlap_comm=False, reduce_bucket_size=1000)
    eng, *_ = zero_core.initialize(model=Net(3), config=cfg)
    opt = eng.optimizer
    began, micro = threading.Event(), []
    run = opt._speculate_one

    def observed(sg, factor, step):
        micro.append(eng.micro_steps)
        began.set()
        return run(sg, factor, step)
    opt._speculate_one = observed
    seen_in_backward = []
    for t in range(2):
        for k in range(2):
            x, y = batch(3, t, k)
            x = x.to(eng.device, eng.compute_dtype).requires_grad_()
            began.clear()
            before = len(micro)
            if k == 1:   # the boundary: wait (bounded) for a host step to begin
                x.register_hook(lambda g: seen_in_backward.append(began.wait(20)))
            eng.backward(eng(x, y.to(eng.device, eng.compute_dtype)))
            if k == 0:
                assert opt._round is None and len(micro) == before
            eng.step()
    assert seen_in_backward == [True, True]
    assert micro and set(m % 2 for m in micro) == {1}, micro   # boundary micro-steps only
    assert opt.counts["started_in_backward"] >= 2 and opt.counts["accepted"] == 2


@pytest.mark.parametrize("stage", [1, 2])
def test_second_backward_of_the_boundary_restarts(stage):
    """retain_graph: a second backward at the same boundary changes gradients of
    sub-groups already started; they are put back and started anew (exact)."""
    hist = {}
    for name, extra in (("spec", SUPER), ("plain", None)):
        eng, *_ = zero_core.initialize(model=Net(4), config=config(stage, 1.0, extra=extra))
        for t in range(2):
            for k in range(2):
                x, y = batch(4, t, k)
                loss = eng(x, y)
                eng.backward(loss, retain_graph=k == 1)
                if k == 1:
                    eng.backward(loss * 0.5)
                eng.step()
        hist[name] = [params(eng)]
        if name == "spec":
            assert eng.optimizer.counts["restarted"] >= 1, eng.optimizer.counts
    same(hist["spec"], hist["plain"])


def test_refusals():
    with pytest.raises(ConfigError, match="super_offload"):
        zero_core.initialize(model=Net(1), config={
            **config(3), "zero_optimization": {"stage": 3, "offload_optimizer": {
                "device": "none", "super_offload": True}}})
    with pytest.raises(ConfigError, match="cpuadam_cores_perc"):
        zero_core.initialize(model=Net(1), config=config(
            3, 1.0, extra={"super_offload": True, "cpuadam_cores_perc": 0.0}))


@pytest.mark.multirank
def test_on_vdev_equal_to_cpu():
    pytest.importorskip("zero_core_vdev", reason="examples/vdev is not installed")
    import torch
    from zero_core.testing.ranks import run_ranks
    (r,) = run_ranks(__file__, 1, "torchrun", args=["vdev"],
                     env={"ZERO_CORE_ACCELERATOR": "vdev", "VDEV_ASYNC": "1"}, timeout=300)
    rep = r.report
    assert rep["device"] == "vdev" and rep["misplaced"] == []
    assert rep["counts"]["rolled_back"] >= 1 and rep["counts"]["redone"] >= 1
    _, cpu = train(config(3, 1.0, "bf16", clip=1.0), steps=5, poison=1, boost=3)
    got = [{n: torch.tensor(v).reshape(cpu[0][n].shape) for n, v in h.items()}
           for h in rep["history"]]
    same(got, cpu)


def _rank_main(mode: str) -> None:
    from zero_core.testing.device_audit import misplaced
    from zero_core.testing.ranks import report
    eng, hist = train(config(3, 1.0, "bf16", clip=1.0, extra=SUPER), steps=5, poison=1,
                      boost=3)
    report({"device": eng.device.type, "misplaced": misplaced(eng),
            "counts": eng.memory_report()["offload"]["super_offload"],
            "history": [{n: v.flatten().tolist() for n, v in h.items()} for h in hist]})
    eng.destroy()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
