"""A small GPT-style decoder-only language model, shared by the demo and the benchmarks.

Architecture (GPT-2 family): token + learned position embeddings, ``n_layer`` pre-LayerNorm
blocks (causal self-attention, then a 4x-wide GELU MLP, each wrapped in a residual), a final
LayerNorm and a language-model head whose weight *is* the token embedding (weight tying).

Attention uses :func:`torch.nn.functional.scaled_dot_product_attention` with
``is_causal=True``, so position *t* only sees positions ``<= t``.

Presets (``GPTConfig.preset(name)``):

* ``tiny``  — a few hundred thousand parameters, for tests (seconds per run);
* ``small`` — the demo's default: learns byte-level Python source quickly on 2 CPU cores;
* ``bench`` — ~20M parameters, 4 layers, context 128: the model every benchmark uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. ``n_embd`` must be divisible by ``n_head``."""

    vocab_size: int = 256      # byte-level tokens by default
    block_size: int = 128      # context length in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0       # 0 keeps runs deterministic and comparable across engines
    bias: bool = True          # biases in Linear and LayerNorm, as in GPT-2

    @staticmethod
    def preset(name: str, **overrides) -> "GPTConfig":
        """A named configuration (``tiny``, ``small`` or ``bench``), optionally adjusted."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)


PRESETS = {
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    # 4 layers x 12*640^2 weights ≈ 19.7M, plus embeddings and norms ≈ 19.9M parameters
    "bench": GPTConfig(block_size=128, n_layer=4, n_head=10, n_embd=640),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position attends only to earlier ones."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}; "
                             f"pick a head count that divides the width")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        # one matmul produces queries, keys and values for all heads at once
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_output = True  # scaled init, see GPT._init_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, seq, width) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wider than the residual stream."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_output = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only language model: ``forward(idx) -> logits`` of shape (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying: the output projection reuses the input embedding matrix, which saves
        # vocab*width parameters and helps small models. model.parameters() yields it once.
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2's scheme: N(0, 0.02) everywhere, and the projections that write into the
        # residual stream scaled by 1/sqrt(2 * n_layer) so its variance does not grow with depth.
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_output", False):
                std /= math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Number of distinct parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab_size) for token ids *idx* (batch, seq), seq <= block_size."""
        seq = idx.shape[1]
        if seq > self.cfg.block_size:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's context "
                             f"block_size={self.cfg.block_size}; crop the input or build the "
                             f"model with a larger block_size")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats; *targets* are the inputs shifted by one."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_model(preset: str = "small", seed: int | None = None, **overrides) -> GPT:
    """A :class:`GPT` from a preset; with *seed*, its initial weights depend only on it."""
    cfg = GPTConfig.preset(preset, **overrides)
    if seed is None:
        return GPT(cfg)
    # fork_rng keeps the caller's global RNG stream untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)
