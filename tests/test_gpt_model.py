"""The example GPT (examples/gpt.py): shapes, causality, weight tying, and its forward pass
against an independent float64 re-implementation with an explicit attention mask."""
from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig, build_model, lm_loss  # noqa: E402


def _random_tokens(cfg: GPTConfig, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)


def test_logits_shape_for_full_and_short_sequences():
    gen = torch.Generator().manual_seed(1)
    model = build_model("tiny", seed=1)
    cfg = model.cfg
    for seq in (cfg.block_size, 7):
        logits = model(_random_tokens(cfg, 3, seq, gen))
        assert logits.shape == (3, seq, cfg.vocab_size)
        assert logits.dtype == torch.float32


def test_sequence_longer_than_context_is_refused_with_a_fix():
    model = build_model("tiny", seed=0)
    too_long = torch.zeros(1, model.cfg.block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="block_size"):
        model(too_long)


def test_width_not_divisible_by_heads_is_refused():
    with pytest.raises(ValueError, match="n_head"):
        GPT(GPTConfig(n_embd=30, n_head=4))


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="tiny"):
        GPTConfig.preset("huge")


def test_future_tokens_do_not_change_past_logits():
    gen = torch.Generator().manual_seed(2)
    model = build_model("tiny", seed=2).eval()
    cfg = model.cfg
    x = _random_tokens(cfg, 2, cfg.block_size, gen)
    cut = cfg.block_size // 2
    y = x.clone()
    y[:, cut:] = _random_tokens(cfg, 2, cfg.block_size - cut, gen)
    assert not torch.equal(x[:, cut:], y[:, cut:])
    with torch.no_grad():
        lx, ly = model(x), model(y)
    # positions before the cut saw identical inputs
    torch.testing.assert_close(lx[:, :cut], ly[:, :cut], rtol=0, atol=1e-5)
    # ...and the changed positions really do change the output (the test could fail)
    assert (lx[:, cut:] - ly[:, cut:]).abs().max() > 1e-3


def test_past_tokens_do_change_future_logits():
    gen = torch.Generator().manual_seed(3)
    model = build_model("tiny", seed=3).eval()
    x = _random_tokens(model.cfg, 1, 16, gen)
    y = x.clone()
    y[0, 0] = (x[0, 0] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        diff = (model(x) - model(y)).abs().amax(dim=-1)[0]
    assert (diff[1:] > 1e-4).all(), "later positions ignore an earlier token: attention is broken"


def test_lm_head_is_tied_to_the_token_embedding():
    model = build_model("tiny", seed=4)
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # listed once


def test_tied_weight_gradient_is_the_sum_of_both_uses():
    """Untie a copy of the model: the tied gradient must equal embedding-grad + head-grad."""
    gen = torch.Generator().manual_seed(4)
    tied = build_model("tiny", seed=4)
    untied = copy.deepcopy(tied)
    untied.lm_head.weight = torch.nn.Parameter(tied.tok_emb.weight.detach().clone())
    assert untied.lm_head.weight is not untied.tok_emb.weight
    x = _random_tokens(tied.cfg, 2, 16, gen)
    y = _random_tokens(tied.cfg, 2, 16, gen)
    lm_loss(tied(x), y).backward()
    lm_loss(untied(x), y).backward()
    torch.testing.assert_close(tied.tok_emb.weight.grad,
                               untied.tok_emb.weight.grad + untied.lm_head.weight.grad)
    # both uses contribute: neither part alone is the whole gradient
    assert untied.tok_emb.weight.grad.abs().sum() > 0
    assert untied.lm_head.weight.grad.abs().sum() > 0


def _expected_parameter_count(cfg: GPTConfig) -> int:
    d, v, t = cfg.n_embd, cfg.vocab_size, cfg.block_size
    ln = 2 * d
    per_block = 2 * ln + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return v * d + t * d + cfg.n_layer * per_block + ln  # LM head shares the v*d embedding


@pytest.mark.parametrize("preset", ["tiny", "small", "bench"])
def test_parameter_count_matches_the_architecture(preset):
    cfg = GPTConfig.preset(preset)
    model = GPT(cfg)
    assert model.num_parameters() == _expected_parameter_count(cfg)


def test_bench_preset_is_the_benchmark_model():
    cfg = GPTConfig.preset("bench")
    assert (cfg.n_layer, cfg.block_size, cfg.vocab_size) == (4, 128, 256)
    assert 19_000_000 <= _expected_parameter_count(cfg) <= 21_000_000


def _reference_forward_float64(model: GPT, x: torch.Tensor) -> torch.Tensor:
    """GPT forward in float64 with hand-written attention (explicit -inf mask, softmax)."""
    p = {k: v.detach().double() for k, v in model.state_dict().items()}
    cfg = model.cfg
    d, nh = cfg.n_embd, cfg.n_head
    hd = d // nh
    seq = x.shape[1]

    def layer_norm(h, name):
        mu = h.mean(-1, keepdim=True)
        var = ((h - mu) ** 2).mean(-1, keepdim=True)
        return (h - mu) / torch.sqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"]

    def linear(h, name):
        return h @ p[name + ".weight"].T + p[name + ".bias"]

    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)
    h = p["tok_emb.weight"][x] + p["pos_emb.weight"][:seq]
    for i in range(cfg.n_layer):
        pre = f"blocks.{i}."
        a = layer_norm(h, pre + "ln_attn")
        q, k, v = linear(a, pre + "attn.qkv").split(d, dim=-1)
        heads = [(t.view(*t.shape[:2], nh, hd).transpose(1, 2)) for t in (q, k, v)]
        scores = heads[0] @ heads[1].transpose(-1, -2) / math.sqrt(hd) + mask
        att = torch.softmax(scores, dim=-1) @ heads[2]
        h = h + linear(att.transpose(1, 2).reshape(h.shape), pre + "attn.proj")
        m = layer_norm(h, pre + "ln_mlp")
        fc = linear(m, pre + "mlp.fc")
        gelu = 0.5 * fc * (1 + torch.erf(fc / math.sqrt(2)))
        h = h + linear(gelu, pre + "mlp.proj")
    h = layer_norm(h, "ln_f")
    return h @ p["tok_emb.weight"].T


def test_forward_matches_float64_reference_on_random_weights():
    gen = torch.Generator().manual_seed(5)
    model = build_model("tiny", seed=5).eval()
    # perturb every parameter so zero-initialised biases and LN affine terms matter too
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    x = _random_tokens(model.cfg, 2, 20, gen)
    with torch.no_grad():
        got = model(x).double()
    want = _reference_forward_float64(model, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_loss_at_init_is_near_uniform_over_the_vocabulary():
    gen = torch.Generator().manual_seed(6)
    model = build_model("small", seed=6)
    x = _random_tokens(model.cfg, 2, 32, gen)
    with torch.no_grad():
        loss = lm_loss(model(x[:, :-1]), x[:, 1:]).item()
    assert abs(loss - math.log(model.cfg.vocab_size)) < 0.5


def test_seeded_build_is_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("tiny", seed=7)
    after = torch.rand(1)
    b = build_model("tiny", seed=7)
    c = build_model("tiny", seed=8)
    assert torch.equal(before, after)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
