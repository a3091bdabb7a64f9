"""Multi-rank worker for tests/test_generation.py: stage-3 generation on real ranks.

Usage: ``python generation.py`` on every rank (gloo). Each scenario builds a fresh engine
around the same tiny Hugging Face GPT-2 (seeded, untied head, so that every fetch unit is
used once per forward) and greedy-decodes the same prompts; the reference is the same
model, unpartitioned, in this process. The report holds, per scenario, the tokens of both,
the all-gather bytes the ledger counted, the forward passes counted by a hook on the model,
and the facts the test needs to state the formula itself: the units' padded sizes in the
order the forward first uses them (from module hooks here, not from the engine's trace).
"""
from __future__ import annotations

import copy

import torch
import transformers

import zero_core
from zero_core.interfaces.communicator import CommLedger
from zero_core.testing.ranks import leave_rank, report

NEW = 6
PROMPTS = torch.tensor([[5, 17, 33, 2, 90, 41], [7, 7, 64, 12, 3, 100]])


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                  n_head=2, tie_word_embeddings=False, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.generation_config.pad_token_id = 0
    return model.eval()


def engine_for(model, extra: dict, optimizer: bool = True):
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 64 * 64},
           **extra}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    return engine


def first_use_sizes(engine) -> list[int]:
    """Padded unit sizes in the order a forward first requests them (module hooks here)."""
    unit_of = {id(p): u for u in engine.parts.units for p in u.params}
    order: list = []

    def pre(module, args):
        for p in module.parameters(recurse=False):
            u = unit_of[id(p)]
            if all(u is not v for v in order):
                order.append(u)
    handles = [m.register_forward_pre_hook(pre) for m in engine.module.modules()]
    saved = engine.parts.coordinator.generation.budget
    with torch.no_grad():
        engine.module(PROMPTS[:, :2])
    engine.parts.coordinator.end_generation()
    for h in handles:
        h.remove()
    assert saved == engine.parts.coordinator.generation.budget
    return [u.padded_numel for u in order]


def gathered_bytes(before, after) -> int:
    ops = CommLedger.difference(after, before)["ops"]
    return sum(v["sent_bytes"] for k, v in ops.items() if k.startswith("all_gather"))


def count_passes(model) -> list:
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def decode(engine, ref, how, **kwargs) -> dict:
    """Generate with *how* (module / engine / gathered) and the reference; the ledger's
    all-gather bytes and the passes of the engine's generate."""
    want = ref.generate(PROMPTS, max_new_tokens=kwargs.get("max_new_tokens", NEW),
                        do_sample=False)
    calls = count_passes(engine.module)
    before = engine.comm.ledger.snapshot()
    args = dict(max_new_tokens=NEW, do_sample=False)
    args.update(kwargs)
    if how == "module":
        with torch.no_grad():
            got = engine.module.generate(PROMPTS, **args)
    elif how == "engine":
        got = engine.generate(PROMPTS, **args)
    else:
        with zero_core.gathered_for_generation(engine) as model:
            got = model.generate(PROMPTS, **args)
    return {"tokens_equal": bool(torch.equal(got, want)), "tokens": got.tolist(),
            "bytes": gathered_bytes(before, engine.comm.ledger.snapshot()),
            "passes": calls[0], "live_after": engine.parts.gatherer.live_numel}


def budget_scenario(budget) -> dict:
    model = build()
    ref = copy.deepcopy(model)
    extra = {} if budget is None else {"generation": {"max_live_parameters": budget}}
    engine = engine_for(model, extra)
    sizes = first_use_sizes(engine)
    out = decode(engine, ref, "module")
    out.update(sizes=sizes, budget=engine.parts.coordinator.generation.budget)
    # the kept units stay until training resumes; engine.train() releases them
    engine.train()
    out["live_after_train"] = engine.parts.gatherer.live_numel
    return out


def hybrid_scenario() -> dict:
    """hybrid_engine enabled: release_inference_cache true, then false (kept until train)."""
    out = {}
    for release in (True, False):
        model = build()
        ref = copy.deepcopy(model)
        engine = engine_for(model, {"hybrid_engine": {
            "enabled": True, "release_inference_cache": release, "max_out_tokens": 64}})
        first = decode(engine, ref, "engine")
        second = decode(engine, ref, "engine")
        engine.train()
        out[f"release={release}"] = {"first": first, "second": second,
                                     "live_after_train": engine.parts.gatherer.live_numel}
    try:
        engine.generate(PROMPTS, max_new_tokens=64)
    except zero_core.ZeroCoreError as exc:
        out["max_out_tokens_error"] = str(exc)
    return out


def gathered_then_train() -> dict:
    """gathered_for_generation, then a training step with the hooks back: its loss equals
    the reference model's loss on the same batch (the values are intact)."""
    model = build()
    ref = copy.deepcopy(model)
    engine = engine_for(model, {"generation": {"max_live_parameters": 0}})
    out = decode(engine, ref, "gathered")
    engine.train()
    ref.train()
    batch = PROMPTS
    loss = engine(batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        ref_loss = ref(batch, labels=batch).loss
    out["loss"], out["ref_loss"] = float(loss), float(ref_loss)
    out["hooks_back"] = engine.module.__dict__.get("_zero_core_stage3_hooks") is not None
    return out


def inference_engine() -> dict:
    model = build()
    ref = copy.deepcopy(model)
    engine = engine_for(model, {}, optimizer=False)
    with torch.no_grad():
        logits = engine(PROMPTS).logits
        want = ref(PROMPTS).logits
    out = {"optimizer_is_none": engine.optimizer is None,
           "logits_equal": bool(torch.equal(logits, want)),
           "trainable_units": sum(u.trainable for u in engine.parts.units),
           "memory": engine.memory_report(),
           "model_numel": sum(p.numel() for p in ref.parameters())}
    try:
        engine.backward(logits.sum())
    except zero_core.ZeroCoreError as exc:
        out["backward_error"] = str(exc)
    return out


def diverging(rank: int) -> dict:
    """Budget 0 (every step gathers), ranks asking for different lengths: engine.generate
    keeps them in step (synced_gpus under gloo); the model's own generate without it fails
    with GenerationDivergedError on every rank instead of hanging."""
    model = build()
    ref = copy.deepcopy(model)
    engine = engine_for(model, {"generation": {"max_live_parameters": 0}})
    out = {"synced": decode(engine, ref, "engine", max_new_tokens=3 + 2 * rank)}
    try:
        with torch.no_grad():
            engine.module.generate(PROMPTS, max_new_tokens=3 + 2 * rank, do_sample=False)
        engine.train()
        out["error"] = None
    except zero_core.GenerationDivergedError as exc:
        out["error"] = str(exc)
    return out


def main():
    probe = engine_for(build(), {})
    rank = probe.global_rank
    model_numel = sum(u.padded_numel for u in probe.parts.units)
    probe.destroy()
    report({"world_size": probe.world_size, "model_numel": model_numel,
            "fits": budget_scenario(None), "half": budget_scenario(model_numel // 2),
            "zero": budget_scenario(0), "hybrid": hybrid_scenario(),
            "gathered": gathered_then_train(), "inference": inference_engine(),
            "diverging": diverging(rank)})
    leave_rank()


if __name__ == "__main__":
    main()
