"""What the planner plans for: :class:`ModelSpec`, read from an HF ``config.json``, a preset
of ``examples/gpt.py`` or explicit dimensions.

Ψ (the parameter count) is not a formula here: every spec can build its model's *shape* on
the meta device (no memory, no initialization), and Ψ is that module's ``numel`` with tied
weights counted once, as the engine counts them. A preset builds ``examples/gpt.py``'s own
``GPT``; a config.json or dimensions build :class:`_ShapeLM`, which has the same parameter
tensors, in the same registration order, as transformers' GPT-2 (``model_type`` "gpt2":
learned positions, biases, LayerNorm, 4h MLP unless ``n_inner``) or Llama-style models
(rotary positions, RMSNorm, gated MLP of ``intermediate_size``, grouped KV heads). The same
module gives stage 3's fetch units through the engine's ``plan_units``, so the planner's
padding is the engine's.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from zero_core.errors import ZeroCoreError

#: examples/gpt.py, next to the package in a checkout (it is not installed with zero-core)
GPT_EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
ARCHITECTURES = ("gpt2", "llama")


class PlanError(ZeroCoreError):
    """An input the planner cannot work with (the message says which and what to pass)."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. *seq*: tokens per sample the run trains on
    (activations scale with it); *positions*: learned position embeddings (0 = rotary)."""

    name: str
    architecture: str          # "gpt2" or "llama" (see the module docstring)
    n_layer: int
    hidden: int
    n_head: int
    vocab: int
    seq: int
    intermediate: int
    positions: int = 0
    kv_heads: int = 0          # 0: as many as n_head
    tied: bool = True
    bias: bool = True
    builder: Callable[[], nn.Module] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise PlanError(f"architecture {self.architecture!r} is not known to the planner; "
                            f"use one of {', '.join(ARCHITECTURES)}")
        for key in ("n_layer", "hidden", "n_head", "vocab", "seq", "intermediate"):
            if int(getattr(self, key)) < 1:
                raise PlanError(f"model {self.name}: {key}={getattr(self, key)} must be a "
                                f"positive integer")
        if self.hidden % self.n_head:
            raise PlanError(f"model {self.name}: hidden={self.hidden} is not divisible by "
                            f"n_head={self.n_head}; give a head count that divides the width")
        if self.positions and self.seq > self.positions:
            raise PlanError(f"model {self.name}: sequence length {self.seq} is longer than its "
                            f"{self.positions} position embeddings; pass a shorter --seq")

    def build_meta(self) -> nn.Module:
        """The model's shape on the meta device (parameters without storage)."""
        with torch.device("meta"):
            return self.builder() if self.builder is not None else _ShapeLM(self)

    @property
    def num_parameters(self) -> int:
        """Ψ: distinct parameters (a tied embedding once)."""
        return sum(p.numel() for p in self.build_meta().parameters())

    def describe(self) -> dict:
        return {"name": self.name, "architecture": self.architecture, "layers": self.n_layer,
                "hidden": self.hidden, "heads": self.n_head, "vocab": self.vocab,
                "seq": self.seq, "intermediate": self.intermediate, "tied": self.tied,
                "parameters": self.num_parameters}


# ---- the shape model of config.json / explicit dimensions -----------------------------------
class _Attention(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        h, head = s.hidden, s.hidden // s.n_head
        kv = (s.kv_heads or s.n_head) * head
        if s.architecture == "gpt2":   # one fused projection (GPT-2's c_attn), then c_proj
            self.c_attn = nn.Linear(h, 3 * h, bias=s.bias)
            self.c_proj = nn.Linear(h, h, bias=s.bias)
        else:
            self.q_proj = nn.Linear(h, s.n_head * head, bias=s.bias)
            self.k_proj = nn.Linear(h, kv, bias=s.bias)
            self.v_proj = nn.Linear(h, kv, bias=s.bias)
            self.o_proj = nn.Linear(s.n_head * head, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        h, i = s.hidden, s.intermediate
        if s.architecture == "gpt2":
            self.c_fc = nn.Linear(h, i, bias=s.bias)
            self.c_proj = nn.Linear(i, h, bias=s.bias)
        else:
            self.gate_proj = nn.Linear(h, i, bias=False)
            self.up_proj = nn.Linear(h, i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)


def _norm(s: ModelSpec) -> nn.Module:
    if s.architecture == "gpt2":
        return nn.LayerNorm(s.hidden, bias=s.bias)
    return nn.RMSNorm(s.hidden)


class _Block(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = _norm(s), _Attention(s), _norm(s), _MLP(s)


class _ShapeLM(nn.Module):
    """GPT-2 / Llama parameter tensors in registration order (never run: shapes only)."""

    def __init__(self, s: ModelSpec):
        super().__init__()
        self.wte = nn.Embedding(s.vocab, s.hidden)
        self.wpe = nn.Embedding(s.positions, s.hidden) if s.positions else None
        self.h = nn.ModuleList(_Block(s) for _ in range(s.n_layer))
        self.ln_f = _norm(s)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tied:
            self.lm_head.weight = self.wte.weight


# ---- readers -----------------------------------------------------------------------------------
def from_dims(layers: int, hidden: int, vocab: int, seq: int, heads: int | None = None,
              intermediate: int | None = None, architecture: str = "gpt2",
              tied: bool | None = None) -> ModelSpec:
    """A model of explicit dimensions: GPT-2 shaped by default (learned positions = *seq*,
    biases, 4h MLP, tied head); *heads* defaults to hidden/64 (at least 1)."""
    heads = heads or max(1, hidden // 64)
    gpt2 = architecture == "gpt2"
    return ModelSpec(name=f"{architecture} L{layers} h{hidden} V{vocab}", architecture=architecture,
                     n_layer=layers, hidden=hidden, n_head=heads, vocab=vocab, seq=seq,
                     intermediate=intermediate or (4 * hidden if gpt2 else _llama_width(hidden)),
                     positions=seq if gpt2 else 0, tied=gpt2 if tied is None else tied,
                     bias=gpt2)


def _llama_width(hidden: int) -> int:
    # Llama's default MLP width: 2/3 of 4h, rounded up to a multiple of 256
    return -(-(8 * hidden // 3) // 256) * 256


def _first(cfg: dict, path: str, *keys, default=None, required=True):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is not None or not required:
        return default
    raise PlanError(f"{path} has none of the keys {', '.join(keys)}; the planner needs it to "
                    f"know the model's shape (is this a decoder-only language model's "
                    f"config.json?)")


def from_hf_config(path: str, seq: int | None = None) -> ModelSpec:
    """A model from a Hugging Face ``config.json`` (or the directory holding one): GPT-2
    (``model_type`` "gpt2") or Llama-style keys (num_hidden_layers, hidden_size, …).
    *seq* defaults to the model's context length."""
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise PlanError(f"no config.json at {path}: pass the path of a Hugging Face model's "
                        f"config.json or of the directory that holds it") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {p} as JSON ({exc}); pass a Hugging Face config.json")
    if not isinstance(cfg, dict):
        raise PlanError(f"{p} holds a JSON {type(cfg).__name__}, not the object of a config.json")
    gpt2 = cfg.get("model_type") == "gpt2"
    layers = _first(cfg, str(p), "n_layer", "num_hidden_layers")
    hidden = _first(cfg, str(p), "n_embd", "hidden_size")
    heads = _first(cfg, str(p), "n_head", "num_attention_heads")
    vocab = _first(cfg, str(p), "vocab_size")
    context = _first(cfg, str(p), "n_positions", "max_position_embeddings")
    if gpt2:
        inner = cfg.get("n_inner") or 4 * hidden
        tied = cfg.get("tie_word_embeddings", True)
        bias, kv = True, 0
    else:
        inner = _first(cfg, str(p), "intermediate_size")
        tied = cfg.get("tie_word_embeddings", False)
        bias = bool(cfg.get("attention_bias", False))
        kv = cfg.get("num_key_value_heads") or 0
        if cfg.get("mlp_bias") or (cfg.get("head_dim") not in (None, hidden // heads)):
            raise PlanError(f"{p}: mlp_bias / a head_dim other than hidden_size/"
                            f"num_attention_heads is not modelled by the planner yet; remove "
                            f"it or describe the model with explicit dimensions")
    name = cfg.get("_name_or_path") or cfg.get("model_type") or p.parent.name
    return ModelSpec(name=str(name), architecture="gpt2" if gpt2 else "llama",
                     n_layer=int(layers), hidden=int(hidden), n_head=int(heads),
                     vocab=int(vocab), seq=int(seq or context), intermediate=int(inner),
                     positions=int(context) if gpt2 else 0, kv_heads=int(kv),
                     tied=bool(tied), bias=bias)


def gpt_example(path: os.PathLike | str = GPT_EXAMPLE):
    """``examples/gpt.py`` as a module (imported from the checkout; it is not installed)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise PlanError(f"presets come from examples/gpt.py, which is not at {path} (zero-core "
                        f"installed without its checkout?); describe the model with "
                        f"--hf-config or --layers/--hidden/--vocab/--seq instead")
    name = "zero_core_plan_gpt_example"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def from_preset(name: str, seq: int | None = None, **overrides) -> ModelSpec:
    """A preset of ``examples/gpt.py`` (its own ``PRESETS`` table and ``GPT`` class),
    optionally adjusted as ``GPTConfig.preset(name, **overrides)`` adjusts it."""
    gpt = gpt_example()
    if name not in gpt.PRESETS:
        raise PlanError(f"unknown preset {name!r}: examples/gpt.py has "
                        f"{', '.join(sorted(gpt.PRESETS))}")
    cfg = gpt.GPTConfig.preset(name, **overrides)
    return ModelSpec(name=f"examples/gpt.py {name}", architecture="gpt2", n_layer=cfg.n_layer,
                     hidden=cfg.n_embd, n_head=cfg.n_head, vocab=cfg.vocab_size,
                     seq=seq or cfg.block_size, intermediate=4 * cfg.n_embd,
                     positions=cfg.block_size, tied=True, bias=cfg.bias,
                     builder=lambda: gpt.GPT(cfg))
