"""ZeroCoreStrategy (zero_core/integrations/lightning.py) under PyTorch Lightning.

Multi-rank launches (tests/workers/lightning_*.py), each batching several scenarios since
a process importing lightning costs ~6 s:

- 2 ranks, torchrun-style variables (gloo) and mpirun (config ``comm_backend: "mpi"``):
  Lightning's own ``strategy="ddp"`` (the reference), ZeroCoreStrategy stage 2 and stage 3
  and a single-process plain-torch reference, 2 epochs of 4 AdamW steps with
  accumulate_grad_batches=2, gradient_clip_val=0.5 (active: the reference's gradient norm
  exceeds it) and a StepLR stepped per optimizer step. ModelCheckpoint writes the engine's
  directory every epoch; trainer.save_checkpoint, validate, test and predict run on the
  stage-3 engine afterwards.
- resume: ONE rank resumes the 2-rank checkpoints of epoch 1, each at the other stage
  (stage 2's at stage 3 and back), and must end where the uninterrupted reference ends,
  with Lightning's epoch / global_step / scheduler restored. (The worker takes a device
  count: ``3`` runs the same through Lightning's own launcher; 1 keeps the suite fast.)
- the example ``examples/lightning_gpt.py --devices 2``: one ``python`` process, Lightning's
  own launcher starts rank 1.

Bound: RTOL = 1e-5 on max |p - p_ref| / max |p_ref| (fp32). DDP, the engine and the
single-process reference sum the same per-sample gradients in different orders (a few
float32 ulps, ~1e-7 relative); Adam turns that into ~lr x 1e-7 per step. Measured ~5e-8; a
lost micro-batch, a doubled accumulation scale, clipping not applied or a scheduler state
not restored are all >= 1e-2.

The named errors (precision / accumulation / clipping contradictions) are raised before
any process group exists, so they run in-process.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

from zero_core.errors import ConfigError  # noqa: E402
from zero_core.testing.ranks import mpirun_path, run_ranks  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
ROOT = os.path.dirname(HERE)
RTOL = 1e-5
RESUME_RANKS = 1
SEED = random.randrange(1, 10**6)  # fresh inputs each session; the messages carry it
COMM = {"torchrun": "gloo", "mpirun": "mpi"}
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "NODE_RANK", "GROUP_RANK")

sys.path.insert(0, WORKERS)
import lightning_common as C  # noqa: E402


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lightning_ckpt"))


def launch(launcher: str, ckpt_dir: str) -> list:
    results = run_ranks(os.path.join(WORKERS, "lightning_train.py"), 2, launcher,
                        args=[SEED, ckpt_dir, COMM[launcher]], timeout=300)
    reports = [r.report for r in results]
    assert all(rep is not None for rep in reports), "a rank did not report"
    return reports


@pytest.fixture(scope="module")
def torchrun_reports(ckpt_root):
    return launch("torchrun", ckpt_root)


def check_launch(reports: list, launcher: str) -> None:
    msg = f"seed {SEED}, {launcher}"
    expected_lr = C.LR * 0.5 ** (2 * C.STEPS_PER_EPOCH // 3)
    for rank, rep in enumerate(reports):
        assert rep["ref_max_norm"] > C.CLIP, msg  # clipping is really exercised
        assert rep["ddp_vs_ref"] <= RTOL, (msg, rep["ddp_vs_ref"])
        for stage in ("s2", "s3"):
            res = rep[stage]
            if stage == "s2" or rank == 0:  # stage 3's full state is gathered on rank 0
                assert res["vs_ddp"] <= RTOL, (msg, stage, res["vs_ddp"])
                assert res["vs_ref"] <= RTOL, (msg, stage, res["vs_ref"])
            else:
                assert "vs_ddp" not in res
            assert res["global_step"] == res["engine_steps"] == 2 * C.STEPS_PER_EPOCH, msg
            assert (res["grad_accum"], res["clip"], res["micro"]) == (C.ACCUMULATE, C.CLIP, 3)
            assert res["comm"] == COMM[launcher]
            assert abs(res["lr"] - expected_lr) <= 1e-12, (msg, res["lr"])
            # self.log(sync_dist=True) arrived: the validation loss over BOTH ranks' shards
            # equals the reference's loss on the whole validation set
            metrics = res["metrics"]
            assert abs(metrics["val_loss"] - rep["ref_val"]) <= RTOL * rep["ref_val"], msg
            ddp_train = rep["ddp_metrics"]["train_loss"]
            assert abs(metrics["train_loss"] - ddp_train) <= RTOL * ddp_train, msg
            assert res["checkpoints"] == ["epoch=0.ckpt", "epoch=1.ckpt"], res["checkpoints"]
        s3 = rep["s3"]
        assert s3["persistent_units"] == 0  # every parameter a partition outside forward
        assert s3["final_dir"] == ["checkpoint", "latest"], s3["final_dir"]
        for key, name in (("validate", "val_loss"), ("test", "test_loss")):
            assert abs(s3[key][name] - rep["ref_val"]) <= RTOL * rep["ref_val"], (msg, key)
        assert s3["predict_rows"] == C.N_VAL // 2 and s3["predict_vs_ref"] <= RTOL, msg
        assert "one optimizer" in rep["two_optimizers"], rep["two_optimizers"]


@pytest.mark.multirank
@pytest.mark.slow
def test_two_ranks_torchrun_matches_ddp(torchrun_reports):
    check_launch(torchrun_reports, "torchrun")


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.skipif(mpirun_path() is None, reason="mpirun not installed: pip install 'zero-core[mpi]'")
def test_two_ranks_mpirun_matches_ddp(tmp_path):
    check_launch(launch("mpirun", str(tmp_path)), "mpirun")


def run_lightning_launcher(cmd: list, report_dir: str, timeout: float = 300):
    """Run ONE process (Lightning starts the other ranks) without launcher variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", ZERO_CORE_REPORT_DIR=report_dir, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, *cmd], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc


@pytest.mark.multirank
@pytest.mark.slow
def test_resume_on_one_rank_at_the_other_stage(torchrun_reports, ckpt_root, tmp_path):
    run_lightning_launcher([os.path.join(WORKERS, "lightning_resume.py"), str(SEED), ckpt_root,
                            str(RESUME_RANKS)], str(tmp_path))
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(RESUME_RANKS)]
    expected_lr = C.LR * 0.5 ** (2 * C.STEPS_PER_EPOCH // 3)
    for rank, rep in enumerate(reports):
        for name in ("s2_at_stage3", "s3_at_stage2"):
            res = rep[name]
            # Lightning's loop restarted at epoch 1 after the 4 steps of epoch 0
            assert res["started_at"] == [1, C.STEPS_PER_EPOCH], (name, res)
            assert res["global_step"] == 2 * C.STEPS_PER_EPOCH and res["epoch"] == 2
            assert res["world_size"] == RESUME_RANKS
            assert abs(res["lr"] - expected_lr) <= 1e-12, (name, res["lr"])
            if rank == 0 or name == "s3_at_stage2":
                assert res["vs_ref"] <= RTOL, (f"seed {SEED}", name, res["vs_ref"])


@pytest.mark.multirank
@pytest.mark.slow
def test_example_runs_under_lightnings_launcher(tmp_path):
    proc = run_lightning_launcher([os.path.join(ROOT, "examples", "lightning_gpt.py"),
                                   "--devices", "2", "--steps", "6", "--checkpoint-dir",
                                   str(tmp_path)], str(tmp_path))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("validation loss")]
    assert "2 ranks, 6 steps" in proc.stdout, proc.stdout[-3000:]
    before, after = (float(v.strip(";")) for v in line[0].split()[2:5:2])
    assert after < before, line
    assert sorted(os.listdir(tmp_path / "stage2")) == ["checkpoint", "latest"]


# ---- named errors, in-process (raised before any process group) ------------------------------
@pytest.fixture
def clean_env():
    """Lightning's launcher writes MASTER_ADDR, WORLD_SIZE, ... into os.environ."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def trainer(strategy, **kw):
    import lightning.pytorch as pl
    return pl.Trainer(strategy=strategy, **C.trainer_kwargs(devices=1, max_epochs=1, **kw))


@pytest.mark.parametrize("config, precision", [
    ({"fp16": {"enabled": True}}, "bf16-mixed"),
    ({"bf16": {"enabled": True}}, "32-true"),
    ({"bf16": {"enabled": True}}, "32"),
    ({"bfloat16": {"enabled": False}}, "bf16-true"),
])
def test_contradicting_precision_is_refused_at_trainer(clean_env, config, precision):
    from zero_core.integrations.lightning import ZeroCoreStrategy
    with pytest.raises(ConfigError, match="contradicts the config"):
        trainer(ZeroCoreStrategy(config=config), precision=precision)


def test_precision_the_engine_lacks_is_refused(clean_env):
    from zero_core.integrations.lightning import ZeroCoreStrategy
    with pytest.raises(ConfigError, match="not supported by zero-core"):
        trainer(ZeroCoreStrategy(), precision="64-true")


def test_precision_maps_onto_the_config():
    from zero_core.integrations.lightning import apply_precision
    for precision, key in (("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("16-mixed", "fp16")):
        cfg = {}
        apply_precision(cfg, precision)
        assert cfg == {key: {"enabled": True}}
    cfg = {"bfloat16": {"enabled": "auto"}}
    apply_precision(cfg, "bf16-mixed")
    assert cfg == {"bfloat16": {"enabled": True}}
    cfg = {"fp16": {"enabled": False}}
    apply_precision(cfg, "32-true")
    assert cfg == {"fp16": {"enabled": False}}


@pytest.mark.parametrize("config, kw, match", [
    ({"gradient_accumulation_steps": 2}, {"accumulate_grad_batches": 4},
     r"accumulate_grad_batches=4\) contradicts the config's gradient_accumulation_steps=2"),
    ({"gradient_clipping": 1.0}, {"gradient_clip_val": 0.25},
     r"gradient_clip_val=0.25\) contradicts the config's gradient_clipping=1.0"),
    ({}, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"},
     "gradient_clip_algorithm='value'"),
])
def test_trainer_config_conflicts_are_refused_at_fit(clean_env, config, kw, match):
    from zero_core.integrations.lightning import ZeroCoreStrategy
    from zero_core.runtime.context import shutdown
    import torch.distributed as dist
    shutdown()   # an earlier in-process test (another file's) may have started the runtime
    kw = {"accumulate_grad_batches": 1, "gradient_clip_val": None, **kw}
    t = trainer(ZeroCoreStrategy(config=config), **kw)
    with pytest.raises(ConfigError, match=match):
        t.fit(C.lightning_module_class()(SEED))
    assert not dist.is_initialized()  # refused before any process group


def test_stage_shortcut_and_registry():
    from lightning.pytorch.strategies import StrategyRegistry
    from zero_core.integrations.lightning import ZeroCoreStrategy
    assert ZeroCoreStrategy().config == {"zero_optimization": {"stage": 2}}
    assert ZeroCoreStrategy(config={"zero_optimization": {"stage": 3}}).stage == 3
    with pytest.raises(ConfigError, match="contradicts the config's zero_optimization.stage"):
        ZeroCoreStrategy(config={"zero_optimization": {"stage": 1}}, stage=3)
    for name, stage in (("zero_core", 2), ("zero_core_stage_2", 2), ("zero_core_stage_3", 3)):
        assert StrategyRegistry.get(name).stage == stage
