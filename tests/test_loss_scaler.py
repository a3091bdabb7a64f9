"""fp16 loss scalers: scripted overflow sequences with expected scales derived by hand, a
second, independently written model of DeepSpeed's rule on random sequences, and the
inf/NaN detection on real tensors."""
import random
import zlib

import pytest
import torch

from zero_core.config import parse_config
from zero_core.errors import ConfigError
from zero_core.optim.loss_scaler import (DynamicLossScaler, LossScaleUnderflowError, StaticLossScaler,
                                   build_loss_scaler, has_overflow, overflow_flag)

G, O = False, True  # a good step, an overflowed step


def run(scaler, flags):
    """The scale after each update."""
    out = []
    for flag in flags:
        scaler.update(flag)
        out.append(scaler.scale)
    return out


def test_scripted_sequence_with_hysteresis_and_window():
    # initial 16, window 3, hysteresis 2, floor 1. Worked by hand:
    #  1-3  G G G   good steps 1..3; growth needs (good - 1) to be a positive multiple of 3 -> 16
    #  4    G       good 4, 4 - 1 = 3 -> doubles to 32, hysteresis refilled (2)
    #  5    O       hysteresis 2 -> 1, scale kept: 32
    #  6    G       good 1: 32
    #  7    O       hysteresis already 1 -> halve: 16
    #  8    O       still 1 (not refilled by a good step) -> 8
    #  9-11 G G G   good 1..3: 8
    #  12   G       good 4 -> 16, hysteresis back to 2
    #  13   O       hysteresis 2 -> 1: 16
    #  14   O       halve: 8
    #  15-18 G x4   good 4 at step 18 -> 16
    #  19-20 G G    good 5, 6: 16
    #  21   G       good 7, 7 - 1 = 6 = 2 windows -> 32
    s = DynamicLossScaler(initial_scale=16.0, scale_window=3, min_scale=1.0, hysteresis=2)
    flags = [G, G, G, G, O, G, O, O, G, G, G, G, O, O, G, G, G, G, G, G, G]
    expected = [16, 16, 16, 32, 32, 32, 16, 8, 8, 8, 8, 16, 16, 8, 8, 8, 8, 16, 16, 16, 32]
    assert run(s, flags) == expected
    assert s.steps == len(flags) and s.overflows == 5


def test_hysteresis_one_halves_on_every_overflow_and_stops_at_the_floor():
    # initial 8, floor 3 (not a power of two), hysteresis 1:
    # O -> 4, O -> max(2, 3) = 3, then an overflow at the floor is fatal.
    s = DynamicLossScaler(initial_scale=8.0, scale_window=5, min_scale=3.0, hysteresis=1)
    assert run(s, [O, O]) == [4, 3]
    with pytest.raises(LossScaleUnderflowError, match="minimum loss scale 3"):
        s.update(O)


def test_floor_without_raising_keeps_the_minimum():
    s = DynamicLossScaler(initial_scale=4.0, scale_window=2, min_scale=1.0, hysteresis=1,
                          raise_error_at_min_scale=False)
    # 4 -> 2 -> 1 -> 1 -> 1, then good steps 1, 2, 3: growth at good 3 (3 - 1 = 2 = window)
    assert run(s, [O, O, O, O, G, G, G]) == [2, 1, 1, 1, 1, 1, 2]


def test_consecutive_hysteresis_refills_on_every_good_step():
    # hysteresis 2, window 100 (no growth here). Alternating O G O G O: with consecutive
    # hysteresis each good step refills to 2, so no overflow ever reaches the halving branch.
    flags = [O, G, O, G, O, O]
    s = DynamicLossScaler(initial_scale=64.0, scale_window=100, hysteresis=2,
                          consecutive_hysteresis=True)
    # ... until two overflows in a row: the 6th update halves.
    assert run(s, flags) == [64, 64, 64, 64, 64, 32]
    # Without it the hysteresis is spent by the first overflow and only a scale increase
    # refills it: the 3rd update (second overflow) already halves, and so does every later one.
    s = DynamicLossScaler(initial_scale=64.0, scale_window=100, hysteresis=2)
    assert run(s, flags) == [64, 64, 32, 32, 16, 8]


def test_window_one_doubles_from_the_second_good_step():
    # window 1: growth when good - 1 >= 1, i.e. on every good step after the first.
    s = DynamicLossScaler(initial_scale=2.0, scale_window=1, hysteresis=1)
    assert run(s, [G, G, G, O, G, G]) == [2, 4, 8, 4, 4, 8]


class DeepSpeedModel:
    """DeepSpeed's rule written with its iteration counters (cur_iter, last_overflow_iter)
    rather than a good-step count, as a second, independent model."""

    def __init__(self, scale, window, floor, hysteresis, consecutive):
        self.scale, self.window, self.floor = scale, window, floor
        self.delay, self.left, self.consecutive = hysteresis, hysteresis, consecutive
        self.it, self.last_overflow = 0, -1

    def update(self, overflow):
        if overflow:
            if self.delay == 1 or self.left == 1:
                self.scale = max(self.scale / 2, self.floor)
            else:
                self.left -= 1
            self.last_overflow = self.it
        else:
            if self.consecutive:
                self.left = self.delay
            interval = self.it - self.last_overflow - 1
            if interval > 0 and interval % self.window == 0:
                if not self.consecutive:
                    self.left = self.delay
                self.scale *= 2
        self.it += 1


@pytest.mark.parametrize("seed", range(8))
def test_random_sequences_match_the_counter_model(seed):
    rng = random.Random(seed)
    power, window = rng.randint(8, 20), rng.randint(1, 6)
    hysteresis, consecutive = rng.randint(1, 4), rng.random() < 0.5
    floor = float(2 ** rng.randint(0, 3))
    p_overflow = rng.uniform(0.05, 0.5)
    flags = [rng.random() < p_overflow for _ in range(400)]
    ours = DynamicLossScaler(initial_scale=2.0 ** power, scale_window=window, min_scale=floor,
                             hysteresis=hysteresis, consecutive_hysteresis=consecutive,
                             raise_error_at_min_scale=False)
    model = DeepSpeedModel(2.0 ** power, window, floor, hysteresis, consecutive)
    for i, flag in enumerate(flags):
        ours.update(flag)
        model.update(flag)
        assert ours.scale == model.scale, f"step {i}"


def test_state_dict_resumes_the_same_sequence():
    rng = random.Random(7)
    flags = [rng.random() < 0.3 for _ in range(200)]
    kwargs = dict(initial_scale=2.0 ** 12, scale_window=4, min_scale=1.0, hysteresis=3,
                  raise_error_at_min_scale=False)
    whole = run(DynamicLossScaler(**kwargs), flags)
    first = DynamicLossScaler(**kwargs)
    head = run(first, flags[:77])
    second = DynamicLossScaler(**kwargs)
    second.load_state_dict(first.state_dict())
    assert head + run(second, flags[77:]) == whole
    with pytest.raises(ConfigError, match="static"):
        second.load_state_dict(StaticLossScaler(8.0).state_dict())


def test_static_scaler_never_changes():
    s = StaticLossScaler(128.0)
    assert run(s, [O, G, O, O, G]) == [128.0] * 5
    assert not s.dynamic and s.loss_scale == 128.0
    x = torch.randn(3, dtype=torch.float64)
    assert torch.equal(s.scale_loss(x), x * 128.0)
    t = StaticLossScaler(1.0)
    t.load_state_dict(s.state_dict())
    assert t.scale == 128.0
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ConfigError, match="fp16.loss_scale"):
            StaticLossScaler(bad)


def test_build_from_config():
    dyn = build_loss_scaler(parse_config({"fp16": {"enabled": True, "initial_scale_power": 5,
                                                   "loss_scale_window": 2, "hysteresis": 1,
                                                   "min_loss_scale": 4}}).fp16)
    assert isinstance(dyn, DynamicLossScaler) and dyn.scale == 32.0
    # window 2, hysteresis 1, floor 4: O -> 16, G G G -> growth at good 3 -> 32
    assert run(dyn, [O, G, G, G]) == [16, 16, 16, 32]
    assert run(dyn, [O, O, O]) == [16, 8, 4]
    static = build_loss_scaler(parse_config({"fp16": {"enabled": True, "loss_scale": 512}}).fp16)
    assert isinstance(static, StaticLossScaler) and static.scale == 512.0
    cons = build_loss_scaler(parse_config({"fp16": {"consecutive_hysteresis": True}}).fp16)
    assert cons.consecutive_hysteresis and cons.scale == 2.0 ** 16


def test_invalid_dynamic_settings_are_refused():
    with pytest.raises(ConfigError, match="min_loss_scale"):
        DynamicLossScaler(initial_scale=1.0, min_scale=0.0)
    with pytest.raises(ConfigError, match="below fp16.min_loss_scale"):
        DynamicLossScaler(initial_scale=2.0, min_scale=4.0)
    with pytest.raises(ConfigError, match="hysteresis"):
        DynamicLossScaler(hysteresis=0)
    with pytest.raises(ConfigError, match="loss_scale_window"):
        DynamicLossScaler(scale_window=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_has_overflow_finds_one_bad_value(dtype, bad):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{bad}".encode()))
    tensors = [torch.randn(int(n), generator=gen).to(dtype)
               for n in torch.randint(1, 300, (5,), generator=gen)]
    tensors.insert(2, None)
    tensors.append(torch.empty(0, dtype=dtype))
    assert not has_overflow(tensors)
    assert overflow_flag(tensors).item() == 0.0
    which = int(torch.randint(0, 5, (1,), generator=gen))
    victim = [t for t in tensors if t is not None and t.numel()][which]
    victim.view(-1)[int(torch.randint(0, victim.numel(), (1,), generator=gen))] = bad
    assert has_overflow(tensors)
    flag = overflow_flag(tensors)
    assert flag.dim() == 0 and flag.dtype == torch.float32 and flag.item() == 1.0


def test_scaled_fp16_gradients_overflow_and_an_unscaled_copy_does_not():
    # A real backward in fp16: the gradient of sum(w * x) is x; scaling the loss by 2**10
    # pushes 100 * 1024 past the fp16 maximum (65504).
    w = torch.ones(4, dtype=torch.float16, requires_grad=True)
    x = torch.full((4,), 100.0, dtype=torch.float16)
    (w * x).sum().backward()
    assert not has_overflow([w.grad])
    w.grad = None
    StaticLossScaler(2.0 ** 10).scale_loss((w * x).sum()).backward()
    assert has_overflow([w.grad])
    assert not has_overflow([])
