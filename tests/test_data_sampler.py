"""ResumableSampler (zero_core/data/sampler.py) in one process, with stand-in engines: every
rank's share of an epoch, the position a checkpoint carries while a DataLoader reads ahead,
and exactly-once reading across a restart on another world size, on fresh random data."""
from __future__ import annotations

import random
import types

import pytest
import torch

from zero_core.checkpoint.store import CheckpointError
from zero_core.data import ResumableSampler


class FakeEngine:
    """What the sampler reads of an engine: rank, world size, micro batch, micro-steps."""

    def __init__(self, rank, world, micro):
        self.global_rank, self.world_size, self.micro_steps = rank, world, 0
        self.config = types.SimpleNamespace(train_micro_batch_size_per_gpu=micro)
        self.tracked = None

    def track_data(self, sampler):
        self.tracked = sampler


def ranks(n, world, micro, **kw):
    engines = [FakeEngine(r, world, micro) for r in range(world)]
    return engines, [ResumableSampler(range(n), e, **kw) for e in engines]


def order(n, seed, epoch):
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_epoch_is_the_global_order_split_over_the_ranks(world):
    n, micro, seed = random.randint(40, 90), random.randint(1, 4), random.randint(0, 999)
    engines, samplers = ranks(n, world, micro, seed=seed)
    assert engines[0].tracked is samplers[0]
    per_rank = [list(s) for s in samplers]
    usable = n // (world * micro) * (world * micro)
    assert all(len(p) == usable // world == len(s) for p, s in zip(per_rank, samplers))
    # micro-step k of rank r reads entries k*W*micro + j*W + r of the order
    merged = [per_rank[r][i] for i in range(usable // world) for r in range(world)]
    assert merged == order(n, seed, 0)[:usable]


def _consume(engines, samplers, steps):
    """Every rank takes *steps* micro batches (as a DataLoader would) and steps."""
    taken = []
    iters = [iter(s) for s in samplers]
    micro = samplers[0].micro
    for _ in range(steps):
        for it, e in zip(iters, engines):
            taken += [next(it) for _ in range(micro)]
            e.micro_steps += 1
    return taken, iters


@pytest.mark.parametrize("before,after", [(2, 1), (2, 3), (1, 2), (3, 3)])
def test_a_restart_on_another_world_size_reads_every_sample_once(before, after):
    n, micro, seed = random.randint(60, 120), 2, random.randint(0, 999)
    engines, samplers = ranks(n, before, micro, seed=seed)
    steps = random.randint(1, n // (before * micro) - 1)
    seen, iters = _consume(engines, samplers, steps)
    # the loader has read ahead (a prefetching DataLoader): the state still counts steps
    for it in iters:
        next(it)
    state = samplers[0].state_dict()
    assert state["position"] == steps * before * micro and state["epoch"] == 0
    assert all(s.state_dict() == state for s in samplers)  # every rank agrees

    engines2, samplers2 = ranks(n, after, micro, seed=seed)
    for s in samplers2:
        s.load_state_dict(state)
    rest = [i for s in samplers2 for i in s]
    assert not set(seen) & set(rest), "a sample read twice in one epoch"
    assert len(set(seen)) == len(seen) and len(set(rest)) == len(rest)
    end = state["position"] + (n - state["position"]) // (after * micro) * (after * micro)
    assert set(seen) | set(rest) == set(order(n, seed, 0)[:end])


def test_the_end_of_an_epoch_moves_the_state_to_the_next_one():
    n, micro = 20, 2
    engines, samplers = ranks(n, 2, micro, seed=5)
    _consume(engines, samplers, n // 4)          # the whole epoch: 5 micro-steps
    assert samplers[0].state_dict()["epoch"] == 1 and samplers[0].state_dict()["position"] == 0
    second = list(samplers[0])                    # the next iteration is epoch 1
    assert samplers[0].epoch == 1 and second == order(n, 5, 1)[0::2][:len(second)]
    samplers[0].set_epoch(7)
    assert list(samplers[0]) == order(n, 5, 7)[0::2][:len(second)]


def test_set_epoch_keeps_a_restored_position_in_its_own_epoch():
    engines, samplers = ranks(32, 1, 4, seed=1)
    samplers[0].load_state_dict({"epoch": 2, "position": 8, "dataset_size": 32,
                                 "shuffle": True, "seed": 1})
    samplers[0].set_epoch(2)
    assert list(samplers[0]) == order(32, 1, 2)[8:]


def test_unshuffled_order_is_the_dataset_order():
    engines, samplers = ranks(10, 2, 1, shuffle=False)
    assert list(samplers[0]) == [0, 2, 4, 6, 8] and list(samplers[1]) == [1, 3, 5, 7, 9]


@pytest.mark.parametrize("change,words", [
    ({"dataset_size": 50}, "dataset of 50 samples, this one has 40"),
    ({"shuffle": False}, "shuffle was False, now True"),
    ({"seed": 3}, "shuffling seed was 3, now 0"),
])
def test_a_data_position_of_other_data_is_refused_by_name(change, words):
    engines, samplers = ranks(40, 1, 2)
    state = {"epoch": 0, "position": 4, "dataset_size": 40, "shuffle": True, "seed": 0,
             **change}
    with pytest.raises(CheckpointError, match="does not match this data") as info:
        samplers[0].load_state_dict(state)
    assert words in str(info.value)
    assert samplers[0].position == 0  # nothing taken over


def test_the_loader_leaves_the_global_generator_alone():
    # a plain DataLoader draws its workers' seed from torch's global generator at every
    # iter(): a mid-epoch resume would then shift the stream dropout reads
    from zero_core.data import resumable_loader
    engine = FakeEngine(0, 1, 2)
    loader = resumable_loader(list(range(10)), engine)
    before = torch.get_rng_state()
    list(loader)
    assert torch.equal(before, torch.get_rng_state())
    plain = torch.utils.data.DataLoader(list(range(10)), batch_size=2)
    iter(plain)
    assert not torch.equal(before, torch.get_rng_state())  # the control: it does draw
