"""2-rank worker of tests/test_lightning.py: Lightning's DDP against ZeroCoreStrategy.

Usage: ``python lightning_train.py <seed> <checkpoint dir> <comm_backend>`` on 2 ranks
(torchrun-style variables or mpirun). In one launch: Lightning's ``strategy="ddp"`` (the
reference), then ZeroCoreStrategy at stage 2 (a ModelCheckpoint every epoch) and stage 3
(a ModelCheckpoint every epoch, ``trainer.save_checkpoint`` after fit, then validate, test
and predict on the same engine; then manual optimization with two optimizers, refused), all 2 epochs of accumulation 2 and norm clipping; and a
single-process plain-torch reference of the same steps. Reports parameter differences,
logged metrics and what the checkpoints hold.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lightning_common as C  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from zero_core.integrations.lightning import ZeroCoreStrategy  # noqa: E402
from zero_core.testing.ranks import leave_rank, report  # noqa: E402


def metrics(trainer) -> dict:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def main():
    seed, ckpt_dir, backend = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    Regressor = C.lightning_module_class()
    ref_net, ref_val, ref_norms = C.reference(seed, epochs=2)
    out = {"ref_val": ref_val, "ref_max_norm": max(ref_norms)}

    # Lightning's own DDP: the reference the strategy must match
    env = C.keep_env()
    ddp_model = Regressor(seed)
    ddp = pl.Trainer(strategy="ddp", devices=2, max_epochs=2, **C.trainer_kwargs())
    ddp.fit(ddp_model)
    C.restore_env(env)
    ddp_state = dict(ddp_model.net.named_parameters())
    out["ddp_vs_ref"] = C.rel_diff(ddp_state, ref_net)
    out["ddp_metrics"] = metrics(ddp)

    for stage in (2, 3):
        # stage 3 with no persistent (always gathered) parameters: every parameter is a
        # partition outside forward, as for a large model
        config = {"comm_backend": backend,
                  "zero_optimization": {"stage3_param_persistence_threshold": 0}}
        model = Regressor(seed)
        ckpt = ModelCheckpoint(dirpath=os.path.join(ckpt_dir, f"s{stage}"), save_top_k=-1,
                               every_n_epochs=1, filename="{epoch}")
        trainer = pl.Trainer(strategy=ZeroCoreStrategy(config=config, stage=stage), devices=2,
                             max_epochs=2, callbacks=[ckpt],
                             **C.trainer_kwargs(enable_checkpointing=True,
                                                enable_model_summary=stage == 3))
        trainer.fit(model)
        strategy = trainer.strategy
        full = strategy.lightning_module_state_dict()  # stage 3: gathered on rank 0 only
        res = {"metrics": metrics(trainer), "global_step": trainer.global_step,
               "engine_steps": strategy.engine.global_steps,
               "grad_accum": strategy.engine.gradient_accumulation_steps,
               "clip": strategy.engine.config.gradient_clipping,
               "micro": strategy.engine.config.train_micro_batch_size_per_gpu,
               "checkpoints": sorted(os.listdir(ckpt.dirpath)),
               "lr": strategy.engine.get_lr()[0], "comm": strategy.engine.comm.name,
               "persistent_units": strategy.engine.memory_report().get(
                   "stage3", {}).get("persistent_units")}
        if full:
            state = {k[len("net."):]: v for k, v in full.items()}
            res["vs_ddp"] = C.rel_diff(state, ddp_model.net)
            res["vs_ref"] = C.rel_diff(state, ref_net)
        if stage == 3:
            final = os.path.join(ckpt_dir, "s3_final")
            trainer.save_checkpoint(final)
            res["final_dir"] = sorted(os.listdir(final))
            res["validate"] = trainer.validate(model, verbose=False)[0]
            res["test"] = trainer.test(model, verbose=False)[0]
            preds = trainer.predict(model)
            _, _, vx, _ = C.data(seed)
            mine = vx[strategy.global_rank::2]  # this rank's shard (predict does not shuffle)
            with torch.no_grad():
                want = ref_net(mine)
            got = torch.cat(preds)
            res["predict_vs_ref"] = float((got - want).abs().max() / want.abs().max())
            res["predict_rows"] = int(got.shape[0])
            res["ref_val_direct"] = float(F.mse_loss(ref_net(vx), C.data(seed)[3]))
        out[f"s{stage}"] = res
    out["two_optimizers"] = two_optimizers_error(Regressor, seed)
    report(out)
    leave_rank()


def two_optimizers_error(Regressor, seed: int) -> str:
    """Several optimizers are refused by name on every rank (before any collective)."""
    from zero_core.errors import ConfigError

    class TwoOptimizers(Regressor):
        # manual optimization: Lightning itself refuses several optimizers in automatic mode
        def __init__(self, seed):
            super().__init__(seed)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            for opt in self.optimizers():
                opt.zero_grad()
                self.manual_backward(F.mse_loss(self(batch[0]), batch[1]))
                opt.step()

        def configure_optimizers(self):
            return [C.make_optimizer(self.net[0].parameters()),
                    C.make_optimizer(self.net[3].parameters())]

    trainer = pl.Trainer(strategy=ZeroCoreStrategy(stage=2), devices=2, max_epochs=1,
                         **C.trainer_kwargs(accumulate_grad_batches=1, gradient_clip_val=None))
    try:
        trainer.fit(TwoOptimizers(seed))
    except ConfigError as e:
        return str(e)
    return "no error"


if __name__ == "__main__":
    main()
