#!/usr/bin/env python
"""Write tests/fixtures/deepspeed_zenflow_stage3.json: DeepSpeed 0.19.8's own ZenFlow runs at
ZeRO stage 3, which tests/test_zenflow_stage3.py holds zero-core's stage-3 ZenFlow to.

Run where DeepSpeed is installed, on the CPU::

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python ci/tools/make_zenflow_stage3_fixture.py

DeepSpeed's stage-3 ZenFlow does not run on its cpu accelerator as shipped: its column
selection allocates with a literal ``device='cuda'`` (runtime/zenflow/engine_stage3.py,
``update_selected_channels``: ``torch.zeros(..., device='cuda')`` and
``torch.tensor(local_indices, device='cuda')``), which fails with "Torch not compiled with
CUDA enabled" at the first selection. DeepSpeed's files are not touched; this script wraps
``torch.zeros`` and ``torch.tensor`` in the ranks it starts so that ``device="cuda"`` means
the cpu, which is where every other tensor of that run lives. With ``overlap_step`` true,
DeepSpeed's host step runs in a second process that starts its own torch.distributed
rendezvous on the launcher's port, which this host refuses (EADDRINUSE): those runs hang,
so only ``overlap_step`` false is recorded.

Settings recorded: ``gradient_clipping`` 0 (DeepSpeed 0.19.8's default is 1.0, zero-core's
0; DeepSpeed clips the host step's window mean, not each step's gradient, so clipping is
kept out of the comparison), fp32, AdamW, ``topk_ratio`` 0.3, ``select_strategy`` "step"
with ``select_interval`` 100 (one selection), ``update_interval`` 2 and 3, 1 and 2 ranks.
On 2 ranks DeepSpeed partitions each weight on its own, transposed (in-features × out): the
two weights below split into whole columns (60 = 5 × 12, 36 = 6 × 6 elements per rank), so
no column is cut and DeepSpeed's candidate columns are all columns, as in zero-core.

What the runs show (tests/test_zenflow_stage3.py ``assert_matches_deepspeed``): zero-core's
rules within float32 rounding, except that on 2 ranks DeepSpeed's parameters right after a
host update hold the host's values in the selected elements until its next device step.

The model (``Net``) is linear in its parameters for fixed inputs, so a step's gradient does
not depend on the parameters: ``loss = Σ (l1(x) · c1) + Σ (l2(c1) · c2)`` with step t's
``x, c1, c2`` from ``torch.Generator().manual_seed(1000 + 10 t + rank)``. Recorded per case:
every parameter after each of STEPS steps (``torch.nn.Linear``'s layout), as float32 values.
"""
from __future__ import annotations

import json
import os
import struct
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(REPO, "tests", "fixtures", "deepspeed_zenflow_stage3.json")
STEPS = 8
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.99), 1e-8, 0.01
CASES = {f"world{w}_u{u}": (w, u) for w in (1, 2) for u in (2, 3)}


class Net(torch.nn.Module):
    """Two linear layers, initialised from a seeded generator."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.l1 = torch.nn.Linear(10, 12)
        self.l2 = torch.nn.Linear(12, 6)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x, c1, c2):
        return (self.l1(x) * c1).sum() + (self.l2(c1) * c2).sum()


def inputs(t: int, rank: int):
    g = torch.Generator().manual_seed(1000 + 10 * t + rank)
    return torch.randn(10, generator=g), torch.randn(12, generator=g), torch.randn(6, generator=g)


def config(update_interval: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS),
                                                      "eps": EPS, "weight_decay": WD}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "zenflow": {"topk_ratio": 0.3, "update_interval": update_interval,
                                              "select_strategy": "step", "select_interval": 100,
                                              "overlap_step": False, "full_warm_up_rounds": 0}}}


def f32(v: float) -> float:
    """The shortest decimal that reads back as the same float32 as *v*."""
    for digits in range(6, 10):
        short = float("%.*g" % (digits, v))
        if struct.unpack("f", struct.pack("f", short))[0] == v:
            return short
    return v


def _cuda_means_cpu() -> None:
    for name in ("zeros", "tensor"):
        original = getattr(torch, name)

        def wrapped(*args, _original=original, **kwargs):
            if str(kwargs.get("device", "")) == "cuda":
                kwargs["device"] = "cpu"
            return _original(*args, **kwargs)
        setattr(torch, name, wrapped)


def _rank(update_interval: int, out: str) -> None:
    _cuda_means_cpu()
    import deepspeed
    rank = int(os.environ["RANK"])
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=config(update_interval))
    history = []
    for t in range(1, STEPS + 1):
        engine.backward(engine(*inputs(t, rank)))
        engine.step()
        with deepspeed.zero.GatheredParameters(list(net.parameters())):
            # DeepSpeed's ZenFlow holds the 2-D weights transposed: back to nn.Linear's layout
            history.append({n: [f32(v) for v in (p.detach().t() if p.dim() == 2
                                                  else p.detach()).flatten().tolist()]
                            for n, p in net.named_parameters()})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(history, f)


def main(names: list[str]) -> None:
    from ds_common import run_ranks
    fixture = json.load(open(OUT)) if os.path.exists(OUT) else {}
    fixture["cases"] = fixture.get("cases", {})
    for name in names:
        world, u = CASES[name]
        out = f"/tmp/zenflow_stage3_{name}.json"
        run_ranks(__file__, ["--rank", str(u), out], world, name, timeout=600)
        history = json.load(open(out))
        fixture["cases"][name] = {"world_size": world, "update_interval": u, "steps": history}
        print(name, "recorded")
    import deepspeed
    fixture["deepspeed"] = deepspeed.__version__
    fixture["steps"], fixture["hyper"] = STEPS, {"lr": LR, "betas": BETAS, "eps": EPS,
                                                 "weight_decay": WD, "topk_ratio": 0.3}
    with open(OUT, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _rank(int(sys.argv[2]), sys.argv[3])
    else:
        main(sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES))
