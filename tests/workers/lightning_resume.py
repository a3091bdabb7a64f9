"""Resume worker of tests/test_lightning.py, started as ONE process: with ``<devices>`` > 1
Lightning's own launcher (``Trainer(devices=N)``) re-executes it for the other ranks.

Usage: ``python lightning_resume.py <seed> <checkpoint dir> <devices>`` where the directory holds
the 2-rank checkpoints of lightning_train.py (``s2/epoch=0.ckpt``, ``s3/epoch=0.ckpt``,
written after epoch 1 of 2). Each is resumed on <devices> ranks at the other stage (stage 2's at
stage 3 and back) from a model initialised differently, and trained to the end of epoch
2; reports where Lightning's loop restarted, and the final parameters against the
uninterrupted plain-torch reference.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_common as C  # noqa: E402
import lightning.pytorch as pl  # noqa: E402

from zero_core.integrations.lightning import ZeroCoreStrategy  # noqa: E402
from zero_core.testing.ranks import leave_rank, report  # noqa: E402


def main():
    seed, ckpt_dir, devices = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    Regressor = C.lightning_module_class()
    ref_net, ref_val, _ = C.reference(seed, epochs=2)
    out = {}
    for saved, stage in (("s2", 3), ("s3", 2)):
        model = Regressor(seed, init_seed=seed + 100)  # other initial values: the checkpoint must replace them
        strategy = ZeroCoreStrategy(stage=stage)
        trainer = pl.Trainer(strategy=strategy, devices=devices, max_epochs=2, **C.trainer_kwargs())
        trainer.fit(model, ckpt_path=os.path.join(ckpt_dir, saved, "epoch=0.ckpt"))
        full = strategy.lightning_module_state_dict()
        res = {"started_at": list(model.started_at), "global_step": trainer.global_step,
               "epoch": trainer.current_epoch, "world_size": trainer.world_size,
               "lr": strategy.engine.get_lr()[0],
               "val_loss": float(trainer.callback_metrics["val_loss"])}
        if full:
            res["vs_ref"] = C.rel_diff({k[len("net."):]: v for k, v in full.items()}, ref_net)
        out[f"{saved}_at_stage{stage}"] = res
    out["ref_val"] = ref_val
    report(out)
    leave_rank()


if __name__ == "__main__":
    main()
