"""ZenFlow (zero_optimization.zenflow, zero_core/offload/zenflow.py) against a float64
re-implementation of its rules on random gradients, on 1 and 2 ranks, cpu and vdev.

The model's loss is linear in its parameters (sum of parameter × input), so the gradient
of every step is exactly the mean of the ranks' random inputs whatever the parameters are:
the reference gets the same gradients in float64, and what is compared is the update rule
alone (selection, device Adam on the selected columns, host Adam on window means every
update_interval steps, one window late with overlap_step). fp32 engine vs float64
reference: 2e-5 relative. With update_interval 1 the engine equals plain offloaded Adam bit
for bit (the bound of the docstring). The overlap test holds the worker at a gate: step()
returns while the host update has not run, and its result reaches the parameters at the
next host boundary, not before. Checkpoints: a run saved after N steps (mid-window, with a
host update in flight, in the warm-up; sync and async; 1 -> 2 -> 1 ranks) and resumed in a
fresh engine equals the run that saved it, bit for bit. update_interval "auto": the engine
against the rule in float64, the rule against DeepSpeed's own decisions (fixture), resume.

Run as a script, this file is the 2-rank worker (``run_ranks``).
"""
from __future__ import annotations

import math
import os
import sys
import threading

import pytest
import torch

import zero_core
from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.offload.zenflow import worker_cores

SHAPES = {"w1": (12, 10), "b1": (12,), "w2": (6, 12), "w3": (3, 4, 2)}
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.99), 1e-8, 0.01


class Linear(torch.nn.Module):
    """loss = Σ parameter × input: the gradient of each parameter is its input."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, shape in SHAPES.items():
            setattr(self, name, torch.nn.Parameter(torch.randn(shape, generator=g)))

    def forward(self, *xs):
        return sum((getattr(self, n) * x[0]).sum() for n, x in zip(SHAPES, xs))


def step_inputs(seed: int, step: int, rank: int, cols: bool = False):
    """*cols*: the columns of 2-D inputs scaled from 6.3 down to 0.05 (heavy columns stay
    heavy, so update_interval "auto" keeps windows of several steps)."""
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    xs = [torch.randn((1,) + s, generator=g) for s in SHAPES.values()]
    return [x * torch.logspace(0.8, -1.3, x.shape[-1]) if cols and x.dim() == 3 else x
            for x in xs]


def config(zf: dict | None, stage: int = 2, accelerator: str | None = None,
           bf16: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,  # the rules: unclipped
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                     "weight_decay": WD}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"},
                                 "reduce_bucket_size": 100},
           "safety": {"launcher_notice": False}}
    if zf is not None:
        cfg["zero_optimization"]["zenflow"] = zf
    if accelerator:
        cfg["accelerator"] = accelerator
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(zf, steps, seed, stage=2, accelerator=None, world=1, rank=0, bf16=False, cols=False):
    engine, *_ = zero_core.initialize(model=Linear(seed),
                                      config=config(zf, stage, accelerator, bf16))
    history = []
    for t in range(1, steps + 1):
        loss = engine(*step_inputs(seed, t, rank, cols))
        engine.backward(loss)
        engine.step()
        history.append({n: p.detach().cpu().double().clone()
                        for n, p in engine.module.named_parameters()})
    return engine, history


# ---- the float64 reference ------------------------------------------------------------------
def adam(p, g, m, v, step):
    m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    p.mul_(1 - LR * WD)
    denom = (v / (1 - BETAS[1] ** step)).sqrt().add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** step))


def reference(zf: dict, steps: int, seed: int, world: int = 1, steps_per_epoch: int = 0,
              grad_dtype=torch.float64, flush: bool = False, cols: bool = False,
              fired: list | None = None):
    """The rules of zero_core/offload/zenflow.py's docstring, in float64 on whole tensors
    (*grad_dtype*: the gradients as the engine's parameters hold them; *flush*: one more
    entry, the parameters after the host update in flight is applied; *fired*: gets the
    steps after the warm-up with a host update; update_interval "auto": the rule of
    offload/zenflow_auto.py's docstring)."""
    U, W = zf.get("update_interval", "auto"), zf.get("full_warm_up_rounds", 0)
    auto_ratio, non, avg, scaled = zf.get("auto_ratio", 0.99), {}, {}, cols
    strategy = zf.get("select_strategy", "auto")
    S = zf["select_interval"] if strategy == "step" else (
        steps_per_epoch * (1 if strategy == "auto" else zf["select_interval"]))
    overlap, ratio = zf.get("overlap_step", False), zf.get("topk_ratio", 0.1)
    model = Linear(seed)
    P = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    M = {n: p.clone() for n, p in P.items()}
    hm = {n: torch.zeros_like(p) for n, p in P.items()}
    hv = {n: torch.zeros_like(p) for n, p in P.items()}
    acc = {n: torch.zeros_like(p) for n, p in P.items()}
    mask, w, dm, dv = {}, {}, {}, {}
    window, dev_steps, pending, history = 0, 0, False, []

    def apply():
        for n in P:
            P[n] = M[n].clone()
            if n in mask:
                P[n][mask[n]] = w[n]

    for t in range(1, steps + 1):
        xs = [step_inputs(seed, t, r, scaled) for r in range(world)]
        G = {n: sum(x[i].to(grad_dtype).double()[0] for x in xs)
             / world for i, n in enumerate(P)}
        if t <= W:
            for n in P:
                adam(M[n], G[n], hm[n], hv[n], t)
            apply()
            history.append({n: p.clone() for n, p in P.items()})
            continue
        if t == W + 1 or (S > 0 and (t - 1) % S == 0):
            if pending:
                apply()
                pending = False
            for n, g in G.items():
                if g.dim() == 2:
                    cols = g.abs().sum(0).topk(max(1, int(g.shape[1] * ratio))).indices
                    mask[n] = torch.zeros_like(g, dtype=torch.bool)
                    mask[n][:, cols] = True
                else:
                    mask[n] = torch.ones_like(g, dtype=torch.bool)
                w[n] = M[n][mask[n]].clone()
                dm[n], dv[n] = torch.zeros_like(w[n]), torch.zeros_like(w[n])
        dev_steps += 1
        for n in P:
            adam(w[n], G[n][mask[n]], dm[n], dv[n], dev_steps)
            P[n][mask[n]] = w[n]
            acc[n] += G[n]
        window += 1
        if U == "auto":
            k, need = ratio, 0
            for n in (n for n in P if P[n].dim() == 2):
                c = G[n][mask[n]].abs().sum().item()
                avg[n] = (avg.get(n, 0.0) * (window - 1) + c) / window / (10 * k)
                non[n] = non.get(n, 0.0) + (G[n].abs().sum().item() - c) / (10 * (1 - k))
                need += non[n] >= avg[n]
            due = need >= int(auto_ratio * len(avg))
        else:
            due = (t - W) % U == 0
        if due or (S > 0 and t % S == 0):
            non = {}
            if fired is not None:
                fired.append(t)
            if overlap and pending:
                apply()
            for n in P:
                adam(M[n], acc[n] / window, hm[n], hv[n], t)
                M[n][mask[n]] = w[n]
                acc[n].zero_()
            window = 0
            if overlap:
                pending = True
            else:
                apply()
        history.append({n: p.clone() for n, p in P.items()})
    if flush:
        if pending:
            apply()
        history.append({n: p.clone() for n, p in P.items()})
    return history


def assert_close(got: list, want: list, rtol=2e-5, atol=2e-6):
    assert len(got) == len(want)
    for t, (g, r) in enumerate(zip(got, want), 1):
        for n in r:
            err = (g[n] - r[n]).abs().max().item()
            bound = atol + rtol * r[n].abs().max().item()
            assert err <= bound, f"step {t}, {n}: off by {err:.3g} (bound {bound:.3g})"


CASES = {
    "sequential": {"update_interval": 3, "topk_ratio": 0.3},
    "overlap": {"update_interval": 2, "topk_ratio": 0.2, "overlap_step": True},
    "warmup_reselect": {"update_interval": 2, "topk_ratio": 0.3, "full_warm_up_rounds": 2,
                        "select_strategy": "step", "select_interval": 4},
    "overlap_reselect_offload": {"update_interval": 2, "topk_ratio": 0.25, "overlap_step": True,
                                 "select_strategy": "step", "select_interval": 4,
                                 "offload": True},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_follows_the_float64_rules(case):
    zf = CASES[case]
    engine, got = train(zf, 11, seed=hash(case) % 1000)
    assert_close(got, reference(zf, 11, seed=hash(case) % 1000))
    stats = engine.optimizer.stats
    assert stats["selections"] == (3 if "reselect" in case else 1)
    engine.destroy()


def test_bf16_and_flush():
    """bf16 parameters (fp32 master on the host, fp32 copy of the selected values on the
    device), within one bf16 rounding; flush() applies the host update in flight."""
    zf = CASES["overlap"]
    engine, got = train(zf, 5, seed=17, bf16=True)
    engine.optimizer.flush()
    got.append({n: p.detach().double().clone() for n, p in engine.module.named_parameters()})
    want = reference(zf, 5, seed=17, grad_dtype=torch.bfloat16, flush=True)
    assert not torch.equal(got[-1]["w1"], got[-2]["w1"])   # the flush moved the parameters
    assert_close(got, [{n: v.to(torch.bfloat16).double() for n, v in h.items()} for h in want],
                 rtol=8e-3, atol=1e-3)
    engine.destroy()


def test_a_wrong_rule_is_told_apart():
    """The comparison can fail: the reference without the one-window delay is far off the
    overlapped engine."""
    zf = CASES["overlap"]
    _, got = train(zf, 8, seed=5)
    with pytest.raises(AssertionError, match="off by"):
        assert_close(got, reference({**zf, "overlap_step": False}, 8, seed=5))


def test_update_interval_one_is_plain_offloaded_adam():
    """U = 1, select once, no warm-up: every element takes one Adam step per step from the
    same gradient with the same step count — bit for bit the plain offloaded step."""
    seed = 11
    _, plain = train(None, 6, seed)
    for zf in ({"update_interval": 1, "topk_ratio": 0.3},
               {"update_interval": 1, "topk_ratio": 0.5, "overlap_step": False}):
        _, got = train(zf, 6, seed)
        for a, b in zip(got, plain):
            assert all(torch.equal(a[n], b[n]) for n in a)


def test_host_update_overlaps_and_lands_one_window_later():
    """The worker is held at a gate: the boundary step returns with the host update not run,
    the parameters do not move by it until the next boundary, where it is applied."""
    zf = {"update_interval": 2, "topk_ratio": 0.2, "overlap_step": True}
    seed = 21
    want = reference(zf, 6, seed)
    engine, *_ = zero_core.initialize(model=Linear(seed), config=config(zf))
    opt = engine.optimizer
    started, release = threading.Event(), threading.Event()

    placed = []

    def gate():
        placed.append(sorted(os.sched_getaffinity(0)))
        started.set()
        assert release.wait(60)
    opt._before_host_update = gate
    got = []
    for t in range(1, 7):
        engine.backward(engine(*step_inputs(seed, t, 0)))
        engine.step()
        if t == 2:   # the first host boundary: submitted, held, step() returned anyway
            assert started.wait(30) and opt._job is not None and not opt._job[1].done()
            assert opt.stats["host_updates"] == 0
        if t == 3:
            release.set()
        got.append({n: p.detach().double().clone() for n, p in engine.module.named_parameters()})
    assert_close(got, want)
    assert list(opt.stats["applied"]) == [(2, 4), (4, 6)]   # (window's last step, applied at)
    # pt_reserved_cores_perc 0.5: the worker thread keeps off the training thread's half
    assert placed[0] == worker_cores(sorted(os.sched_getaffinity(0)), 0.5)
    engine.destroy()


def test_epoch_selection_reads_the_loader():
    data = [tuple(x[0] for x in step_inputs(3, t, 0)) for t in range(1, 5)]
    zf = {"update_interval": 2, "topk_ratio": 0.3}
    engine, _, loader, _ = zero_core.initialize(model=Linear(3), config=config(zf),
                                                training_data=data)
    assert engine.optimizer.select_every == len(data)   # auto: every epoch of 4 steps
    engine.destroy()


def test_worker_cores_split():
    assert worker_cores([0, 1, 2, 3], 0.5) == [2, 3]
    assert worker_cores([0, 1], 0.5) == [1]
    assert worker_cores([0, 1], 0.0) == [0, 1] == worker_cores([0, 1], 1.0)


@pytest.mark.parametrize("zf, stage, key", [
    ({"update_interval": "every"}, 2, "update_interval"),
    ({"auto_ratio": 1.5}, 2, "auto_ratio"),
    ({"update_interval": 2, "topk_ratio": 1.0}, 2, "topk_ratio"),
    ({"update_interval": 4, "select_strategy": "step", "select_interval": 2}, 2, "select_interval"),
    ({"update_interval": 2, "select_interval": 3}, 2, "select_interval"),
    ({"update_interval": 2, "select_strategy": "step"}, 2, "select_interval"),
    ({"update_interval": 2, "topk": 0.1}, 2, "topk"),
])
def test_refusals_name_the_key(zf, stage, key):
    cfg = config(zf, stage)
    with pytest.raises(ConfigError, match=key):
        zero_core.config.parse_config(cfg)


def test_needs_cpu_offload():
    cfg = config({"update_interval": 2})
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    with pytest.raises(ConfigError, match="offload_optimizer.device"):
        zero_core.config.parse_config(cfg)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": 0.5}
    with pytest.raises(ConfigError, match="offload_optimizer.ratio"):
        zero_core.config.parse_config(cfg)


def run_steps(engine, seed, first, last, rank=0, cols=False):
    """Steps *first*..*last* (inputs of that step number); the parameters after each."""
    out = []
    for t in range(first, last + 1):
        engine.backward(engine(*step_inputs(seed, t, rank, cols)))
        engine.step()
        out.append({n: p.detach().cpu().double().clone()
                    for n, p in engine.module.named_parameters()})
    return out


def optimizer_state(engine) -> dict:
    """The host master and moments, flattened (compared after the last step), after
    the host update in flight (overlap_step) is done."""
    opt = engine.optimizer
    opt.flush()
    return {f"{j}.{n}": fb.data.clone() for j, st in enumerate(opt._flat_state)
            for n, fb in st.items()} | {
        f"{j}.master": opt.store.flat(j, "master").data.clone()
        for j, gb in enumerate(opt.buffers) if gb is not None}


RESUME = [  # (case, save after step, async save, bf16)
    ("sequential", 7, False, False),                # mid-window (1 of 3 steps), no overlap
    ("overlap", 5, False, False),                   # mid-window, the t=4 update in flight
    ("overlap", 5, True, False),
    ("overlap", 5, False, True),                    # bf16 parameters, fp32 master
    ("overlap_reselect_offload", 6, False, False),  # an update in flight, host moments
    ("warmup_reselect", 1, False, False),           # in the warm-up: no selection yet
]


@pytest.mark.parametrize("case,saved_at,in_background,bf16", RESUME)
def test_resume_equals_the_uninterrupted_run(tmp_path, case, saved_at, in_background, bf16):
    """Train N steps, save, train M more == a fresh engine (other initial weights) that
    loads the checkpoint and trains the same M steps: bit for bit (the same fp32 kernels
    on the same values; the save flushed the update in flight in both runs)."""
    zf, seed, more = CASES[case], 31, 5
    engine, _ = train(zf, saved_at, seed=seed, bf16=bf16)
    engine.save_checkpoint(str(tmp_path), tag="ck", async_save=in_background)
    want = run_steps(engine, seed, saved_at + 1, saved_at + more)
    engine.wait_for_checkpoint()
    want_state = optimizer_state(engine)
    engine.destroy()
    fresh, *_ = zero_core.initialize(model=Linear(seed + 1), config=config(zf, bf16=bf16))
    fresh.load_checkpoint(str(tmp_path), tag="ck")
    assert fresh.optimizer.t == saved_at
    got = run_steps(fresh, seed, saved_at + 1, saved_at + more)
    for a, b in zip(got, want):
        assert all(torch.equal(a[n], b[n]) for n in a)
    got_state = optimizer_state(fresh)
    bad = [k for k in want_state if not torch.equal(got_state[k], want_state[k])]
    assert not bad, (bad, [(got_state[k] - want_state[k]).abs().max() for k in bad])
    fresh.destroy()


def test_resume_needs_the_window(tmp_path):
    """The check can fail: a load that drops the window's gradient sum (what a plain
    offload checkpoint would restore) does not continue the run."""
    zf, seed = CASES["sequential"], 32
    engine, _ = train(zf, 7, seed=seed)
    engine.save_checkpoint(str(tmp_path), tag="ck")
    want = run_steps(engine, seed, 8, 9)
    engine.destroy()
    fresh, *_ = zero_core.initialize(model=Linear(seed), config=config(zf))
    fresh.load_checkpoint(str(tmp_path), tag="ck")
    fresh.optimizer._window = 0   # forget the window's first step
    got = run_steps(fresh, seed, 8, 9)
    assert not torch.equal(got[-1]["w1"], want[-1]["w1"])
    fresh.destroy()


@pytest.mark.multirank
def test_resume_on_another_world_size(tmp_path):
    """1 rank -> 2 ranks and 2 -> 1 (one launch): ZenFlow's state is per element, so it
    reshards like the moments (the selection is by columns, the same on every rank). Both
    ranks train on rank 0's inputs, so every run sees the same gradients: bit for bit."""
    from zero_core.testing.ranks import run_ranks
    zf, seed, saved_at, more = CASES["overlap_reselect_offload"], 41, 6, 4
    engine, _ = train(zf, saved_at, seed=seed)
    engine.save_checkpoint(str(tmp_path / "one"), tag="ck")
    want = run_steps(engine, seed, saved_at + 1, saved_at + more)
    engine.destroy()
    results = run_ranks(__file__, 2, "torchrun", args=["reshard", str(tmp_path)],
                        env={"ZERO_CORE_COMM": "gloo"}, timeout=300)
    for r in results:
        got = [{n: torch.tensor(v, dtype=torch.float64).reshape(want[0][n].shape)
                for n, v in h.items()} for h in r.report["history"]]
        for a, b in zip(got, want):
            assert all(torch.equal(a[n], b[n]) for n in a)
    fresh, *_ = zero_core.initialize(model=Linear(seed + 1), config=config(zf))
    fresh.load_checkpoint(str(tmp_path / "two"), tag="ck")
    got = run_steps(fresh, seed, saved_at + 1, saved_at + more)
    for a, b in zip(got, want):
        assert all(torch.equal(a[n], b[n]) for n in a)
    fresh.destroy()


def test_checkpoints_between_zenflow_and_plain_offload(tmp_path):
    """A plain offload checkpoint lacks ZenFlow's state: refused with optimizer states,
    loaded without; a ZenFlow checkpoint loads into plain offload (its master and moments)."""
    engine, _ = train(None, 2, seed=3)
    engine.save_checkpoint(str(tmp_path), tag="plain")
    engine.destroy()
    fresh, *_ = zero_core.initialize(model=Linear(3), config=config(CASES["sequential"]))
    with pytest.raises(Exception, match="zenflow_acc.*load_optimizer_states=False"):
        fresh.load_checkpoint(str(tmp_path), tag="plain")
    fresh.load_checkpoint(str(tmp_path), tag="plain", load_optimizer_states=False)
    run_steps(fresh, 3, 3, 4)
    fresh.save_checkpoint(str(tmp_path), tag="zf")
    master = fresh.optimizer.store.flat(0, "master").data.clone()
    fresh.destroy()
    plain, *_ = zero_core.initialize(model=Linear(4), config=config(None))
    plain.load_checkpoint(str(tmp_path), tag="zf")
    assert torch.equal(plain.optimizer.store.flat(0, "master").data, master)
    plain.destroy()


@pytest.mark.multirank
def test_on_vdev_equal_to_cpu_and_states_where_they_belong():
    """One rank on vdev (asynchronous mode: late non-blocking copies are wrong numbers):
    bit-identical to the cpu run, every engine tensor where it belongs."""
    pytest.importorskip("zero_core_vdev", reason="examples/vdev is not installed")
    from zero_core.testing.ranks import run_ranks
    (r,) = run_ranks(__file__, 1, "torchrun", args=["vdev"],
                     env={"ZERO_CORE_ACCELERATOR": "vdev", "VDEV_ASYNC": "1"}, timeout=300)
    assert r.report["device"] == "vdev" and r.report["misplaced"] == []
    _, cpu = train(CASES["overlap_reselect_offload"], 9, seed=8)
    got = [{n: torch.tensor(v, dtype=torch.float64).reshape(cpu[0][n].shape)
            for n, v in h.items()} for h in r.report["history"]]
    for a, b in zip(got, cpu):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert_close(got, reference(CASES["overlap_reselect_offload"], 9, seed=8))


@pytest.mark.multirank
def test_two_ranks_follow_the_rules():
    """Stages 1 and 2 on 2 ranks (one launch): partitions split rows of a weight, the column
    sums are all-reduced, every rank keeps the same parameters; update_interval "auto" at
    stage 2 (the rule's sums all-reduced too)."""
    from zero_core.testing.ranks import run_ranks
    results = run_ranks(__file__, 2, "torchrun", args=["ranks"],
                        env={"ZERO_CORE_COMM": "gloo"}, timeout=300)
    want = reference(CASES["overlap_reselect_offload"], 9, seed=4, world=2)
    auto = reference(AUTO["overlap_reselect"], 9, seed=4, world=2, cols=True)
    for r in results:
        for stage, ref in (("1", want), ("2", want), ("auto", auto)):
            got = [{n: torch.tensor(v, dtype=torch.float64).reshape(ref[0][n].shape)
                    for n, v in h.items()} for h in r.report[stage]]
            assert_close(got, ref)


# ---- update_interval "auto" (offload/zenflow_auto.py) ---------------------------------------
AUTO = {"plain": {"topk_ratio": 0.3}, "overlap_reselect": {
    "topk_ratio": 0.25, "auto_ratio": 1.0, "overlap_step": True, "select_strategy": "step",
    "select_interval": 7, "full_warm_up_rounds": 1}}
FIXTURE = "deepspeed_zenflow_auto.json"   # ci/tools/make_zenflow_auto_fixture.py


@pytest.mark.parametrize("case", sorted(AUTO))
def test_auto_follows_the_float64_rules(case):
    """The engine's parameters every step equal the float64 model's, whose host updates fire
    where the rule says (windows of unequal lengths: the rule, not a fixed interval)."""
    zf, fired = AUTO[case], []
    engine, got = train(zf, 13, seed=7, cols=True)
    want = reference(zf, 13, seed=7, cols=True, fired=fired)
    assert_close(got, want)
    gaps = {b - a for a, b in zip(fired, fired[1:])}
    assert len(gaps) > 1 and max(gaps) > 2, fired
    if not zf.get("overlap_step"):
        assert [w for w, _ in engine.optimizer.stats["applied"]] == fired
    with pytest.raises(AssertionError, match="off by"):   # a wrong threshold is told apart
        assert_close(got, reference({**zf, "auto_ratio": 0.3 if "auto_ratio" in zf else 1.0},
                                    13, seed=7, cols=True))
    engine.destroy()


def test_auto_decisions_equal_deepspeeds():
    """DeepSpeed 0.19.8's own auto runs (ci/tools/make_zenflow_auto_fixture.py): fed the sums
    DeepSpeed computed, with its windows, the rule decides as DeepSpeed did on every step;
    DeepSpeed as released fires only at reselections (config/zenflow_section.py)."""
    import json
    import types
    from zero_core.offload.zenflow_auto import AutoInterval
    with open(os.path.join(os.path.dirname(__file__), "fixtures", FIXTURE)) as fh:
        fixture = json.load(fh)
    assert fixture["unpatched_first_grad_finite"] is False   # loss ÷ update_interval 0
    zf, decided = fixture["zenflow"], 0
    for name, case in fixture["cases"].items():
        rule = AutoInterval(types.SimpleNamespace(buffers=[types.SimpleNamespace(
            params=[torch.zeros(1, 1)] * case["num_2d_weights"])]), zf["topk_ratio"],
            zf["auto_ratio"])
        for t, st in enumerate(case["steps"], 1):
            if st["window_step"] == 1:
                rule.restart()
            ws = [st["weights"][k] for k in sorted(st["weights"])]
            due = rule.decide(st["window_step"], [w["total"] for w in ws],
                              [w["critic"] for w in ws])
            assert due == st["flag"], (name, t)
            assert sum(a >= b for a, b in zip(rule.non, rule.avg)) == st["num_need_update"]
            for mine, w in zip(zip(rule.non, rule.avg), ws):   # DeepSpeed's non sum is bf16
                assert mine == pytest.approx((w["non_critic_sum"], w["avg_critic_sum"]),
                                             rel=2e-2)
            decided += due
        fires = [t for t, st in enumerate(case["steps"], 1) if st["boundary"]]
        flags = [t for t, st in enumerate(case["steps"], 1) if st["flag"]]
        if name.startswith("observed"):   # raised, never read: only the reselections fire
            assert fires == [7, 14] and len(flags) == 14
        else:                             # repaired: one step late, so in pairs
            assert set(fires) == {t + 1 for t in flags if t < 14} | {7, 14}
    assert decided > 30


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_resume_equals_the_uninterrupted_run(tmp_path, overlap):
    """Saved mid-window (the rule's sums not zero) and resumed in a fresh engine: bit for
    bit; the check fails when the load forgets the rule's sums."""
    zf, seed, saved_at, more = {**AUTO["plain"], "overlap_step": overlap}, 12, 5, 6
    engine, _ = train(zf, saved_at, seed=seed, cols=True)
    assert engine.optimizer._window > 0 and any(engine.optimizer.auto.non)
    engine.save_checkpoint(str(tmp_path), tag="ck")
    want = run_steps(engine, seed, saved_at + 1, saved_at + more, cols=True)
    engine.destroy()
    for forget in (False, True):
        fresh, *_ = zero_core.initialize(model=Linear(seed + 1), config=config(zf))
        fresh.load_checkpoint(str(tmp_path), tag="ck")
        if forget:
            fresh.optimizer.auto.restart()
        got = run_steps(fresh, seed, saved_at + 1, saved_at + more, cols=True)
        same = all(torch.equal(a[n], b[n]) for a, b in zip(got, want) for n in a)
        assert same != forget
        fresh.destroy()


def _rank_main(mode: str) -> None:
    from zero_core.runtime.launch import discover
    from zero_core.testing.ranks import report
    rank = discover().rank
    zf = CASES["overlap_reselect_offload"]
    if mode == "vdev":
        from zero_core.testing.device_audit import misplaced
        engine, hist = train(zf, 9, seed=8)
        report({"device": engine.device.type, "misplaced": misplaced(engine),
                "history": [{n: v.flatten().tolist() for n, v in h.items()} for h in hist]})
        engine.destroy()
        return
    if mode == "reshard":  # test_resume_on_another_world_size
        where, seed, saved_at, more = sys.argv[2], 41, 6, 4
        engine, *_ = zero_core.initialize(model=Linear(seed + 1), config=config(zf))
        engine.load_checkpoint(os.path.join(where, "one"), tag="ck")
        hist = run_steps(engine, seed, saved_at + 1, saved_at + more)
        engine.destroy()
        engine, _ = train(zf, saved_at, seed=seed)   # rank 0's inputs on both ranks
        engine.save_checkpoint(os.path.join(where, "two"), tag="ck")
        engine.destroy()
        report({"history": [{n: v.flatten().tolist() for n, v in h.items()} for h in hist]})
        return
    out = {}
    for stage in (1, 2):
        engine, hist = train(zf, 9, seed=4, stage=stage, world=2, rank=rank)
        out[str(stage)] = [{n: v.flatten().tolist() for n, v in h.items()} for h in hist]
        engine.destroy()
    engine, hist = train(AUTO["overlap_reselect"], 9, seed=4, world=2, rank=rank, cols=True)
    out["auto"] = [{n: v.flatten().tolist() for n, v in h.items()} for h in hist]
    engine.destroy()
    report(out)


if __name__ == "__main__":
    _rank_main(sys.argv[1])
