"""Partial optimizer offload (``offload_optimizer.ratio`` < 1, zero_core/offload/partial.py):
the split changes where each sub-group is stepped, never the numbers.

Tolerance: none — bit-identical. Both sides run the same element-wise kernels on the same
fp32 values (the gradient copied to fp32, multiplied by the same ``grad_factor``, then one
fused Adam step); on the CPU accelerator the device kernel set is the CPU one, and vdev's
kernels are the CPU's (examples/vdev), so not even float reordering can differ. Runs
without offload are the reference (themselves checked against single-process torch in
tests/test_engine_multirank.py / tests/test_stage3_multirank.py).
"""
from __future__ import annotations

import sys

import pytest
import torch

import zero_core
from zero_core.errors import ConfigError
from zero_core.offload.partial import device_subgroup_count

STEPS = 4


class Net(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(48, 64)
        self.b = torch.nn.Linear(64, 40)
        self.c = torch.nn.Linear(40, 8)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))), y)


def config(stage, ratio=None, precision="fp32", clip=0.05, extra=None, param=False):
    zo = {"stage": stage, "sub_group_size": 1024,
          "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000}
    if param:
        zo["offload_param"] = {"device": "cpu"}
    if ratio is not None:
        zo["offload_optimizer"] = {"device": "cpu", "ratio": ratio, **(extra or {})}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "gradient_clipping": clip, "zero_optimization": zo,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def batch(seed, t, k):
    g = torch.Generator().manual_seed(seed * 1000 + t * 10 + k)
    return torch.randn(4, 48, generator=g), torch.randn(4, 8, generator=g)


def train(cfg, seed=3, steps=STEPS, engine=None, start=0, poison=None, boost=None, rank=0):
    """*poison*: the step whose last micro-batch's loss is inf (skipped); *boost*: the step
    whose losses are ×10 (clipped when gradient_clipping is about the usual norm)."""
    if engine is None:
        engine, *_ = zero_core.initialize(model=Net(seed), config=cfg)
    hist = []
    for t in range(start, start + steps):
        for k in range(2):
            x, y = batch(seed, t, k + 10 * rank)
            dt = engine.compute_dtype
            loss = engine(x.to(engine.device, dt), y.to(engine.device, dt))
            if poison is not None and t == poison and k == 1:
                loss = loss * float("inf")
            if boost is not None and t == boost:
                loss = loss * 10
            engine.backward(loss)
            engine.step()
        hist.append(params(engine))
    return engine, hist


def params(engine):
    from zero_core.stage3 import GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().cpu().float().clone() for n, p in engine.module.named_parameters()}


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for n in x:
            assert torch.equal(x[n], y[n]), n


def test_deepspeed_split_rule():
    # stage3.py: sub-group i on the accelerator iff i < int((1 - ratio) * n)
    assert [device_subgroup_count(10, r) for r in (1.0, 0.75, 0.7, 0.5, 0.0)] == [0, 2, 3, 5, 10]
    assert device_subgroup_count(1, 0.5) == 0


@pytest.mark.parametrize("stage,precision", [(3, "fp32"), (3, "bf16"), (2, "bf16"), (1, "fp32")])
def test_split_equals_full_offload_and_no_offload(stage, precision):
    _, ref = train(config(stage, None, precision))
    _, full = train(config(stage, 1.0, precision))
    eng, half = train(config(stage, 0.5, precision))
    _, none = train(config(stage, 0.0, precision))
    rep = eng.memory_report()["offload"]
    n = rep["subgroups"]
    assert n >= 4 and rep["device_subgroups"] == n // 2, rep
    same(full, ref)
    same(half, ref)
    same(none, ref)


def test_with_parameter_offload():
    _, ref = train(config(3, None, "bf16"))
    _, half = train(config(3, 0.5, "bf16", param=True))
    same(half, ref)


def test_device_part_is_on_the_device_and_host_part_in_the_store():
    eng, _ = train(config(3, 0.5), steps=1)
    opt = eng.optimizer
    dev = opt.device_subgroups()
    assert dev and len(dev) < len(opt.subgroups)
    for sg in dev:
        for t in opt._dev[(sg.group, sg.index)].values():
            assert t.device == eng.device and t.numel() == sg.numel
    from zero_core.testing.device_audit import misplaced
    assert misplaced(eng) == []


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_saved_split_resumes_full_and_unoffloaded(stage, tmp_path):
    eng, first = train(config(stage, 0.5), steps=2)
    eng.save_checkpoint(str(tmp_path), tag="t")
    _, cont = train(None, engine=eng, steps=2, start=2)
    for ratio in (1.0, None, 0.25):
        e2, *_ = zero_core.initialize(model=Net(99), config=config(stage, ratio))
        e2.load_checkpoint(str(tmp_path), tag="t")
        _, again = train(None, engine=e2, steps=2, start=2)
        same(again, cont)


def halve_through_gathered(*engines) -> None:
    """Halve every parameter of each stage-3 engine inside a GatheredParameters modifier
    block (a write that must reach the master wherever its sub-group steps)."""
    from zero_core.stage3 import GatheredParameters
    for e in engines:
        with GatheredParameters(list(e.module.parameters()), modifier_rank=0):
            with torch.no_grad():
                for p in e.module.parameters():
                    p.mul_(0.5)


def test_write_back_reaches_the_device_part():
    """A GatheredParameters modification at stage 3 lands in the master the device steps."""
    eng, _ = train(config(3, 0.0), steps=1)
    ref, _ = train(config(3, None), steps=1)
    halve_through_gathered(eng, ref)
    _, a = train(None, engine=eng, steps=2, start=1)
    _, b = train(None, engine=ref, steps=2, start=1)
    same(a, b)


def nvme(cfg, path):
    """*cfg* with the optimizer states in swap files under *path*."""
    cfg = {**cfg, "zero_optimization": dict(cfg["zero_optimization"])}
    off = cfg["zero_optimization"]["offload_optimizer"] = dict(
        cfg["zero_optimization"]["offload_optimizer"])
    path.mkdir(parents=True, exist_ok=True)
    off.update(device="nvme", nvme_path=str(path), buffer_count=3)
    return cfg


@pytest.mark.parametrize("stage,precision", [(3, "bf16"), (2, "fp32")])
def test_nvme_split_equals_plain_nvme(stage, precision, tmp_path):
    """The host part in swap files: the numbers of plain NVMe offload (and of no offload);
    the device sub-groups are left out of the swap stream."""
    _, plain = train(nvme(config(stage, 1.0, precision), tmp_path))
    _, ref = train(config(stage, None, precision))
    eng, half = train(nvme(config(stage, 0.5, precision), tmp_path))
    rep = eng.memory_report()["offload"]
    assert rep["device"] == "nvme" and rep["bytes_read"] > 0
    assert rep["device_subgroups"] == rep["subgroups"] // 2 >= 2, rep
    assert [tuple(k) for k in eng.optimizer.store._order] == [
        (sg.group, sg.index) for sg in eng.optimizer.subgroups[rep["device_subgroups"]:]]
    same(half, plain)
    same(half, ref)


def test_nvme_split_checkpoint_and_write_back(tmp_path):
    """Saved from swap files + device, loaded into cpu offload and into another NVMe split:
    the same continuation; a stage-3 write-back reaches the swap files and the device part."""
    eng, _ = train(nvme(config(3, 0.5), tmp_path / "swap"), steps=2)
    ref, _ = train(config(3, None), steps=2)
    eng.save_checkpoint(str(tmp_path / "ck"), tag="t")
    _, cont = train(None, engine=eng, steps=2, start=2)
    _, cont_ref = train(None, engine=ref, steps=2, start=2)
    same(cont, cont_ref)
    for cfg in (config(3, 1.0), nvme(config(3, 0.25), tmp_path / "swap2")):
        e2, *_ = zero_core.initialize(model=Net(99), config=cfg)
        e2.load_checkpoint(str(tmp_path / "ck"), tag="t")
        _, again = train(None, engine=e2, steps=2, start=2)
        same(again, cont)
    halve_through_gathered(eng, ref)
    _, a = train(None, engine=eng, steps=2, start=4)
    _, b = train(None, engine=ref, steps=2, start=4)
    same(a, b)


def test_refusals():
    with pytest.raises(ConfigError, match="offload_optimizer.ratio"):
        zero_core.initialize(model=Net(1), config=config(3, 1.5))


@pytest.mark.multirank
def test_on_vdev_bit_identical_and_split_where_it_belongs():
    pytest.importorskip("zero_core_vdev", reason="examples/vdev is not installed")
    from zero_core.testing.ranks import run_ranks
    (r,) = run_ranks(__file__, 1, "torchrun", args=["vdev"],
                     env={"ZERO_CORE_ACCELERATOR": "vdev", "VDEV_ASYNC": "1"}, timeout=300)
    rep = r.report
    assert rep["device"] == "vdev" and rep["misplaced"] == [] and rep["dev_types"] == ["vdev"]
    assert rep["host_types"] == ["cpu"]
    _, cpu = train(config(3, None, "bf16"))
    got = [{n: torch.tensor(v).reshape(cpu[0][n].shape) for n, v in h.items()}
           for h in rep["history"]]
    same(got, cpu)


RANK_VARIANTS = {"none": dict(ratio=None), "r05": dict(ratio=0.5),
                 "r05s": dict(ratio=0.5, extra={"super_offload": True}),
                 "r05sn": dict(ratio=0.5, extra={"super_offload": True}, nvme=True)}


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_and_resharded_resume(stage, tmp_path):
    """2 ranks (each its own data): the split and the speculation give the unoffloaded
    numbers; their checkpoints load on 1 rank without offload and train on identically."""
    from zero_core.testing.ranks import run_ranks
    results = run_ranks(__file__, 2, "torchrun", args=["ranks", str(stage), str(tmp_path)],
                        env={"ZERO_CORE_COMM": "gloo"}, timeout=300)
    for r in results:
        hist = {v: [{n: torch.tensor(x) for n, x in h.items()} for h in r.report[v]]
                for v in RANK_VARIANTS}
        same(hist["r05"], hist["none"])
        same(hist["r05s"], hist["none"])
        same(hist["r05sn"], hist["none"])
    after = {}
    for v in ("none", "r05s", "r05sn"):
        eng, *_ = zero_core.initialize(model=Net(7), config=config(stage, None, "bf16"))
        eng.load_checkpoint(str(tmp_path / v), tag="t")
        _, after[v] = train(None, engine=eng, steps=1, start=3)
    same(after["r05s"], after["none"])
    same(after["r05sn"], after["none"])


def _rank_main(mode: str, *args) -> None:
    from zero_core.testing.device_audit import misplaced
    from zero_core.testing.ranks import report
    if mode == "ranks":
        from zero_core.runtime.launch import discover
        rank, stage, scratch = discover().rank, int(args[0]), args[1]
        out = {}
        for v, kw in RANK_VARIANTS.items():
            cfg = config(stage, kw["ratio"], "bf16", clip=1.0, extra=kw.get("extra"))
            if kw.get("nvme"):
                import pathlib
                cfg = nvme(cfg, pathlib.Path(scratch) / "swap")
            eng, hist = train(cfg, steps=3, boost=1, rank=rank)
            eng.save_checkpoint(f"{scratch}/{v}", tag="t")
            out[v] = [{n: x.tolist() for n, x in h.items()} for h in hist]
            eng.destroy()
        report(out)
        return
    eng, hist = train(config(3, 0.5, "bf16"))
    opt = eng.optimizer
    dev_types = sorted({t.device.type for d in opt._dev.values() for t in d.values()})
    host_types = sorted({opt.store.acquire(sg)["master"].device.type for sg in opt.subgroups})
    report({"device": eng.device.type, "misplaced": misplaced(eng), "dev_types": dev_types,
            "host_types": host_types,
            "history": [{n: v.flatten().tolist() for n, v in h.items()} for h in hist]})
    eng.destroy()


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
