"""DeepSpeed's ``flops_profiler`` (issue 32; zero_core/engine/flops.py).

* FLOPs per module against hand-written formulas on fresh random sizes (printed on
  failure): Linear 2·rows·in·out, Conv2d 2·N·Cout·Hout·Wout·(Cin/groups)·kh·kw, batched
  matmul 2·b·m·k·n, attention (SDPA and written out) 4·b·h·s·t·d; parents include their
  children, a module called twice counts twice;
* the example GPT through the engine against ``torch.utils.flop_counter.FlopCounterMode``
  on a plain copy (its own module attribution; on the CPU it counts SDPA as 0, so the
  hand-computed attention is added) and against the hand formula of the whole model, at
  stage 0 and at stage 3 with gradient accumulation (two forwards summed; parameters
  counted at their full sizes, not the partitions);
* only the profile step is touched: no synchronization, no hook and no phase object at the
  other steps; rank 0 only; ``output_file`` written atomically;
* the summary's arithmetic (bwd = 2 x fwd + recompute_fwd_factor, MFU against the peak and
  where the peak comes from), and every bad key a ConfigError naming it.
"""
from __future__ import annotations

import copy
import os
import random
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import zero_core
from zero_core.config import parse_config
from zero_core.engine import flops as fp
from zero_core.engine.timers import OFF, PHASES
from zero_core.errors import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import build_model, lm_loss  # noqa: E402

RNG = random.Random(int.from_bytes(os.urandom(4), "little"))


def sizes(*names, lo=1, hi=9) -> dict[str, int]:
    return {n: RNG.randint(lo, hi) for n in names}


class Attention(torch.nn.Module):
    """Attention written out: scores, softmax, weighted sum."""

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


class SDPA(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class BMM(torch.nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)


def profile_of(module, *args) -> dict[str, fp.ModuleRecord]:
    prof = fp.ForwardProfile(module)
    with prof.counting():
        module(*args)
    prof.remove()
    return prof.records


def test_flops_of_linear_conv_matmul_attention_match_the_formulas():
    s = sizes("b", "m", "k", "n", "cin", "cout", "h", "w", "kh", "kw", "heads", "sq", "sk", "d")
    s["groups"] = RNG.choice([1, 2])
    cin, cout = s["cin"] * s["groups"], s["cout"] * s["groups"]
    lin = torch.nn.Linear(s["k"], s["n"])
    r = profile_of(lin, torch.randn(s["b"], s["m"], s["k"]))[""]
    assert r.flops == 2 * s["b"] * s["m"] * s["k"] * s["n"], s
    assert r.macs == s["b"] * s["m"] * s["k"] * s["n"] and r.params == s["k"] * s["n"] + s["n"]

    conv = torch.nn.Conv2d(cin, cout, (s["kh"], s["kw"]), padding=1, groups=s["groups"])
    x = torch.randn(s["b"], cin, s["h"] + s["kh"], s["w"] + s["kw"])
    out = conv(x)
    hout, wout = out.shape[-2:]
    assert profile_of(conv, x)[""].flops == (2 * s["b"] * cout * hout * wout
                                             * (cin // s["groups"]) * s["kh"] * s["kw"]), s

    a, b = torch.randn(s["b"], s["m"], s["k"]), torch.randn(s["b"], s["k"], s["n"])
    assert profile_of(BMM(), a, b)[""].flops == 2 * s["b"] * s["m"] * s["k"] * s["n"], s

    q = torch.randn(s["b"], s["heads"], s["sq"], s["d"])
    kv = torch.randn(s["b"], s["heads"], s["sk"], s["d"])
    want = 4 * s["b"] * s["heads"] * s["sq"] * s["sk"] * s["d"]
    assert profile_of(Attention(), q, kv, kv)[""].flops == want, s
    assert profile_of(SDPA(), q, kv, kv)[""].flops == want, s  # the CPU's fused kernel too


def test_parents_include_children_and_repeated_calls_add_up():
    s = sizes("rows", "a", "b")

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(s["a"], s["a"], bias=False)
            self.head = torch.nn.Linear(s["a"], s["b"])

        def forward(self, x):
            return self.head(self.inner(self.inner(x)) @ torch.eye(s["a"]))

    rec = profile_of(Twice(), torch.randn(s["rows"], s["a"]))
    one = 2 * s["rows"] * s["a"] * s["a"]
    assert rec["inner"].flops == 2 * one and rec["inner"].calls == 2, s
    assert rec["head"].flops == 2 * s["rows"] * s["a"] * s["b"], s
    # the root: its children plus its own matmul with the identity
    assert rec[""].flops == rec["inner"].flops + rec["head"].flops + one, s
    assert rec[""].params == s["a"] * s["a"] + s["a"] * s["b"] + s["b"]


# ---- through the engine ------------------------------------------------------------------------
def gpt_shapes():
    heads = RNG.choice([1, 2, 4])
    return dict(preset="tiny", n_layer=RNG.randint(1, 2), n_head=heads,
                n_embd=heads * RNG.randint(2, 8)), RNG.randint(1, 3), RNG.randint(2, 12)


def hand_gpt_flops(model, batch, seq) -> int:
    """Matrix products of the GPT's forward, by hand."""
    c, v, L, h = model.cfg.n_embd, model.cfg.vocab_size, model.cfg.n_layer, model.cfg.n_head
    rows = batch * seq
    per_layer = 2 * rows * c * (3 * c + c + 4 * c + 4 * c) + 4 * batch * h * seq * seq * (c // h)
    return L * per_layer + 2 * rows * c * v


def reference_counts(model, idx) -> dict[str, int]:
    """FlopCounterMode's per-module FLOPs on a plain copy, plus the attention it misses on
    the CPU (hand-computed) in the attention modules and their parents."""
    with FlopCounterMode(display=False) as counter:
        model(idx)
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    b, s = idx.shape
    attn = 4 * b * model.cfg.n_head * s * s * (model.cfg.n_embd // model.cfg.n_head)
    out = {}
    for name, _ in model.named_modules():
        key = "GPT" + (f".{name}" if name else "")
        missing = 0
        for i in range(model.cfg.n_layer):
            inside = f"blocks.{i}.attn"
            if name in ("", "blocks", f"blocks.{i}", inside):
                missing += attn
        out[name] = counts.get(key, 0) + missing
    out["blocks"] = sum(out[f"blocks.{i}"] for i in range(model.cfg.n_layer))
    return out


def make_engine(model, stage=0, gas=1, top=None, **profiler):
    engine, *_ = zero_core.initialize(model=model, config={**(top or {}),
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage}, "safety": {"launcher_notice": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True, "peak_tflops": 0.5, **profiler}})
    return engine


def train(engine, batches, syncs=None) -> list[int]:
    """One optimizer step per entry of *batches* (a list of micro-batches); the device
    synchronizations each step made, when *syncs* counts them."""
    per_step = []
    for micro in batches:
        before = len(syncs) if syncs is not None else 0
        for idx in micro:
            engine.backward(lm_loss(engine(idx[:, :-1]), idx[:, 1:]))
            engine.step()
        per_step.append((len(syncs) if syncs is not None else 0) - before)
    return per_step


def our_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("stage,gas", [(0, 1), (3, 2)])
def test_gpt_profile_matches_flop_counter_and_hand_formula(stage, gas, capsys):
    shape, batch, seq = gpt_shapes()
    model = build_model(**shape, seed=RNG.randint(0, 999))
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(RNG.randint(0, 999))
    steps = [[torch.randint(0, 256, (batch, seq + 1), generator=g) for _ in range(gas)]
             for _ in range(4)]
    engine = make_engine(model, stage=stage, gas=gas, profile_step=2)
    hooks = our_hooks(model)
    syncs = []
    engine.runtime.accelerator.synchronize = lambda: syncs.append(1)
    per_step = train(engine, steps[:1], syncs)
    assert all(engine.wall_clock(name) is OFF for name in PHASES)   # not yet: nothing
    per_step += train(engine, steps[1:], syncs)
    assert per_step[0] == per_step[1] == per_step[3] == 0 and per_step[2] > 0, per_step
    assert our_hooks(model) == hooks                                # all taken off
    assert all(engine.wall_clock(name) is OFF for name in PHASES)   # after: nothing
    text = capsys.readouterr().out
    assert text.count("Flops Profiler") == 1 and "Profile Summary at step 2" in text

    p = engine.wall_clock.flops.profile
    want = {k: 0 for k in reference_counts(plain, steps[2][0][:, :-1])}
    for idx in steps[2]:
        for k, v in reference_counts(plain, idx[:, :-1]).items():
            want[k] += v
    got = {name: m["flops"] for name, m in p["modules"].items()}
    assert got == want, (shape, batch, seq)
    assert p["fwd_flops"] == gas * hand_gpt_flops(plain, batch, seq), (shape, batch, seq)
    assert p["micro_steps"] == gas and p["step"] == 2
    params = {name: sum(q.numel() for q in m.parameters()) for name, m in plain.named_modules()}
    assert {n: m["params"] for n, m in p["modules"].items()} == params
    assert p["params"] == plain.num_parameters()
    engine.destroy()


def test_summary_arithmetic_recompute_factor_and_peak(capsys):
    factor = RNG.choice([0.0, 0.5, 1.0])
    # with the wall-clock timers on too: the profiler's phases wrap the timers' own
    engine = make_engine(build_model("tiny", n_layer=1, seed=1), profile_step=0,
                         top={"wall_clock_breakdown": True}, recompute_fwd_factor=factor,
                         module_depth=1, top_modules=2, detailed=False)
    train(engine, [[torch.randint(0, 256, (2, 9))]])
    p = engine.wall_clock.flops.profile
    assert p["iter_s"] == pytest.approx(p["fwd_s"] + p["bwd_s"] + p["step_s"])
    assert p["achieved_flops"] == pytest.approx((3 + factor) * p["fwd_flops"] / p["iter_s"])
    assert p["peak_tflops"] == 0.5 and "config" in p["peak_source"]
    assert p["mfu"] == pytest.approx(p["achieved_flops"] / 0.5e12)
    text = capsys.readouterr().out
    assert f"FLOPS per GPU = {3 + factor:g} * fwd flops per GPU / iter latency" in text
    assert "depth 1:" in text and "depth 2:" not in text and "Detailed" not in text
    assert f"{100 * p['mfu']:.2f}%" in text
    t = engine.get_wall_clock_timers()      # the timers saw the same phases
    assert t["fwd"] > 0 and t["step"] > 0
    engine.destroy()


def test_peak_sources(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert fp.peak_tflops(torch.device("cuda", 0), torch.bfloat16) == (
        989.4, "datasheet, NVIDIA H200, dense bf16")
    assert fp.peak_tflops(torch.device("cuda", 0), torch.bfloat16, 123.0)[0] == 123.0
    tflops, source = fp.measure_matmul_tflops(torch.device("cpu"), torch.float32, n=128)
    assert tflops > 0 and source.startswith("measured")
    # the dtype the peak is looked up in: torch_autocast's when on, else the compute dtype
    for raw, want in (({}, torch.float32), ({"bf16": {"enabled": True}}, torch.bfloat16),
                      ({"torch_autocast": {"enabled": True}}, torch.bfloat16),
                      ({"torch_autocast": {"enabled": True, "dtype": "fp16"}}, torch.float16)):
        cfg = parse_config(raw)
        fake = types.SimpleNamespace(config=cfg, compute_dtype=cfg.compute_dtype,
                                     device=torch.device("cpu"))
        assert fp.matmul_dtype(fake) == want, raw


def test_output_file_is_written_atomically_on_rank_0_only(tmp_path, capsys, monkeypatch):
    target = tmp_path / "sub" / "flops.txt"
    engine = make_engine(build_model("tiny", n_layer=1, seed=2), profile_step=0,
                         output_file=str(target))
    train(engine, [[torch.randint(0, 256, (2, 9))]])
    out = capsys.readouterr().out
    assert "Flops Profiler" not in out and f"written to {target}" in out
    text = target.read_text()
    assert "Profile Summary at step 0" in text and "Detailed Profile" in text
    assert os.listdir(target.parent) == ["flops.txt"]
    # a write that fails leaves the old file whole and no temporary behind
    monkeypatch.setattr(fp.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError("full")))
    with pytest.raises(OSError):
        fp.write_atomically(str(target), "new")
    assert target.read_text() == text and os.listdir(target.parent) == ["flops.txt"]
    engine.destroy()
    cfg = parse_config({"flops_profiler": {"enabled": True}})
    for rank, built in ((0, True), (1, False)):
        fake = types.SimpleNamespace(config=cfg, global_rank=rank)
        assert (fp.build_profiler(fake) is not None) is built


@pytest.mark.parametrize("section,key", [
    ({"profile_step": -1}, "profile_step"), ({"profile_step": "1"}, "profile_step"),
    ({"module_depth": -2}, "module_depth"), ({"top_modules": 0}, "top_modules"),
    ({"recompute_fwd_factor": -0.5}, "recompute_fwd_factor"), ({"detailed": 1}, "detailed"),
    ({"output_file": ""}, "output_file"), ({"output_file": 3}, "output_file"),
    ({"peak_tflops": 0}, "peak_tflops"), ({"enabled": "yes"}, "enabled"),
    ({"profile_stpe": 3}, "profile_stpe"),
])
def test_bad_keys_are_config_errors(section, key):
    with pytest.raises(ConfigError, match=rf"flops_profiler\.{key}"):
        parse_config({"flops_profiler": {"enabled": True, **section}})


def test_keys_parse_and_round_trip():
    raw = {"enabled": True, "recompute_fwd_factor": 1, "profile_step": 5, "module_depth": 2,
           "top_modules": 3, "detailed": False, "output_file": "p.txt", "peak_tflops": 312}
    cfg = parse_config({"flops_profiler": raw})
    assert cfg.flops_profiler.profile_step == 5 and cfg.flops_profiler.peak_tflops == 312.0
    assert parse_config(cfg.to_dict()) == cfg
    assert parse_config({"flops_profiler": {"enabled": False}}).flops_profiler.enabled is False
