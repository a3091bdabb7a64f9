"""2-rank worker of tests/test_engine_reuse.py: a model trained again after its stage-3
engine is done with it (``engine.hand_back_model``), through the integrations.

Usage: ``python engine_reuse.py <seed> <out_dir>`` on 2 ranks (torchrun-style variables,
gloo). In one launch (lightning and transformers are imported once):

- ``hf``: two ``train()`` calls on one trainer and model (2 steps each, fp32): HF's own
  ``Trainer`` (DDP) as the reference, given a new optimizer before the second call as
  transformers' DeepSpeed integration does (``deepspeed_init`` drops
  ``trainer.optimizer``), against ZeroCoreTrainer at stage 3 and stage 2;
- ``precision``: a bf16 stage-3 engine trained 3 steps, then handed back: every parameter
  in zero_core.Init's form with exactly the engine's fp32 master values (read here from
  the master partitions with torch.distributed's own all_gather), and a new engine built
  on it starts from those values and trains;
- ``lightning``: ``validate`` then ``fit`` on one Trainer/ZeroCoreStrategy at stage 3,
  against ``fit`` alone on a fresh model with the same seed and against the plain-torch
  single-process reference (fp32), and the same pair in bf16-mixed.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

import zero_core  # noqa: E402
from zero_core.integrations.transformers import ZeroCoreTrainer  # noqa: E402
from zero_core.stage3 import partitioned_params as pp  # noqa: E402
from zero_core.testing.ranks import leave_rank, report  # noqa: E402

import hf_trainer_common as H  # noqa: E402
import lightning_common as C  # noqa: E402

SEED, OUT = int(sys.argv[1]), sys.argv[2]
WORLD = 2


# ---- Hugging Face: two train() calls -------------------------------------------------------
def hf_args(name: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=os.path.join(OUT, name), use_cpu=True, report_to=[], disable_tqdm=True,
        per_device_train_batch_size=H.GLOBAL_BATCH // (WORLD * H.ACCUMULATION),
        gradient_accumulation_steps=H.ACCUMULATION, num_train_epochs=1, learning_rate=3e-3,
        weight_decay=0.01, warmup_steps=1, adam_epsilon=1e-5, max_grad_norm=0.5,
        lr_scheduler_type="linear", logging_steps=1, save_strategy="no",
        train_sampling_strategy="sequential", seed=SEED, data_seed=SEED,
        dataloader_num_workers=0)


def hf_two_trains(name: str, stage: int | None) -> dict:
    """Parameters after the first and the second train() (HF's Trainer if *stage* is None)."""
    kwargs = {"train_dataset": H.TokenData(SEED, H.N_TRAIN)}
    if stage is None:
        trainer = Trainer(model=H.make_model(SEED), args=hf_args(name), **kwargs)
    else:
        config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "gradient_clipping": "auto", "comm_backend": "gloo",
                  "zero_optimization": {"stage": stage}}
        trainer = ZeroCoreTrainer(model=H.make_model(SEED), args=hf_args(name),
                                  zero_config=config, **kwargs)
    trainer.train()
    first = H.full_params(trainer.model)
    first_engine = getattr(trainer, "engine", None)
    if stage is None:
        trainer.optimizer = None   # what deepspeed_init does before a second train()
    trainer.train()
    out = {"first": first, "final": H.full_params(trainer.model),
           "steps": trainer.state.global_step}
    if stage is not None:
        out["new_engine"] = trainer.engine is not first_engine
        out["engine"] = type(trainer.engine.parts).__name__
    return out


def hf_part() -> dict:
    ref = hf_two_trains("hf", None)
    res = {"ref_moved": H.max_rel_diff(ref["final"], ref["first"])}
    for stage in (3, 2):
        zc = hf_two_trains(f"zc{stage}", stage)
        res[f"zc{stage}"] = {"first_rel": H.max_rel_diff(zc["first"], ref["first"]),
                             "final_rel": H.max_rel_diff(zc["final"], ref["final"]),
                             "steps": zc["steps"], "new_engine": zc["new_engine"],
                             "engine": zc["engine"]}
    return res


# ---- the handed-back model keeps the fp32 master -------------------------------------------
def master_values(engine) -> dict[str, torch.Tensor]:
    """name -> the engine's master values of that parameter, gathered here with
    torch.distributed (not zero-core's code) from each rank's master partition."""
    out = {}
    for u in engine.parts.units:
        mine = engine.parts.buffers[u.group].master.bucket(u.bucket).contiguous()
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        full = torch.cat(parts)
        for p, off, name in zip(u.params, u.offsets, u.names):
            out[name] = full[off:off + p.numel()].clone()
    return out


def precision_part() -> dict:
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
              "comm_backend": "gloo", "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 200,
                                    "reduce_bucket_size": 200}}
    g = torch.Generator().manual_seed(SEED + dist.get_rank())

    def train(engine, steps):
        for _ in range(steps):
            x = torch.randn(4, 8, generator=g).bfloat16()
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()

    engine, *_ = zero_core.initialize(model=model, config=config)
    train(engine, 3)
    master = master_values(engine)
    units = len(engine.parts.units)
    returned = engine.hand_back_model()
    params = dict(model.named_parameters())
    init_form = all(type(p) is pp.PartitionedParameter and pp.meta_of(p).unit is None
                    and pp.meta_of(p).own_part is not None for p in params.values())
    own_dtypes = sorted({str(pp.meta_of(p).own_part.dtype) for p in params.values()})
    try:
        model(torch.randn(4, 8))   # no hooks left: a released parameter is read
        forward = "ran"
    except pp.ParameterNotGatheredError:
        forward = "ParameterNotGatheredError"
    with zero_core.GatheredParameters(list(params.values())):
        back = {n: p.detach().reshape(-1).clone() for n, p in params.items()}
    engine2, *_ = zero_core.initialize(model=model, config=config)
    second_master = master_values(engine2)
    train(engine2, 1)
    return {
        "units": units, "returned_model": returned is model, "init_form": init_form,
        "own_dtypes": own_dtypes, "forward_after": forward,
        "equal_master": all(torch.equal(back[n], master[n]) for n in master),
        "names": sorted(back) == sorted(master),
        # elements a bf16 round trip would change: the precision kept
        "finer_than_bf16": sum(int((v != v.bfloat16().float()).sum()) for v in back.values()),
        "second_engine_master_equal": all(torch.equal(second_master[n], back[n]) for n in back),
        "second_engine_steps": engine2.global_steps,
    }


# ---- Lightning: validate, then fit -------------------------------------------------------------
def lightning_part() -> dict:
    import lightning.pytorch as pl
    from zero_core.integrations.lightning import ZeroCoreStrategy
    Regressor = C.lightning_module_class()
    ref_net, _, _ = C.reference(SEED, epochs=1)
    config = {"comm_backend": "gloo", "zero_optimization": {"stage3_param_persistence_threshold": 0}}

    def run(precision: str, validate_first: bool):
        env = C.keep_env()
        model = Regressor(SEED)
        trainer = pl.Trainer(strategy=ZeroCoreStrategy(config=config, stage=3), devices=2,
                             max_epochs=1, precision=precision, **C.trainer_kwargs())
        val = trainer.validate(model, verbose=False)[0]["val_loss"] if validate_first else None
        eval_engine = trainer.strategy.engine
        trainer.fit(model)
        strategy = trainer.strategy
        state = strategy.lightning_module_state_dict()   # rank 0 only
        C.restore_env(env)
        return ({k[len("net."):]: v.float() for k, v in state.items()},
                {"val": val, "global_step": trainer.global_step,
                 "engine_steps": strategy.engine.global_steps,
                 "new_engine": strategy.engine is not eval_engine})

    res = {}
    for precision in ("32-true", "bf16-mixed"):
        alone, _ = run(precision, False)
        after, info = run(precision, True)
        if dist.get_rank() == 0:
            info["vs_fit_alone"] = max(float((after[n] - alone[n]).abs().max()) for n in alone)
            info["vs_ref"] = C.rel_diff(after, ref_net)
            info["alone_vs_ref"] = C.rel_diff(alone, ref_net)
        res[precision] = info
    return res


def main():
    results = {"hf": hf_part()}
    results["precision"] = precision_part()
    results["lightning"] = lightning_part()
    report(results)
    leave_rank()


if __name__ == "__main__":
    main()
