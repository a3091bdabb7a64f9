"""Multi-rank worker for tests/test_lora_stage3.py: a peft LoRA actor at ZeRO stage 3.

Usage: ``python lora_stage3.py`` on every rank (gloo). A tiny Hugging Face GPT-2 (seeded,
dropouts 0) is wrapped with peft LoRA on ``c_attn`` (r=4) and trained at stage 3 (fp32,
AdamW from the config) for STEPS steps, each rank on its own micro-batch. The reference is
computed here, in one process: the same peft model in plain torch with torch.optim.AdamW
over its trainable (LoRA) parameters, fed the concatenation of every rank's micro-batch
(mean loss). The report holds the relative errors of the LoRA weights, whether the frozen
weights kept their values, the units' trainable flags and names, the optimizer-state bytes
of the memory ledger, and the logits with the adapter disabled (the RLHF reference-model
pattern) against a plain copy of the model taken before LoRA was added.
"""
from __future__ import annotations

import copy

import peft
import torch
import transformers

import zero_core
from zero_core.testing.ranks import leave_rank, report

STEPS, MICRO, SEQ, LR, WD = 2, 2, 8, 1e-2, 0.01


def build_base() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def add_lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    # GPT-2's c_attn is a transformers Conv1D (weight stored in × out): fan_in_fan_out
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"],
                          fan_in_fan_out=True, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, cfg)


def batches(world_size: int) -> list[torch.Tensor]:
    """Per step, every rank's micro-batch stacked: [world_size * MICRO, SEQ]."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 128, (world_size * MICRO, SEQ), generator=g) for _ in range(STEPS)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def main():
    base = build_base()
    base_copy = copy.deepcopy(base)          # plain model, before LoRA was added
    model = add_lora(base)
    ref = copy.deepcopy(model)               # the single-process reference
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_names = sorted(n for n, p in model.named_parameters() if p.requires_grad)

    cfg = {"train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    rank, world = engine.global_rank, engine.world_size
    data = batches(world)

    losses = []
    for ids in data:
        mine = ids[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))

    ref.train()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WD)
    ref_losses = []
    for ids in data:
        loss = ref(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(float(loss.detach()))
    ref_params = dict(ref.named_parameters())

    named = dict(engine.module.named_parameters())
    with zero_core.GatheredParameters(list(named.values())):
        values = {n: p.detach().clone() for n, p in named.items()}
    lora_err = {n: rel_err(values[n], ref_params[n].detach()) for n in lora_names}
    lora_moved = {n: rel_err(values[n], initial[n]) if initial[n].norm() > 0
                  else float(values[n].norm()) for n in lora_names}
    frozen_equal = {n: bool(torch.equal(values[n], initial[n]))
                    for n in named if n not in lora_names}

    units = [{"trainable": bool(u.trainable), "names": list(u.names),
              "padded_numel": u.padded_numel} for u in engine.parts.units]
    mem = engine.memory_report()

    engine.eval()
    probe = data[0][:MICRO]
    with torch.no_grad():
        with engine.module.disable_adapter():
            disabled = engine(probe).logits
        enabled = engine(probe).logits
        want_base = base_copy(probe).logits
        want_ref = ref.eval()(probe).logits
    report({
        "rank": rank, "world_size": world, "losses": losses, "ref_losses": ref_losses,
        "lora_names": lora_names, "lora_err": lora_err, "lora_moved": lora_moved,
        "frozen_equal": frozen_equal,
        "trainable_param_names": sorted(n for n, p in engine.module.named_parameters()
                                        if p.requires_grad),
        "units": units, "ledger": mem["ledger"],
        "trainable_units": mem["stage3"]["trainable_units"],
        "disabled_equals_base": bool(torch.equal(disabled, want_base)),
        "disabled_max_diff": float((disabled - want_base).abs().max()),
        "enabled_max_diff_from_base": float((enabled - want_base).abs().max()),
        "enabled_err_vs_ref": rel_err(enabled, want_ref),
    })
    leave_rank()


if __name__ == "__main__":
    main()
