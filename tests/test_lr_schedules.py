"""LR schedules against DeepSpeed's documented formulas, written out here independently as
plain float math, on random settings; plus edge cases, state and integration with optimizers."""
import math
import random

import pytest
import torch

from zero_core.config import parse_config
from zero_core.errors import ConfigError
from zero_core.optim.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


def warm(it, steps, kind):
    """Fraction of the warmup done after step *it* (DeepSpeed: at least two warmup steps)."""
    n = max(2, steps)
    return math.log(it + 1) / math.log(n) if kind == "log" else it / n


def ref_warmup_lr(it, lo, hi, steps, kind):
    if it < 0:
        return lo
    if it < max(2, steps):
        return lo + (hi - lo) * warm(it, steps, kind)
    return hi


def ref_warmup_decay_lr(it, lo, hi, steps, total, kind):
    n = max(2, steps)
    if it < 0:
        return lo
    if it < n:
        return lo + (hi - lo) * warm(it, steps, kind)
    remaining = (total - it) / max(1, total - n)
    return lo + (hi - lo) * max(0.0, remaining)


def ref_warmup_cosine_lr(it, base, steps, total, kind, start_ratio, end_ratio):
    n = max(2, steps)
    if it < 0:
        return 0.0
    if it < n:
        return base * (start_ratio + (1 - start_ratio) * warm(it, steps, kind))
    progress = min(1.0, (it - n + 1) / max(1, total - n))
    return base * max(0.0, end_ratio + (1 - end_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sgd(lrs):
    """A torch SGD with one parameter group per entry of *lrs*."""
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in lrs]
    return torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)])


def lr_trace(sched, optimizer, steps):
    """lr of every group at construction and after each of *steps* steps."""
    trace = [[g["lr"] for g in optimizer.param_groups]]
    for _ in range(steps):
        sched.step()
        trace.append([g["lr"] for g in optimizer.param_groups])
    return trace


@pytest.mark.parametrize("seed", range(6))
def test_warmup_lr_matches_formula(seed):
    rng = random.Random(seed)
    lo, hi = rng.uniform(0, 1e-3), rng.uniform(1e-3, 1e-1)
    steps, kind = rng.randint(1, 30), rng.choice(["log", "linear"])
    opt = sgd([0.5])
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=steps,
                     warmup_type=kind)
    trace = lr_trace(sched, opt, steps + 10)
    for k, lrs in enumerate(trace):
        assert lrs[0] == pytest.approx(ref_warmup_lr(k - 1, lo, hi, steps, kind), rel=1e-12, abs=1e-15)
    assert sched.get_last_lr() == trace[-1]
    assert sched.get_lr() == trace[-1]


@pytest.mark.parametrize("seed", range(6))
def test_warmup_decay_lr_matches_formula(seed):
    rng = random.Random(100 + seed)
    lo, hi = rng.uniform(0, 1e-4), rng.uniform(1e-3, 1e-1)
    steps, kind = rng.randint(1, 20), rng.choice(["log", "linear"])
    total = rng.randint(steps, steps + 40)
    opt = sgd([0.5])
    sched = WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=lo, warmup_max_lr=hi,
                          warmup_num_steps=steps, warmup_type=kind)
    for k, lrs in enumerate(lr_trace(sched, opt, total + 15)):
        want = ref_warmup_decay_lr(k - 1, lo, hi, steps, total, kind)
        assert lrs[0] == pytest.approx(want, rel=1e-12, abs=1e-15), f"iteration {k - 1}"


@pytest.mark.parametrize("seed", range(6))
def test_warmup_cosine_lr_matches_formula(seed):
    rng = random.Random(200 + seed)
    bases = [rng.uniform(1e-4, 1e-1) for _ in range(rng.randint(1, 3))]
    steps, kind = rng.randint(1, 20), rng.choice(["log", "linear"])
    total = rng.randint(steps, steps + 40)
    start, end = rng.uniform(0, 0.5), rng.uniform(0, 0.2)
    opt = sgd(bases)
    sched = WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=start,
                           warmup_num_steps=steps, cos_min_ratio=end, warmup_type=kind)
    for k, lrs in enumerate(lr_trace(sched, opt, total + 15)):
        for base, lr in zip(bases, lrs):
            want = ref_warmup_cosine_lr(k - 1, base, steps, total, kind, start, end)
            assert lr == pytest.approx(want, rel=1e-12, abs=1e-15), f"iteration {k - 1}"


def test_one_warmup_step_is_stretched_to_two():
    # warmup_num_steps 1 -> DeepSpeed warms up over 2 steps. Linear, 0.1 -> 0.3:
    # construction (it -1): 0.1; it 0: 0.1 + 0.2 * 0/2 = 0.1; it 1: 0.1 + 0.2 * 1/2 = 0.2;
    # it 2 on: 0.3. Log: it 1 gives ln 2 / ln 2 = 1 already.
    opt = sgd([1.0])
    sched = WarmupLR(opt, warmup_min_lr=0.1, warmup_max_lr=0.3, warmup_num_steps=1,
                     warmup_type="linear")
    assert [t[0] for t in lr_trace(sched, opt, 4)] == pytest.approx([0.1, 0.1, 0.2, 0.3, 0.3])
    opt = sgd([1.0])
    sched = WarmupLR(opt, warmup_min_lr=0.1, warmup_max_lr=0.3, warmup_num_steps=1)
    assert [t[0] for t in lr_trace(sched, opt, 3)] == pytest.approx([0.1, 0.1, 0.3, 0.3])


def test_past_the_total_the_lr_stays_at_the_end_value():
    opt = sgd([1.0])
    sched = WarmupDecayLR(opt, total_num_steps=10, warmup_min_lr=0.01, warmup_max_lr=0.5,
                          warmup_num_steps=4, warmup_type="linear")
    sched.step(10)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    for it in (11, 50, 10 ** 6):
        sched.step(it)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    opt = sgd([0.2])
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=4, cos_min_ratio=0.05)
    for it in (10, 12, 19, 1000):  # no climbing back up the cosine
        sched.step(it)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * 0.05)


def test_total_not_above_warmup():
    # total <= warmup: right after warmup the decay has nothing left -> the end value.
    opt = sgd([1.0])
    sched = WarmupDecayLR(opt, total_num_steps=3, warmup_min_lr=0.0, warmup_max_lr=1.0,
                          warmup_num_steps=5, warmup_type="linear")
    sched.step(5)
    assert opt.param_groups[0]["lr"] == 0.0
    opt = sgd([1.0])
    sched = WarmupCosineLR(opt, total_num_steps=3, warmup_num_steps=5, cos_min_ratio=0.1)
    sched.step(5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_lr_is_set_at_construction():
    opt = sgd([0.7])
    WarmupLR(opt, warmup_min_lr=0.003, warmup_max_lr=0.1)
    assert opt.param_groups[0]["lr"] == 0.003
    opt = sgd([0.7])
    WarmupCosineLR(opt, total_num_steps=100)
    assert opt.param_groups[0]["lr"] == 0.0  # DeepSpeed's value before the first step
    # warmup_max_lr left out -> the optimizer's lr (of the first group) is the target
    opt = sgd([0.7, 0.9])
    sched = WarmupLR(opt, warmup_num_steps=3, warmup_type="linear")
    sched.step(3)
    assert [g["lr"] for g in opt.param_groups] == [0.7, 0.7]


def test_per_group_lists_and_length_check():
    opt = sgd([1.0, 1.0])
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.5],
                     warmup_num_steps=4, warmup_type="linear")
    sched.step(2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.3])
    with pytest.raises(ConfigError, match="warmup_max_lr has 3 entries.*2 parameter groups"):
        WarmupLR(opt, warmup_max_lr=[1.0, 2.0, 3.0])


def test_state_dict_round_trip_and_deepspeed_style_state():
    def make():
        opt = sgd([0.3, 0.05])
        return opt, WarmupCosineLR(opt, total_num_steps=40, warmup_num_steps=7,
                                   warmup_min_ratio=0.1, warmup_type="linear")

    opt_a, a = make()
    for _ in range(13):
        a.step()
    state = a.state_dict()
    assert state["last_batch_iteration"] == 12
    # A restored optimizer holds the scheduled lr; the base lrs must come from the state.
    opt_b = sgd([g["lr"] for g in opt_a.param_groups])
    b = WarmupCosineLR(opt_b, total_num_steps=40, warmup_num_steps=7, warmup_min_ratio=0.1,
                       warmup_type="linear")
    b.load_state_dict(state)
    assert [g["lr"] for g in opt_b.param_groups] == [g["lr"] for g in opt_a.param_groups]
    assert lr_trace(a, opt_a, 30) == lr_trace(b, opt_b, 30)
    # DeepSpeed's own state only has the position
    opt_c = sgd([1.0])
    c = WarmupLR(opt_c, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10,
                 warmup_type="linear")
    c.load_state_dict({"last_batch_iteration": 4})
    assert opt_c.param_groups[0]["lr"] == pytest.approx(0.4)
    c.step()
    assert opt_c.param_groups[0]["lr"] == pytest.approx(0.5)


def test_resume_position_given_at_construction():
    opt = sgd([1.0])
    WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10,
             warmup_type="linear", last_batch_iteration=3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.3)


def test_any_object_with_param_groups_and_tensor_lrs():
    class Partitioned:  # what the engine's optimizer looks like to a schedule
        def __init__(self):
            self.param_groups = [{"lr": 0.2, "params": []}, {"lr": torch.tensor(0.2), "params": []}]

    opt = Partitioned()
    tensor_lr = opt.param_groups[1]["lr"]
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.2, warmup_num_steps=4,
                     warmup_type="linear")
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.param_groups[1]["lr"] is tensor_lr  # updated in place
    assert tensor_lr.item() == pytest.approx(0.05)
    with pytest.raises(ConfigError, match="param_groups"):
        WarmupLR(object())


def test_optimizer_steps_use_the_scheduled_lr():
    # SGD without momentum: the update of each step is -lr * grad, so the parameter after
    # k steps with gradient 1 is -(sum of the lrs used), which must be the schedule's values
    # for iterations -1, 0, ..., k-2 (step() comes after the optimizer step).
    p = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = WarmupDecayLR(opt, total_num_steps=12, warmup_min_lr=0.01, warmup_max_lr=0.1,
                          warmup_num_steps=5)
    used = []
    for _ in range(15):
        used.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones((), dtype=torch.float64)
        opt.step()
        sched.step()
    want = [ref_warmup_decay_lr(it, 0.01, 0.1, 5, 12, "log") for it in range(-1, 14)]
    assert used == pytest.approx(want, rel=1e-12)
    assert p.item() == pytest.approx(-sum(want), rel=1e-12)


def test_build_from_config():
    cfg = parse_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
                        "scheduler": {"type": "WarmupLR",
                                      "params": {"warmup_num_steps": 3, "warmup_type": "linear"}}})
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=cfg.optimizer.lr)
    sched = build_scheduler(cfg.scheduler, opt)
    assert isinstance(sched, WarmupLR)
    sched.step(3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)  # warms up to the optimizer lr
    cfg = parse_config({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9}}})
    sched = build_scheduler(cfg.scheduler, sgd([0.5]))
    assert isinstance(sched, WarmupDecayLR) and sched.max_lrs == [0.001]  # DeepSpeed's default
    assert sched.warmup_num_steps == 1000 and sched.warmup_type == "log"
    cfg = parse_config({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9,
                                                                          "warmup_num_steps": 2}}})
    sched = build_scheduler(cfg.scheduler, sgd([0.5]))
    assert isinstance(sched, WarmupCosineLR) and sched.cos_min_ratio == 1e-4
    assert build_scheduler(None, sgd([0.5])) is None


def test_zero_warmup_steps_is_the_two_step_minimum():
    # the HF Trainer fills warmup_num_steps 0 for "no warmup"; DeepSpeed's max(2, n) applies
    runs = []
    for n in (0, 2):
        opt = sgd([1.0])
        sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.5, warmup_num_steps=n,
                         warmup_type="linear")
        lrs = []
        for _ in range(4):
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        runs.append(lrs)
    assert runs[0] == runs[1] and runs[0][0] < 0.5 == runs[0][-1]


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        WarmupLR(sgd([1.0]), warmup_num_steps=-1)
    with pytest.raises(ConfigError, match="warmup_type"):
        WarmupLR(sgd([1.0]), warmup_type="cosine")
    with pytest.raises(ConfigError, match="total_num_steps"):
        WarmupDecayLR(sgd([1.0]), total_num_steps=0)
    with pytest.raises(ConfigError, match="cos_min_ratio"):
        WarmupCosineLR(sgd([1.0]), total_num_steps=5, cos_min_ratio=1.5)
