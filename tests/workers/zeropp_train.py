"""Multi-rank worker for tests/test_zeropp_engine.py: the demo GPT (examples/gpt.py, tiny
preset) trained by the stage-3 engine with and without ZeRO++ on the same data.

Usage: ``python zeropp_train.py <scenario>[,<scenario>] [steps]`` on every rank, with
ZERO_CORE_RANKS_PER_NODE=2 (4 ranks = 2 emulated nodes):

* ``ledger`` — an untied tiny GPT, bf16, 3 steps, stage 3 and ZeRO++ (all three): the
  ledger's bytes of the last step, the fetch units' padded sizes and which unit the
  backward reuses without gathering (the last one of the forward), memory reports;
* ``converge`` — the tiny GPT (tied, as in the demo), bf16, *steps* steps (default 40) for
  each of: stage 3, qwZ, hpZ, qgZ, all three. Same seeds (model 1234, data 0), same
  global batches; reports the training losses and the validation loss after the last step
  on fixed held-out batches.
"""
from __future__ import annotations

import os
import sys
import time

import torch

import zero_core
from zero_core.testing.ranks import report

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from gpt import build_model, lm_loss  # noqa: E402
from text_data import GlobalBatchSampler, load_stdlib_text, validation_batches  # noqa: E402

VARIANTS = {
    "zero3": {},
    "qwz": {"zero_quantized_weights": True},
    "hpz": {"zero_hpz_partition_size": 2},
    "qgz": {"zero_quantized_gradients": True},
    "zeropp": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
               "zero_quantized_gradients": True},
}
MICRO, SEQ, LR = 4, 64, 3e-3


def config(variant: str, persistence: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        # ZeRO++'s baseline is the paper's ZeRO-3, with flat collectives: node-aware ones
        # (tests/test_multinode.py) would change the reduction order between variants
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 20_000,
                              "stage3_param_persistence_threshold": persistence,
                              "node_aware_collectives": False,
                              **extra, **VARIANTS[variant]},
    }


def train(engine, sampler, steps: int) -> tuple[list[float], float]:
    losses, start = [], time.perf_counter()
    for step in range(steps):
        x, y = sampler.rank_batch(step, engine.global_rank)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses, time.perf_counter() - start


def ledger_scenario(tokens) -> dict:
    out = {}
    for variant in ("zero3", "zeropp"):
        model = build_model("tiny", seed=1234)
        # untie the head so every module (and unit) is used once per forward, as the
        # paper's 3M assumes
        model.lm_head.weight = torch.nn.Parameter(model.tok_emb.weight.detach().clone())
        engine, *_ = zero_core.initialize(model=model, config=config(
            variant, persistence=0, stage3_max_reuse_distance=0))
        sampler = GlobalBatchSampler(tokens, SEQ, MICRO, engine.world_size, seed=0)
        train(engine, sampler, 3)
        last = [u.index for u in engine.parts.units if "lm_head.weight" in u.names]
        mem = engine.memory_report()
        out[variant] = {
            "comm": engine.comm_report(),
            "units": [{"padded": u.padded_numel, "persistent": u.persistent,
                       "trainable": u.trainable, "index": u.index} for u in engine.parts.units],
            "last_forward_unit": last,
            "num_parameters": engine.num_parameters,
            "zeropp": mem.get("zeropp"),
            "model_states": mem["ledger"]["model_states"],
        }
        engine.destroy()
    return out


def converge_scenario(tokens, val, steps: int) -> dict:
    out = {}
    for variant in VARIANTS:
        model = build_model("tiny", seed=1234)
        engine, *_ = zero_core.initialize(model=model, config=config(variant, persistence=256))
        sampler = GlobalBatchSampler(tokens, SEQ, MICRO, engine.world_size, seed=0)
        losses, seconds = train(engine, sampler, steps)
        engine.eval()
        with torch.no_grad():
            val_loss = float(lm_loss(engine(val[0]), val[1]))
        engine.train()
        out[variant] = {"losses": losses, "val_loss": val_loss, "seconds": seconds,
                        "zeropp": engine.memory_report().get("zeropp")}
        engine.destroy()
    return out


def main():
    scenarios = sys.argv[1].split(",")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    torch.manual_seed(0)
    text = load_stdlib_text(max_bytes=2 << 20)
    out = {}
    if "ledger" in scenarios:
        out["ledger"] = ledger_scenario(text.train)
    if "converge" in scenarios:
        val = validation_batches(text.val, SEQ, 16)
        out["converge"] = converge_scenario(text.train, val, steps)
    from zero_core.runtime.context import get_runtime, shutdown
    rt = get_runtime()
    out["rank"], out["world_size"] = rt.rank, rt.world_size
    out["ranks_per_node"] = rt.topology.ranks_per_node
    report(out)
    shutdown()


if __name__ == "__main__":
    main()
