"""Exactly-once data across a mid-epoch resume with the framework integrations (issue 31
§2): ZeroCoreTrainer (Hugging Face) and ZeroCoreStrategy (Lightning), resumed on the same
and on another world size. Every sample carries its index; the rank programs
(tests/workers/resume_data_*.py) record the indices of each micro-batch with the optimizer
step it belongs to, so the tests see which samples each step trained on.

- HF: 2 ranks, 24 shuffled samples, global batch 8 (3 steps per epoch), 2 epochs;
  checkpoint-4 (epoch 1) resumed on the same 2 ranks, checkpoint-2 (epoch 0) resumed here
  on 1 rank with the same TrainingArguments: the integration doubles
  gradient_accumulation_steps to keep the saved global batch (without that, HF's data
  skipping counted in steps of 8 samples lands 8 samples early and the run takes 12
  steps of 4), and "keep_micro" or a micro batch that cannot keep it is refused.
- Lightning: 2 ranks, 36 shuffled samples (Lightning's injected DistributedSampler),
  global batch 12, 2 epochs; step=4 (epoch 1) resumed on the same 2 ranks; then one
  1-rank launch: step=2 (epoch 0) with accumulate_grad_batches 4 (the global batch kept),
  step=4 with "keep_micro" (global batch 6), and step=2 with accumulation 2, refused.

Each resumed run must train, step by step, on the samples the uninterrupted run trained on
(the same world size: the same per-rank batches), so that every sample of each epoch is
trained once; where the global batch is kept the final parameters match the uninterrupted
run's within 1e-5 relative (summation order only: measured ~1e-7; one repeated
micro-batch moves them by > 1e-2).
"""
from __future__ import annotations

import collections
import os
import random
import sys

import pytest

from zero_core.testing.ranks import run_ranks

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
SEED = random.randrange(1, 10**6)
TOL = 1e-5

sys.path.insert(0, WORKERS)


def by_step(*seen_lists) -> dict[int, list[int]]:
    """step -> sorted sample ids of that optimizer step, over the given ranks' records."""
    steps = collections.defaultdict(list)
    for seen in seen_lists:
        for step, ids in seen:
            steps[step] += ids
    return {step: sorted(ids) for step, ids in steps.items()}


def assert_once(ids, n: int, what: str) -> None:
    counts = collections.Counter(ids)
    twice = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(range(n)) - set(counts))
    assert not twice and not missing, (f"seed {SEED}: {what}: trained twice {twice}, "
                                       f"never {missing}")


def rel_diff(a: dict, b: dict) -> float:
    """max over parameters of max|a - b| / max|b| (values as flat lists)."""
    import torch
    return max(float((torch.tensor(a[n]) - torch.tensor(v)).abs().max()
                     / torch.tensor(v).abs().max().clamp_min(1e-12)) for n, v in b.items())


# ---- Hugging Face ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_launch(tmp_path_factory):
    pytest.importorskip("transformers")
    out = str(tmp_path_factory.mktemp("resume_data_hf"))
    results = run_ranks(os.path.join(WORKERS, "resume_data_hf.py"), 2, launcher="torchrun",
                        args=(SEED, out), timeout=240)
    return [r.report for r in results], out


@pytest.mark.multirank
@pytest.mark.slow
def test_hf_resume_on_the_same_ranks(hf_launch):
    """Uninterrupted: each epoch (3 steps over both ranks) trains every sample once.
    checkpoint-4 resumed on 2 ranks: steps 5 and 6 train each rank's batches of the
    uninterrupted run, and the parameters end equal to it."""
    reports, _ = hf_launch
    steps = by_step(*(r["full"] for r in reports))
    for epoch in (0, 1):
        assert_once([i for s in (1, 2, 3) for i in steps[3 * epoch + s]], 24, f"HF epoch {epoch}")
    for rep in reports:
        assert rep["same"] == [e for e in rep["full"] if e[0] >= 5], SEED
        assert rep["same_step"] == 6 and rep["same_rel"] <= TOL, (SEED, rep["same_rel"])


@pytest.mark.multirank
@pytest.mark.slow
def test_hf_resume_on_one_rank_keeps_the_global_batch(hf_launch):
    """checkpoint-2 (epoch 0, 16 of 24 samples trained) resumed on 1 rank with the same
    TrainingArguments (micro batch 2, accumulation 2): accumulation becomes 4, each of the
    steps 3-6 trains the samples the 2-rank run trained in it, and the parameters end
    within 1e-5 of the uninterrupted run's."""
    import torch
    from hf_trainer_common import full_params, make_model, max_rel_diff
    from resume_data_hf import IndexedTokens, make_args, recording_trainer
    reports, out = hf_launch
    trainer = recording_trainer(model=make_model(SEED + 99),
                                args=make_args(os.path.join(out, "one"), SEED),
                                train_dataset=IndexedTokens(SEED))
    trainer.train(resume_from_checkpoint=os.path.join(out, "full", "checkpoint-2"))
    assert trainer.args.gradient_accumulation_steps == 4
    assert trainer.engine.gradient_accumulation_steps == 4 and trainer.engine.world_size == 1
    assert trainer.state.global_step == 6
    full, resumed = by_step(*(r["full"] for r in reports)), by_step(trainer.seen)
    assert sorted(resumed) == [3, 4, 5, 6]
    for step in resumed:
        assert resumed[step] == full[step], (SEED, step)
    assert_once(full[1] + full[2] + resumed[3], 24, "HF epoch 0 across the resume")
    rel = max_rel_diff(full_params(trainer.model), torch.load(os.path.join(out, "full_final.pt")))
    assert rel <= TOL, (SEED, rel)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("micro, config, match", [
    (2, {"checkpoint": {"resume_batch": "keep_micro"}}, "keep_micro"),
    (3, {}, "to divide 8"),
])
def test_hf_resume_that_cannot_keep_the_global_batch_is_refused(hf_launch, micro, config, match):
    """"keep_micro" (HF's step counters cannot express another global batch) and a
    micro batch that does not divide the saved global batch: refused at train(), before
    an engine is built."""
    from hf_trainer_common import make_model
    from resume_data_hf import CONFIG, IndexedTokens, make_args, recording_trainer
    from zero_core.integrations.transformers.trainer_config import TrainerConfigConflict
    _, out = hf_launch
    trainer = recording_trainer(config={**CONFIG, **config}, model=make_model(SEED),
                                args=make_args(os.path.join(out, f"refused{micro}"), SEED, micro=micro),
                                train_dataset=IndexedTokens(SEED))
    with pytest.raises(TrainerConfigConflict, match=match):
        trainer.train(resume_from_checkpoint=os.path.join(out, "full", "checkpoint-2"))
    assert trainer.engine is None and trainer.args.gradient_accumulation_steps == 2


# ---- Lightning ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_launches(tmp_path_factory):
    pytest.importorskip("lightning")
    out = str(tmp_path_factory.mktemp("resume_data_lightning"))
    worker = os.path.join(WORKERS, "resume_data_lightning.py")
    two = run_ranks(worker, 2, launcher="torchrun", args=(SEED, out, "full"), timeout=240)
    one = run_ranks(worker, 1, launcher="torchrun", args=(SEED, out, "other"), timeout=240)
    return [r.report for r in two], one[0].report


@pytest.mark.multirank
@pytest.mark.slow
def test_lightning_resume_on_the_same_ranks(lightning_launches):
    """Uninterrupted: each epoch trains every sample once. step=4 (mid epoch 1) resumed on
    2 ranks: steps 5 and 6 train each rank's batches of the uninterrupted run (before the
    strategy's resumable loader they trained the epoch's first batches again), and the
    parameters end equal to it."""
    reports, _ = lightning_launches
    steps = by_step(*(r["full"]["seen"] for r in reports))
    for epoch in (0, 1):
        assert_once([i for s in (1, 2, 3) for i in steps[3 * epoch + s]], 36,
                    f"Lightning epoch {epoch}")
    for rep in reports:
        assert rep["same"]["seen"] == [e for e in rep["full"]["seen"] if e[0] >= 5], SEED
        assert rep["same"]["global_step"] == 6
        rel = rel_diff(rep["same"]["params"], rep["full"]["params"])
        assert rel <= TOL, (SEED, rel)


@pytest.mark.multirank
@pytest.mark.slow
def test_lightning_resume_on_one_rank(lightning_launches):
    """1 rank. step=2 (mid epoch 0) with accumulate_grad_batches 4: steps 3-6 train the
    2-rank run's samples of those steps, parameters within 1e-5. step=4 (mid epoch 1) with
    "keep_micro": the epoch's remaining 24 samples in 4 steps of 6, each once. step=2 with
    accumulation 2 (global batch 6) under the default: refused, naming the fix."""
    reports, one = lightning_launches
    full = by_step(*(r["full"]["seen"] for r in reports))
    keep = one["keep"]
    assert keep["accumulation"] == 4 and keep["global_step"] == 6
    resumed = by_step(keep["seen"])
    assert sorted(resumed) == [3, 4, 5, 6]
    for step in resumed:
        assert resumed[step] == full[step], (SEED, step)
    rel = rel_diff(keep["params"], reports[0]["full"]["params"])
    assert rel <= TOL, (SEED, rel)
    micro = one["keep_micro"]
    assert micro["global_step"] == 8 and sorted(by_step(micro["seen"])) == [5, 6, 7, 8]
    assert_once(full[4] + [i for _, ids in micro["seen"] for i in ids], 36,
                "Lightning epoch 1 across a keep_micro resume")
    assert "accumulate_grad_batches=4" in one["refused"] and "keep_micro" in one["refused"]
