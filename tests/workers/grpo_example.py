"""Multi-rank worker for tests/test_grpo_example.py: examples/grpo_gpt.py's pieces on real
ranks against one plain-torch process over the union of every rank's prompts.

Usage: ``python grpo_example.py`` on every rank (2 ranks). Reports:

* ``iteration`` — one GRPO iteration at stage 3, fp32: the policy engine (AdamW) samples
  its rank's prompts, the reference is an inference engine (no optimizer), then μ = 2
  updates (the second one with ρ ≠ 1, so the clip is live). The reference run is a plain
  model with torch.optim.AdamW (the example's optimizer settings and clipping, read from its
  config) and a plain frozen copy, over all ranks' prompts in one batch. Then both sample
  the next iteration's prompts with the updated weights (a cached stale gather would show).
  Before it, three greedy decode passes count the all-gather bytes: the first gathers the
  model, the next ones none (stage 3 keeps the units between passes without autograd).
* ``greedy`` — greedy decoding through engines at stages 0-3, stage 3 + hpZ and stage 3 +
  qwZ, each rank its own prompts, against the plain model on all prompts.

The tiny model's tensors are all below the default persistence threshold (1e5 elements),
which would keep every one of them whole on every rank at stage 3: the threshold is 0 here
(as in the example), so that every parameter is partitioned and gathered.
"""
from __future__ import annotations

import os
import sys

import torch

import zero_core
from zero_core.accel_kernels import quant_reference
from zero_core.interfaces.communicator import CommLedger
from zero_core.testing.ranks import leave_rank, report
from zero_core.zeropp.wire import QWZ_BITS, QWZ_BLOCK

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import grpo_gpt as grpo  # noqa: E402
from gpt import build_model  # noqa: E402

SEED, ITERATION = 7, 3
LR = grpo.parse_args([]).lr          # the example's default
SETTINGS = grpo.GRPOSettings(prompts=2, group=4, new_tokens=5, updates=2, seed=11)
GREEDY_NEW = 8
GREEDY = {"stage0": {"stage": 0}, "stage1": {"stage": 1}, "stage2": {"stage": 2},
          "stage3": {"stage": 3},
          "hpz": {"stage": 3, "zero_hpz_partition_size": 2},
          "qwz": {"stage": 3, "zero_quantized_weights": True}}


def full_params(model) -> list[torch.Tensor]:
    params = list(model.parameters())
    with zero_core.GatheredParameters(params):
        return [p.detach().clone().double() for p in params]


def rel_diff(got, want) -> float:
    num = max(float((a - b).abs().max()) for a, b in zip(got, want))
    return num / max(float(b.abs().max()) for b in want)


def plain_optimizer(model, cfg: dict):
    """torch.optim.AdamW with the engine config's settings, and its gradient clipping."""
    params = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]),
                            eps=params["eps"], weight_decay=params["weight_decay"])

    def optimize(loss):
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["gradient_clipping"])
        opt.step()
    return optimize


def decode_gather_bytes(engine, prompts: torch.Tensor, passes: int = 3) -> list[int]:
    """All-gather bytes the ledger counted in each of *passes* greedy decode passes."""
    out = []
    with torch.no_grad():
        for _ in range(passes):
            before = engine.comm.ledger.snapshot()
            logits = engine(prompts)
            ops = CommLedger.difference(engine.comm.ledger.snapshot(), before)["ops"]
            out.append(sum(v["sent_bytes"] for k, v in ops.items() if k.startswith("all_gather")))
            prompts = torch.cat([prompts, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


def iteration_scenario(rank: int, world: int) -> dict:
    s = SETTINGS
    batch = s.prompts * s.group
    cfg = grpo.engine_config(3, "fp32", batch, LR)
    policy, optimizer, _, _ = zero_core.initialize(model=build_model("tiny", seed=SEED), config=cfg)
    ref_cfg = grpo.engine_config(3, "fp32", batch, None)     # no optimizer: inference engine
    reference, ref_opt, _, _ = zero_core.initialize(model=build_model("tiny", seed=SEED),
                                                   config=ref_cfg)
    first = rank * s.prompts
    decode_gathers = decode_gather_bytes(policy, grpo.make_prompts(s, 0, first, s.prompts))
    got = grpo.rollout(policy, reference, s, ITERATION, first, s.prompts)
    got_stats = grpo.update(policy, grpo.engine_optimize(policy), got, s)
    got_next = grpo.rollout(policy, reference, s, ITERATION + 1, first, s.prompts)
    got_params = full_params(policy.module)

    model = build_model("tiny", seed=SEED)
    frozen = build_model("tiny", seed=SEED).requires_grad_(False)
    start = [p.detach().clone().double() for p in model.parameters()]
    want = grpo.rollout(model, frozen, s, ITERATION, 0, world * s.prompts)
    want_stats = grpo.update(model, plain_optimizer(model, cfg), want, s)
    want_next = grpo.rollout(model, frozen, s, ITERATION + 1, 0, world * s.prompts)
    want_params = [p.detach().double() for p in model.parameters()]

    mine = slice(rank * batch, (rank + 1) * batch)
    close = lambda a, b: float((a - b[mine]).abs().max())  # noqa: E731
    return {
        "decode_gathers": decode_gathers,
        "ref_optimizer_is_none": ref_opt is None and optimizer is not None,
        "partitioned": all(u.padded_numel // world == u.part.numel() for u in policy.parts.units)
                       and not any(u.persistent for u in policy.parts.units),
        "prompts_equal": torch.equal(got.prompts, want.prompts[mine]),
        "tokens_equal": torch.equal(got.completions, want.completions[mine]),
        "next_tokens_equal": torch.equal(got_next.completions, want_next.completions[mine]),
        "tokens": got.completions.tolist(),
        "advantages_diff": close(got.advantages, want.advantages),
        "old_logp_diff": close(got.old_logp, want.old_logp),
        "ref_logp_diff": close(got.ref_logp, want.ref_logp),
        "next_old_logp_diff": close(got_next.old_logp, want_next.old_logp),
        "rel_diff": rel_diff(got_params, want_params),
        "moved": rel_diff(want_params, start),       # how far the update moved the weights
        "reward_spread": float(want.rewards.max() - want.rewards.min()),
        "loss": got_stats["loss"], "want_loss": want_stats["loss"],
        "clipped": want_stats["clipped"],
    }


def quantized_copy(engine, model: torch.nn.Module, world: int) -> torch.nn.Module:
    """*model* with the values a qwZ gather delivers: each non-persistent fetch unit's
    padded flat buffer, cut into the ranks' partitions, each quantized and dequantized by
    the reference kernel (block QWZ_BLOCK, QWZ_BITS bits), as QuantizedGather does."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for u in engine.parts.units:
            if u.persistent:
                continue
            flat = torch.zeros(u.padded_numel)
            for name, off in zip(u.names, u.offsets):
                flat[off:off + named[name].numel()] = named[name].reshape(-1)
            shard = u.padded_numel // world
            for r in range(world):
                part = flat[r * shard:(r + 1) * shard]
                payload, scales = quant_reference.quantize(part, QWZ_BITS, QWZ_BLOCK)
                part.copy_(quant_reference.dequantize(payload, scales, QWZ_BITS, QWZ_BLOCK,
                                                      shard, torch.float32))
            for name, off in zip(u.names, u.offsets):
                p = named[name]
                p.copy_(flat[off:off + p.numel()].view_as(p))
    return model


def greedy_scenario(rank: int, world: int) -> dict:
    s = SETTINGS
    prompts = grpo.make_prompts(s, 0, 0, world * s.prompts)
    mine = slice(rank * s.prompts, (rank + 1) * s.prompts)
    fp32 = build_model("tiny", seed=SEED)
    out = {}
    for name, zero in GREEDY.items():
        cfg = grpo.engine_config(zero["stage"], "fp32", s.prompts, LR)
        cfg["zero_optimization"].update(zero)
        if name in ("hpz", "qwz"):
            # no unit kept between decode steps: every step gathers, through hpZ's
            # secondary partition / qwZ's int8 all-gather
            cfg["generation"] = {"max_live_parameters": 0}
        engine, *_ = zero_core.initialize(model=build_model("tiny", seed=SEED), config=cfg)
        ref = fp32
        if name == "qwz":
            ref = quantized_copy(engine, build_model("tiny", seed=SEED), world)
            out["qwz_weights_moved"] = rel_diff(list(ref.parameters()), list(fp32.parameters()))
        got = grpo.generate(engine, prompts[mine], GREEDY_NEW)
        want = grpo.generate(ref, prompts, GREEDY_NEW)[mine]
        with torch.no_grad():   # the logits of one pass: near the reference's, by how much
            logits = engine(prompts[mine])
            diff = {key: float((logits - m(prompts)[mine]).abs().max())
                    for key, m in (("logits_diff", ref), ("logits_diff_fp32", fp32))}
        out[name] = {"equal": torch.equal(got, want), "tokens": got.tolist(), **diff}
        engine.destroy()
    return out


def main():
    torch.manual_seed(0)
    from zero_core.runtime.launch import discover
    launch = discover()
    rank, world = launch.rank, launch.world_size
    report({"world_size": world, "iteration": iteration_scenario(rank, world),
            "greedy": greedy_scenario(rank, world)})
    leave_rank()


if __name__ == "__main__":
    main()
