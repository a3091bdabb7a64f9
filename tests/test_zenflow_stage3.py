"""ZenFlow at ZeRO stage 3 (zero_core/offload/zenflow_stage3.py) against the float64
re-implementation of its rules in tests/test_zenflow.py (the same linear model: each step's
gradient is exactly the mean of the ranks' random inputs), on 1 and 2 ranks, cpu and vdev.

Stage 3 adds to what tests/test_zenflow.py holds stages 1-2 to: the parameters read back are
gathered from the partitions (``GatheredParameters``); on 2 ranks the model's first weight
is cut by the partition boundary in the middle of a row (checked), so a column's sum is
two ranks' partial sums, all-reduced, and both ranks must select the same columns; a host
update applied by ``flush()`` outside a step must reach the next forward although the
model's units are persistent (kept gathered between steps: the stale copy is told apart).
``update_interval`` 1 equals plain stage-3 offload bit for bit (with ``offload_param`` cpu
and nvme too, and ZenFlow with ``offload_param`` equals ZenFlow without it); a checkpoint resumes bit
for bit on the same world size and from 1 rank on 2 ranks and back, and from stage 3 at
stage 2 and back within float32 rounding. DeepSpeed 0.19.8's own stage-3 ZenFlow runs (1 and 2 ranks, update_interval 2
and 3; tests/fixtures/deepspeed_zenflow_stage3.json, ci/tools/make_zenflow_stage3_fixture.py)
are matched within 1.5e-6 (float32 rounding), with the one difference stated in
``assert_matches_deepspeed``.

Run as a script, this file is the rank worker (``run_ranks``).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import test_zenflow as zft
import zero_core
from test_zenflow import CASES, assert_close, config, reference, step_inputs
from zero_core.stage3 import GatheredParameters

#: 2 ranks, fp32: the unit (244 elements, padded to 256) splits at 128 = row 9, column 2 of w1
SPLIT = {"w1": (10, 14), "b1": (10,), "w2": (7, 10), "w3": (3, 4, 2)}


def gathered(engine) -> dict:
    """The parameters, gathered from the partitions (collective)."""
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return {n: p.detach().cpu().double().clone() for n, p in engine.module.named_parameters()}


def run(engine, seed, first, last, rank=0):
    out = []
    for t in range(first, last + 1):
        engine.backward(engine(*step_inputs(seed, t, rank)))
        engine.step()
        out.append(gathered(engine))
    return out


def config3(zf, accelerator=None, bf16=False, param=None, path=None) -> dict:
    """Stage 3's config; *param*: ``offload_param.device`` ("cpu"/"nvme", files in *path*)."""
    cfg = config(zf, 3, accelerator, bf16)
    if param is not None:
        if param == "nvme":
            os.makedirs(path, exist_ok=True)
        cfg["zero_optimization"]["offload_param"] = {"device": param, "nvme_path": str(path),
                                                     "buffer_count": 4, "buffer_size": 512,
                                                     "max_in_cpu": 0}
    return cfg


def train3(zf, steps, seed, rank=0, bf16=False, accelerator=None, param=None, path=None):
    engine, *_ = zero_core.initialize(model=zft.Linear(seed),
                                      config=config3(zf, accelerator, bf16, param, path))
    return engine, run(engine, seed, 1, steps, rank)


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[n], y[n]) for x, y in zip(a, b) for n in x)


@pytest.mark.parametrize("case", sorted(CASES))
def test_stage3_follows_the_float64_rules(case):
    zf, seed = CASES[case], 100 + sorted(CASES).index(case)
    engine, got = train3(zf, 9, seed)
    assert type(engine.optimizer).__name__ == "ZenFlowStage3Optimizer"
    assert_close(got, reference(zf, 9, seed))
    assert engine.optimizer.stats["selections"] == (3 if "reselect" in case else 1)
    engine.destroy()


@pytest.mark.parametrize("param", [None, "cpu", "nvme"])
def test_update_interval_one_is_plain_stage3_offload(tmp_path, param):
    """... with ``offload_param`` too (the plain offloaded optimizer's write path)."""
    seed = 12
    _, plain = train3(None, 5, seed, param=param, path=tmp_path / "a")
    engine, got = train3({"update_interval": 1, "topk_ratio": 0.3}, 5, seed, param=param,
                         path=tmp_path / "b")
    assert (engine.optimizer.param_sink is None) == (param is None)
    assert same(got, plain)
    engine.destroy()


@pytest.mark.parametrize("case,param,bf16", [("overlap_reselect_offload", "cpu", False),
                                             ("overlap_reselect_offload", "nvme", True),
                                             ("warmup_reselect", "cpu", True)])
def test_offload_param_equals_the_run_without(tmp_path, case, param, bf16):
    """``offload_param``: the partitions ZenFlow updates (device step and host update) are
    written through the parameter store; bit for bit the run without it, whose parameters
    are the float64 rules' (test_stage3_follows_the_float64_rules)."""
    zf, seed = CASES[case], 41
    _, want = train3(zf, 9, seed, bf16=bf16)
    engine, got = train3(zf, 9, seed, bf16=bf16, param=param, path=tmp_path)
    assert not same(got[:1], got[-1:])
    assert same(got, want)
    engine.destroy()


def test_flush_reaches_the_next_forward_bf16():
    """bf16, overlap_step: flush() applies the host update in flight to the partitions, and
    the next forward (persistent units: gathered copies kept between steps) computes with
    it: the loss is Σ p·x of the float64 reference. Without dropping the gathered copies
    the forward computes with the stale ones (told apart)."""
    zf, seed = CASES["overlap"], 17
    want = reference(zf, 5, seed, grad_dtype=torch.bfloat16, flush=True)
    want = [{n: v.to(torch.bfloat16).double() for n, v in h.items()} for h in want]
    xs = step_inputs(seed, 99, 0)

    def loss_after_flush(drop: bool):
        engine, got = train3(zf, 5, seed, bf16=True)
        if not drop:
            engine.optimizer._partitions_changed = lambda: None
        engine.optimizer.flush()
        with torch.no_grad():
            loss = float(engine(*xs))
        got.append(gathered(engine))
        engine.destroy()
        return loss, got

    loss, got = loss_after_flush(True)
    assert not torch.equal(got[-1]["w1"], got[-2]["w1"])   # the flush moved the parameters
    assert_close(got, want, rtol=8e-3, atol=1e-3)
    expect = sum((want[-1][n] * x[0].double()).sum() for n, x in zip(zft.SHAPES, xs)).item()
    assert abs(loss - expect) <= 0.05 + 0.01 * abs(expect)
    stale, _ = loss_after_flush(False)
    assert abs(stale - expect) > 10 * abs(loss - expect) + 1e-3


RESUME = [  # (case, save after step, bf16, offload_param)
    ("overlap", 5, False, None),                   # mid-window, the t=4 host update in flight
    ("overlap_reselect_offload", 6, True, None),   # bf16, host moments, an update in flight
    ("overlap_reselect_offload", 6, False, "cpu"),  # the partitions in the parameter store
    ("overlap_reselect_offload", 6, True, "nvme"),  # ... in its files (no host copies)
]


@pytest.mark.parametrize("case,saved_at,bf16,param", RESUME)
def test_resume_equals_the_uninterrupted_run(tmp_path, case, saved_at, bf16, param):
    zf, seed, more = CASES[case], 31, 4
    engine, _ = train3(zf, saved_at, seed, bf16=bf16, param=param, path=tmp_path / "p")
    engine.save_checkpoint(str(tmp_path), tag="ck")
    want = run(engine, seed, saved_at + 1, saved_at + more)
    engine.destroy()
    fresh, *_ = zero_core.initialize(model=zft.Linear(seed + 1),
                                     config=config3(zf, None, bf16, param, tmp_path / "q"))
    fresh.load_checkpoint(str(tmp_path), tag="ck")
    assert fresh.optimizer.t == saved_at
    assert same(run(fresh, seed, saved_at + 1, saved_at + more), want)
    fresh.destroy()


def test_checkpoints_move_between_stage_2_and_3(tmp_path):
    """ZenFlow's state is saved per parameter fragment at both stages: a stage-3 checkpoint
    resumed at stage 2 (and a stage-2 one at stage 3) continues as the run that saved it, up
    to float32 rounding (the stages group the elements differently, and the kernels' vector
    and tail split with them: 1 ulp apart at most, measured; within one stage, bit for bit)."""
    zf, seed = CASES["overlap_reselect_offload"], 7
    for src, dst in ((3, 2), (2, 3)):
        engine, *_ = zero_core.initialize(model=zft.Linear(seed), config=config(zf, src))
        run(engine, seed, 1, 6)
        engine.save_checkpoint(str(tmp_path), tag=f"s{src}")
        want = run(engine, seed, 7, 9)
        engine.destroy()
        fresh, *_ = zero_core.initialize(model=zft.Linear(seed + 1), config=config(zf, dst))
        fresh.load_checkpoint(str(tmp_path), tag=f"s{src}")
        assert_close(run(fresh, seed, 7, 9), want, rtol=1e-6, atol=1e-7)
        fresh.destroy()


def auto_runs(stage: int, rank: int = 0):
    """``update_interval: "auto"`` (offload/zenflow_auto.py, inherited): the parameters after
    each step and (window's last step, applied at) of each host update."""
    zf = {"update_interval": "auto", "topk_ratio": 0.3, "auto_ratio": 0.5}
    engine, *_ = zero_core.initialize(model=zft.Linear(3), config=config(zf, stage))
    hist = run(engine, 3, 1, 8, rank)
    applied = list(engine.optimizer.stats["applied"])
    engine.destroy()
    return hist, applied


def test_update_interval_auto_at_stage3_decides_as_stage2():
    """The "auto" rule reads the same reduced gradients at stage 3: the same host updates as
    at stage 2, the same parameters up to float32 rounding (see the test above)."""
    (h3, a3), (h2, a2) = auto_runs(3), auto_runs(2)
    assert a3 == a2 and len(a2) >= 3
    assert_close(h3, h2, rtol=1e-6, atol=1e-7)


@pytest.mark.multirank
def test_two_ranks_and_another_world_size(tmp_path, monkeypatch):
    """One 2-rank launch: (a) the rules on 2 ranks, with w1 cut mid-row by the partition
    boundary — both ranks hold the same parameters, those of the float64 reference;
    (b) a 1-rank checkpoint resumed on 2 ranks, and (c) a 2-rank one on 1 rank, both equal
    to the uninterrupted 1-rank run bit for bit (both ranks feed rank 0's inputs, so every
    run sees the same gradients; ZenFlow's state is per element and reshards like the
    moments); (d) DeepSpeed's own 2-rank stage-3 ZenFlow runs (fixture); (e) "auto" as at
    stage 2."""
    from zero_core.testing.ranks import run_ranks
    monkeypatch.setattr(zft, "SHAPES", SPLIT)
    zf, seed, saved_at, more = CASES["overlap_reselect_offload"], 41, 6, 4
    engine, _ = train3(zf, saved_at, seed)
    engine.save_checkpoint(str(tmp_path / "one"), tag="ck")
    want = run(engine, seed, saved_at + 1, saved_at + more)
    engine.destroy()
    results = run_ranks(__file__, 2, "torchrun", args=["ranks", str(tmp_path)],
                        env={"ZERO_CORE_COMM": "gloo"}, timeout=300)
    rules = reference(zf, 9, seed=4, world=2)

    def tensors(hist, like):
        return [{n: torch.tensor(v, dtype=torch.float64).reshape(like[0][n].shape)
                 for n, v in h.items()} for h in hist]
    for r in results:
        assert r.report["w1_cut_mid_row"]
        assert_close(tensors(r.report["rules"], rules), rules)
        assert same(tensors(r.report["resumed"], want), want)
    assert results[0].report["rules"] == results[1].report["rules"]
    for r in results:   # (e) update_interval "auto" on 2 ranks: as at stage 2
        (h3, a3), (h2, a2) = r.report["auto"]["3"], r.report["auto"]["2"]
        assert a3 == a2 and len(a2) >= 3
        assert_close(tensors(h3, rules), tensors(h2, rules), rtol=1e-6, atol=1e-7)
    cases = json.load(open(FIXTURE))["cases"]   # (d) DeepSpeed's 2-rank runs
    for r in results:
        for name in ("world2_u2", "world2_u3"):
            assert_matches_deepspeed(r.report["deepspeed"][name], cases[name])
    fresh, *_ = zero_core.initialize(model=zft.Linear(seed + 1), config=config(zf, 3))
    fresh.load_checkpoint(str(tmp_path / "two"), tag="ck")
    assert same(run(fresh, seed, saved_at + 1, saved_at + more), want)
    fresh.destroy()


# ---- against DeepSpeed 0.19.8's own stage-3 ZenFlow (ci/tools/make_zenflow_stage3_fixture.py) --
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepspeed_zenflow_stage3.json")


class DSNet(torch.nn.Module):
    """The fixture's model: linear in its parameters for fixed inputs."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.l1, self.l2 = torch.nn.Linear(10, 12), torch.nn.Linear(12, 6)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x, c1, c2):
        return (self.l1(x) * c1).sum() + (self.l2(c1) * c2).sum()


def ds_run(case: dict, rank: int = 0) -> list:
    """zero-core on the fixture's model, data and settings (gradient_clipping 0 both)."""
    h = json.load(open(FIXTURE))["hyper"]
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {k: h[k] for k in
                                                     ("lr", "betas", "eps", "weight_decay")}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "zenflow": {"topk_ratio": h["topk_ratio"],
                                             "update_interval": case["update_interval"],
                                             "select_strategy": "step", "select_interval": 100}},
           "safety": {"launcher_notice": False}}
    engine, *_ = zero_core.initialize(model=DSNet(), config=cfg)
    out = []
    for t in range(1, len(case["steps"]) + 1):
        engine.backward(engine(*ds_inputs(t, rank)))
        engine.step()
        out.append({n: v.flatten().tolist() for n, v in gathered(engine).items()})
    engine.destroy()
    return out


def ds_inputs(t: int, rank: int):
    g = torch.Generator().manual_seed(1000 + 10 * t + rank)
    return torch.randn(10, generator=g), torch.randn(12, generator=g), torch.randn(6, generator=g)


def ds_selected(world: int) -> dict:
    """The columns the rules select at step 1 (float64, from the ranks' inputs): the top 30%
    of Σ_rows |mean gradient| of each weight (l1: c1 xᵀ, l2: c2 c1ᵀ)."""
    grads = {"l1.weight": 0, "l2.weight": 0}
    for r in range(world):
        x, c1, c2 = (v.double() for v in ds_inputs(1, r))
        grads["l1.weight"] = grads["l1.weight"] + torch.outer(c1, x) / world
        grads["l2.weight"] = grads["l2.weight"] + torch.outer(c2, c1) / world
    return {n: g.abs().sum(0).topk(int(g.shape[1] * 0.3)).indices for n, g in grads.items()}


def assert_matches_deepspeed(got: list, case: dict) -> None:
    """Within 1.5e-6 absolute (parameters of magnitude up to ~3: a few float32 ulps; measured
    5e-7). DeepSpeed's host step is its fp32 CPU Adam, its device step torch's AdamW, in
    another order of operations than zero-core's kernels: equal up to rounding. Except, on
    2 ranks, the selected elements (columns, biases) right after a host boundary: there
    DeepSpeed shows the host's values until its next device step puts the device's back
    (its 1-rank run, and zero-core on any number of ranks, keep the device's:
    zenflow_stage3.py's docstring)."""
    world, u = case["world_size"], case["update_interval"]
    selected = ds_selected(world) if world > 1 else {}
    for t, (a, b) in enumerate(zip(got, case["steps"]), 1):
        for n in b:
            want = torch.tensor(b[n], dtype=torch.float32).double()
            diff = (torch.tensor(a[n], dtype=torch.float64) - want).abs()
            if t % u == 0 and world > 1:   # the unselected columns only (biases: all selected)
                diff = diff.view(-1, 10 if n == "l1.weight" else 12) if n in selected else 0 * diff
                if n in selected:
                    diff[:, selected[n]] = 0
            err = diff.max().item()
            assert err <= 1.5e-6, f"step {t}, {n}: off DeepSpeed's by {err:.3g}"


@pytest.mark.parametrize("name", ["world1_u2", "world1_u3"])
def test_one_rank_matches_deepspeed(name):
    case = json.load(open(FIXTURE))["cases"][name]
    assert_matches_deepspeed(ds_run(case), case)


@pytest.mark.multirank
def test_on_vdev_equal_to_cpu():
    """One rank on vdev (asynchronous mode): bit-identical to the cpu run, with
    ``offload_param`` cpu too (device values written into host partitions)."""
    pytest.importorskip("zero_core_vdev", reason="examples/vdev is not installed")
    from zero_core.testing.ranks import run_ranks
    (r,) = run_ranks(__file__, 1, "torchrun", args=["vdev"],
                     env={"ZERO_CORE_ACCELERATOR": "vdev", "VDEV_ASYNC": "1"}, timeout=300)
    assert r.report["device"] == "vdev" and r.report["misplaced"] == []
    _, cpu = train3(CASES["overlap_reselect_offload"], 9, seed=8)
    assert r.report["param_misplaced"] == []
    for key in ("history", "param_history"):
        got = [{n: torch.tensor(v, dtype=torch.float64).reshape(cpu[0][n].shape)
                for n, v in h.items()} for h in r.report[key]]
        assert same(got, cpu), key


def _flat(hist):
    return [{n: v.flatten().tolist() for n, v in h.items()} for h in hist]


def _rank_main(mode: str) -> None:
    from zero_core.runtime.launch import discover
    from zero_core.testing.ranks import report
    rank = discover().rank
    zf = CASES["overlap_reselect_offload"]
    if mode == "vdev":
        from zero_core.testing.device_audit import misplaced
        engine, hist = train3(zf, 9, seed=8)
        out = {"device": engine.device.type, "misplaced": misplaced(engine),
               "history": _flat(hist)}
        engine.destroy()
        engine, hist = train3(zf, 9, seed=8, param="cpu")   # partitions on the host
        out.update(param_misplaced=misplaced(engine), param_history=_flat(hist))
        engine.destroy()
        report(out)
        return
    zft.SHAPES = SPLIT
    where, seed, saved_at, more = sys.argv[2], 41, 6, 4
    engine, rules = train3(zf, 9, seed=4, rank=rank)
    gb = engine.optimizer.buffers[0]
    w1 = [p.shape for p in gb.params].index(torch.Size(SPLIT["w1"]))
    cut = gb.layout.shard_start(0, 1) - gb.layout.offsets[w1]
    engine.destroy()
    engine, *_ = zero_core.initialize(model=zft.Linear(seed + 1), config=config(zf, 3))
    engine.load_checkpoint(os.path.join(where, "one"), tag="ck")
    resumed = run(engine, seed, saved_at + 1, saved_at + more)
    engine.destroy()
    engine, _ = train3(zf, saved_at, seed)   # rank 0's inputs on both ranks
    engine.save_checkpoint(os.path.join(where, "two"), tag="ck")
    engine.destroy()
    cases = json.load(open(FIXTURE))["cases"]
    report({"rules": _flat(rules), "resumed": _flat(resumed),
            "deepspeed": {n: ds_run(cases[n], rank) for n in ("world2_u2", "world2_u3")},
            "auto": {s: [_flat(h), a] for s, (h, a) in
                     ((st, auto_runs(st, rank)) for st in (2, 3))},
            "w1_cut_mid_row": 0 < cut < SPLIT["w1"][0] * SPLIT["w1"][1]
            and cut % SPLIT["w1"][1] != 0})


if __name__ == "__main__":
    _rank_main(sys.argv[1])
