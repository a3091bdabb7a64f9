"""GRPO post-training of the demo GPT at ZeRO stage 3: a real loop, end to end.

Run on 2 local CPU ranks (``bash ci/grpo.sh`` does the same and sets what Open MPI needs
when run as root)::

    mpirun -np 2 --oversubscribe python examples/grpo_gpt.py               # stage 3, fp32
    mpirun -np 2 --oversubscribe python examples/grpo_gpt.py --precision bf16 --stage 2

**The task: count on.** A prompt is six digits counting up (mod 10), ``"345678"``; the
model should go on counting, ``"9012"``. Step reward of byte t of a completion ``o`` of L
bytes, ``c`` being the prompt's continuation, and the completion's reward:

    s_t = 1 if o_t = c_t,  0.1 if o_t is another digit,  0 otherwise;    r(o) = 1/L · Σ_t s_t

The freshly initialized byte-level model samples about uniformly over 256 bytes (r ≈ 0.008):
the 0.1 for any digit makes the first signal dense enough, the 1 for the right digit the
rest. (``STRIDES`` can add other strides, which the model must then read off the prompt.)
Each iteration does, with the policy π_θ trained by a zero-core engine and a frozen
reference π_ref (the initial weights; an inference engine: ``zero_core.initialize`` without an
optimizer):

1. **Sampling.** Each rank takes its own P prompts (global indices ``rank·P ...``) and samples
   G completions of each by an explicit loop over ``engine(idx)`` under ``torch.no_grad``
   (at stage 3 the gathered weights stay between decode steps), with temperature T. Every
   sample owns a ``torch.Generator`` seeded by (seed, iteration, global sample index), so the
   tokens do not depend on how the prompts are split over ranks.
2. **Group-relative advantages** (DeepSeekMath §4.1.2-4.1.3), over the G completions of one
   prompt, ``std`` the sample standard deviation (plus 1e-4):

       process supervision (default; each byte is a step):
           s̃_{i,t} = (s_{i,t} − mean(S)) / std(S),   S = all G·L step rewards of the group
           Â_{i,t} = Σ_{j ≥ t} s̃_{i,j}
       outcome supervision (``--supervision outcome``):
           Â_{i,t} = (r_i − mean(r_1..r_G)) / std(r_1..r_G)   for every t

   Outcome supervision gives all L bytes one number, and the right byte's credit drowns in
   the others' luck; the process form credits each byte (and the ones before it) with its
   own step reward (measured, 300 iterations: reward 0.59 with outcome supervision, 0.87
   with process supervision).
3. **Update** (DeepSeekMath eq. 3, the objective is maximised, the loss is its negative):

       ρ_{i,t}  = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})
       KL_{i,t} = π_ref/π_θ − log(π_ref/π_θ) − 1      (eq. 4: unbiased, always ≥ 0)
       J(θ) = 1/G Σ_i 1/|o_i| Σ_t [ min(ρ_{i,t} Â_{i,t}, clip(ρ_{i,t}, 1−ε, 1+ε) Â_{i,t})
                                     − β KL_{i,t} ]
       loss = −J(θ), averaged over the prompts (and, by the engine, over the ranks)

   β = 0.1 by default, not the paper's 0.04: here π_ref is the random initial model (about
   uniform), and the KL term doubles as the exploration that keeps the policy from
   collapsing onto a few digits (measured, 300 iterations: reward 0.70 at β = 0.04, 0.87 at
   0.1). π_old is the policy that sampled (its log-probabilities taken once, without
   autograd); ``--updates`` optimizer steps (the paper's μ) reuse the same samples, so from
   the second one on ρ ≠ 1 and the clip matters. Completions have a fixed length L (no end
   token), so every |o_i| = L.

Rank 0 prints one line per iteration: the mean reward (all ranks), the KL to the reference,
the loss, the fraction of clipped tokens, sampled tokens per second and the step time.
The pieces (task, sampling, advantages, loss, one iteration) are functions of this module
that tests/test_grpo_example.py imports and runs against plain torch.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero_core

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import build_model  # noqa: E402

DIGIT0 = ord("0")
STRIDES = (1,)


@dataclass(frozen=True)
class GRPOSettings:
    """Everything an iteration depends on besides the weights (the CLI's flags)."""

    prompts: int = 32         # P: prompts per rank per iteration
    group: int = 8            # G: completions per prompt
    prompt_len: int = 6
    new_tokens: int = 4       # L: bytes per completion
    temperature: float = 1.0
    clip_eps: float = 0.2     # ε
    beta: float = 0.1         # β, the KL weight (DeepSeekMath: 0.04; see the docstring)
    updates: int = 1          # μ: optimizer steps per batch of samples
    supervision: str = "process"   # or "outcome": how advantages are assigned to tokens
    seed: int = 0


# ---- the task --------------------------------------------------------------------------------
def _generator(seed: int, stream: int, iteration: int, index: int) -> torch.Generator:
    """A generator whose state depends only on its arguments (index < 2^24, iteration < 2^20)."""
    return torch.Generator().manual_seed((seed << 48) + (stream << 44) + (iteration << 24) + index)


def make_prompts(s: GRPOSettings, iteration: int, first: int, count: int) -> torch.Tensor:
    """Prompts with global indices ``first ... first+count-1``, (count, prompt_len) bytes."""
    rows = []
    for j in range(first, first + count):
        g = _generator(s.seed, 1, iteration, j)
        start = int(torch.randint(10, (), generator=g))
        stride = STRIDES[int(torch.randint(len(STRIDES), (), generator=g))]
        rows.append([DIGIT0 + (start + stride * k) % 10 for k in range(s.prompt_len)])
    return torch.tensor(rows, dtype=torch.long)


def continuation(prompts: torch.Tensor, n: int) -> torch.Tensor:
    """The *n* bytes that go on counting each prompt (its stride read from its first two)."""
    digits = prompts - DIGIT0
    stride = (digits[:, 1] - digits[:, 0]) % 10
    k = torch.arange(prompts.shape[1], prompts.shape[1] + n)
    return DIGIT0 + (digits[:, :1] + stride[:, None] * k) % 10


def step_rewards(prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """s_t of the module docstring, (batch, L) float32: 1, 0.1 or 0 per completion byte."""
    right = completions == continuation(prompts, completions.shape[1])
    digit = (completions >= DIGIT0) & (completions <= DIGIT0 + 9)
    return torch.where(right, 1.0, torch.where(digit, 0.1, 0.0))


# ---- sampling --------------------------------------------------------------------------------
def sample_uniforms(s: GRPOSettings, iteration: int, first: int, count: int) -> torch.Tensor:
    """(count, L) uniforms in [0, 1) for the samples with global indices first ...; row j
    comes from sample j's own generator, so it is the same on any number of ranks."""
    return torch.stack([torch.rand(s.new_tokens, generator=_generator(s.seed, 2, iteration, j))
                        for j in range(first, first + count)])


@torch.no_grad()
def generate(model, prompts: torch.Tensor, new_tokens: int, temperature: float = 0.0,
             uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """The (batch, new_tokens) continuation of *prompts*: greedy at temperature 0, else
    sampled from softmax(logits / temperature) by inverting its CDF at *uniforms*.

    One full forward per new token through *model* (an engine or a plain module; the demo
    GPT has no KV cache). Logits are read in float32 whatever the model's dtype."""
    seq = prompts
    for t in range(new_tokens):
        logits = model(seq)[:, -1, :].float()
        if temperature == 0.0:
            nxt = logits.argmax(dim=-1)
        else:
            cdf = torch.softmax(logits / temperature, dim=-1).cumsum(dim=-1)
            u = (uniforms[:, t] * cdf[:, -1]).unsqueeze(1)
            nxt = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(cdf.shape[1] - 1)
        seq = torch.cat([seq, nxt.unsqueeze(1)], dim=1)
    return seq[:, prompts.shape[1]:]


# ---- GRPO ------------------------------------------------------------------------------------
def _normalize_groups(x: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """(x − mean) / (std + eps) over each group's rows (all of their columns together)."""
    g = x.reshape(-1, group * x[0].numel())
    g = (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + eps)
    return g.view_as(x)


def outcome_advantages(steps: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """Â_{i,t} = r̃_i for every t: r_i = mean_t s_{i,t}, normalized in its group."""
    r = _normalize_groups(steps.mean(dim=1), group, eps)
    return r.unsqueeze(1).expand_as(steps)


def process_advantages(steps: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """Â_{i,t} = Σ_{j≥t} s̃_{i,j}, s̃ the step rewards normalized over the whole group."""
    s = _normalize_groups(steps, group, eps)
    return s.flip(1).cumsum(dim=1).flip(1)


ADVANTAGES = {"outcome": outcome_advantages, "process": process_advantages}


def token_logprobs(model, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """log π(o_t | q, o_<t) of each completion token, (batch, L) float32."""
    logits = model(sequences[:, :-1])[:, prompt_len - 1:, :].float()
    return torch.gather(F.log_softmax(logits, dim=-1), 2,
                        sequences[:, prompt_len:].unsqueeze(2)).squeeze(2)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
              adv: torch.Tensor, clip_eps: float, beta: float):
    """−J(θ) of the module docstring, and (KL, clipped fraction) for the progress line."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    log_ref_ratio = ref_logp - logp
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
    per_seq = (surrogate - beta * kl).mean(dim=1)          # 1/|o_i| Σ_t
    clipped = ((ratio - 1).abs() > clip_eps).float().mean()
    return -per_seq.mean(), kl.mean().detach(), clipped


@dataclass
class Rollout:
    prompts: torch.Tensor        # (P·G, prompt_len), each prompt repeated G times
    completions: torch.Tensor    # (P·G, L)
    steps: torch.Tensor          # (P·G, L) step rewards s_{i,t}
    advantages: torch.Tensor     # (P·G, L)
    old_logp: torch.Tensor       # (P·G, L)
    ref_logp: torch.Tensor       # (P·G, L)
    seconds: float = 0.0

    @property
    def rewards(self) -> torch.Tensor:
        """r_i = mean_t s_{i,t}, (P·G,)."""
        return self.steps.mean(dim=1)

    @property
    def sequences(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.completions], dim=1)


@torch.no_grad()
def rollout(policy, reference, s: GRPOSettings, iteration: int, first_prompt: int,
            n_prompts: int) -> Rollout:
    """Steps 1-2 for prompts ``first_prompt ...``: sample, score, advantages, π_old, π_ref."""
    start = time.perf_counter()
    was_training = policy.training
    policy.eval()
    prompts = make_prompts(s, iteration, first_prompt, n_prompts).repeat_interleave(s.group, 0)
    u = sample_uniforms(s, iteration, first_prompt * s.group, n_prompts * s.group)
    completions = generate(policy, prompts, s.new_tokens, s.temperature, u)
    steps = step_rewards(prompts, completions)
    advantages = ADVANTAGES[s.supervision](steps, s.group)
    seqs = torch.cat([prompts, completions], dim=1)
    old_logp = token_logprobs(policy, seqs, s.prompt_len)
    ref_logp = token_logprobs(reference, seqs, s.prompt_len)
    policy.train(was_training)
    return Rollout(prompts, completions, steps, advantages, old_logp, ref_logp,
                   time.perf_counter() - start)


def update(policy, optimize, batch: Rollout, s: GRPOSettings) -> dict:
    """Step 3: ``s.updates`` steps on *batch*. ``optimize(loss)`` backpropagates and steps
    (engine.backward + engine.step, or a plain optimizer's)."""
    policy.train()
    seqs = batch.sequences
    for _ in range(s.updates):
        logp = token_logprobs(policy, seqs, s.prompt_len)
        loss, kl, clipped = grpo_loss(logp, batch.old_logp, batch.ref_logp, batch.advantages,
                                      s.clip_eps, s.beta)
        optimize(loss)
    return {"loss": float(loss.detach()), "kl": float(kl), "clipped": float(clipped)}


def engine_optimize(engine):
    def optimize(loss):
        engine.backward(loss)
        engine.step()
    return optimize


# ---- the job ---------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    d = GRPOSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3, help="ZeRO stage")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--model", choices=("tiny", "small"), default="tiny",
                   help="model preset from examples/gpt.py")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts per rank (P)")
    p.add_argument("--group", type=int, default=d.group, help="completions per prompt (G)")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="completion bytes (L)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--beta", type=float, default=d.beta, help="KL weight")
    p.add_argument("--clip-eps", type=float, default=d.clip_eps)
    p.add_argument("--updates", type=int, default=d.updates, help="optimizer steps per batch (μ)")
    p.add_argument("--supervision", choices=sorted(ADVANTAGES), default=d.supervision,
                   help="advantages per byte (process) or per completion (outcome)")
    p.add_argument("--seed", type=int, default=d.seed, help="model init, prompts and sampling")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    args = p.parse_args(argv)
    if min(args.iterations, args.prompts, args.updates, args.new_tokens) < 1 or args.group < 2:
        p.error("--iterations, --prompts, --updates, --new-tokens must be >= 1, --group >= 2")
    return args


def settings_from(args) -> GRPOSettings:
    return GRPOSettings(prompts=args.prompts, group=args.group, new_tokens=args.new_tokens,
                        temperature=args.temperature, clip_eps=args.clip_eps, beta=args.beta,
                        updates=args.updates, supervision=args.supervision, seed=args.seed)


def engine_config(stage: int, precision: str, micro_batch: int, lr: float | None) -> dict:
    """The policy's config (with *lr*) or the reference's (``lr=None``: no optimizer)."""
    cfg = {"train_micro_batch_size_per_gpu": micro_batch,
           "zero_optimization": {"stage": stage}}
    if stage == 3:
        # every tensor of the tiny model is below the default threshold (1e5 elements) and
        # would stay whole on every rank (persistent); 0 partitions and gathers them all
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if lr is not None:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.99],
                                                        "eps": 1e-8, "weight_decay": 0.0}}
        cfg["gradient_clipping"] = 1.0
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()


def greedy_score(policy, s: GRPOSettings, rank: int, prompts: int = 16) -> tuple[float, float]:
    """(reward, fraction exactly right) of greedy completions of *prompts* fixed prompts per
    rank (a generator stream of their own), over all ranks."""
    x = make_prompts(replace(s, seed=s.seed + 1), 0, rank * prompts, prompts)
    out = generate(policy, x, s.new_tokens)
    exact = (out == continuation(x, s.new_tokens)).all(dim=1).float().mean()
    return tuple(mean_over_ranks([float(step_rewards(x, out).mean()), float(exact)]))


def default_threads() -> int:
    """Cores / ranks on this machine: ranks share the cores."""
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
    return max(1, (os.cpu_count() or 1) // int(local or 1))


def main(argv=None) -> None:
    args = parse_args(argv)
    s = settings_from(args)
    torch.set_num_threads(args.threads or default_threads())
    batch = s.prompts * s.group
    policy_cfg = engine_config(args.stage, args.precision, batch, args.lr)
    reference_cfg = engine_config(args.stage, args.precision, batch, None)   # inference engine
    # the same seed twice: the reference is the policy's starting point
    policy, *_ = zero_core.initialize(model=build_model(args.model, seed=args.seed),
                                      config=policy_cfg)
    reference, *_ = zero_core.initialize(model=build_model(args.model, seed=args.seed),
                                         config=reference_cfg)
    rank, world = policy.global_rank, policy.world_size
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"GRPO: {args.model} GPT, ZeRO stage {args.stage}, {args.precision}, {world} ranks × "
        f"{s.prompts} prompts × {s.group} samples, {s.new_tokens} new bytes, "
        f"β={s.beta}, ε={s.clip_eps}, μ={s.updates}, lr={args.lr}", flush=True)
    before = greedy_score(policy, s, rank)
    rewards, t_start = [], time.perf_counter()
    for it in range(args.iterations):
        t0 = time.perf_counter()
        ro = rollout(policy, reference, s, it, rank * s.prompts, s.prompts)
        stats = update(policy, engine_optimize(policy), ro, s)
        dt = time.perf_counter() - t0
        exact = (ro.completions == continuation(ro.prompts, s.new_tokens)).all(dim=1)
        reward, exact, kl, loss, clipped = mean_over_ranks(
            [float(ro.rewards.mean()), float(exact.float().mean()), stats["kl"], stats["loss"],
             stats["clipped"]])
        rewards.append(reward)
        tokens = ro.completions.numel() * world
        say(f"iter {it + 1:3d}/{args.iterations}  reward {reward:.3f}  exact {exact:.2f}  "
            f"KL {kl:.4f}  loss {loss:+.4f}  clipped {clipped:.3f}  "
            f"{tokens / ro.seconds:,.0f} sampled tokens/s  step {dt:.2f} s "
            f"(sampling {ro.seconds:.2f} s)", flush=True)
    after = greedy_score(policy, s, rank)
    say(f"sampled reward {rewards[0]:.3f} (iteration 1) -> {rewards[-1]:.3f} (iteration "
        f"{len(rewards)}; mean of the last 10: {sum(rewards[-10:]) / len(rewards[-10:]):.3f}) "
        f"in {time.perf_counter() - t_start:.0f} s", flush=True)
    say(f"greedy on {16 * world} fixed prompts: reward {before[0]:.3f} -> {after[0]:.3f}, "
        f"exactly right {before[1]:.2f} -> {after[1]:.2f}", flush=True)
    say(f"last sample: {bytes(ro.prompts[0].tolist())} -> {bytes(ro.completions[0].tolist())}",
        flush=True)


if __name__ == "__main__":
    main()
