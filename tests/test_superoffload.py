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

import pytest

import zero_core
from zero_core.errors import ConfigError
from test_offload_partial import Net, config, same, train

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


def test_checkpoint_between_backward_and_step_rolls_back(tmp_path):
    eng, _ = train(config(3, 1.0, clip=0.0, extra=SUPER), steps=1)
    ref, _ = train(config(3, 1.0, clip=0.0), steps=1)
    from test_offload_partial import batch
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


def test_refusals():
    with pytest.raises(ConfigError, match="super_offload"):
        zero_core.initialize(model=Net(1), config={
            **config(3), "zero_optimization": {"stage": 3, "offload_optimizer": {
                "device": "nvme", "nvme_path": "/tmp", "super_offload": True}}})
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
