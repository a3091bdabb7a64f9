#!/usr/bin/env python
"""Write tests/fixtures/deepspeed_zenflow_auto.json: DeepSpeed 0.19.8's own ZenFlow runs with
``update_interval: "auto"``, which tests/test_zenflow.py holds zero-core's auto rule to.

Run where DeepSpeed is installed, on the CPU (it runs there: ZeRO-2, cpu offload, gloo)::

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python ci/tools/make_zenflow_auto_fixture.py

DeepSpeed's files are not touched; what this script changes, from outside, after
``deepspeed.initialize``:

* ``engine.gradient_accumulation_steps`` returns 1. DeepSpeed sets the engine's
  ``gradient_accumulation_steps`` to ``update_interval``, which is 0 in auto mode, and its
  backward divides the loss gradient by it: every gradient is inf/NaN from the first step
  (recorded below as ``unpatched_first_grad_finite``), so nothing else could be observed;
* in the ``"repaired"`` runs only, the optimizer's ``backward_prologue`` clears the slot of
  the two-slot ``zenflow_need_update`` flag that the coming backward writes, after reading
  the other one, instead of the slot the previous backward wrote (which it clears before
  anything reads it: in the ``"observed"`` runs the flag is raised on most steps and the
  host update still fires only at the selection boundaries).

Per case (world size × observed/repaired), ranks on this host build the model below from
``torch.manual_seed(0)`` and train STEPS micro-steps on fixed data whose input columns have
fixed, unequal scales (so the selected columns stay heavy and windows last several steps).
Rank 0 records per micro-step, for every 2-D weight: ``total`` (DeepSpeed's Σ|g| over the
weight, as it holds it: per-partition bf16 sums added in bf16), ``critic`` (Σ|g| over the
selected columns, fp32), and DeepSpeed's ``non_critic_sum`` / ``avg_critic_sum`` after the
step; and per step the window counter (the optimizer's ``update_interval``, 1 on a window's
first step), ``num_need_update``, the flag written, and whether the step was a host-update
boundary (``is_gradient_accumulation_boundary`` as ``step()`` reads it).
"""
from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(REPO, "tests", "fixtures", "deepspeed_zenflow_auto.json")
STEPS, BATCH = 14, 8
ZENFLOW = {"topk_ratio": 0.25, "select_strategy": "step", "select_interval": 7,
           "update_interval": "auto", "auto_ratio": 0.99}
CASES = {f"{mode}_world{w}": (mode, w) for mode in ("observed", "repaired") for w in (1, 2)}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 12)
        self.l2 = torch.nn.Linear(12, 12)
        self.l3 = torch.nn.Linear(12, 4)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(900 + step)
    scale = torch.linspace(3.0, 0.2, 16)
    x = torch.randn(BATCH, 16, generator=g) * scale
    y = torch.randn(BATCH, 4, generator=g)
    n = BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _repaired_prologue(self):
    """DeepSpeed's ZenFlowZeroOptimizer.backward_prologue with the flag slot fixed."""
    self.micro_step += 1
    prev = self.zenflow_state ^ 1        # written by the backward before the last one
    self.num_need_update = 0
    if self.zenflow_need_update[prev]:
        self.update_interval = 0
        for group in self.bit16_groups:
            for p in group:
                p.non_critic_sum = 0
    self.zenflow_need_update[prev] = False   # the slot the coming backward writes
    self.update_interval += 1
    if self.is_zenflow_select_boundary():
        self.sync_fp32_param_from_gpu()
        self.selective_optimizer.clear_selected_mv()


class _Offsets(dict):
    """param_id -> sum-buffer offsets; keeps each list DeepSpeed empties after use."""

    def __init__(self):
        super().__init__()
        self.used = {}

    def __setitem__(self, key, value):
        if not value and self.get(key):
            self.used[key] = list(self[key])
        super().__setitem__(key, value)


def rank_main(name: str, out: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zenflow import zenflow_stage_1_and_2 as zf

    mode, _ = CASES[name]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    names = {id(p): n for n, p in model.named_parameters()}
    cfg = {"train_micro_batch_size_per_gpu": BATCH // world,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                 "zenflow": ZENFLOW},
           "steps_per_print": 1000}
    if mode == "repaired":
        zf.ZenFlowZeroOptimizer.backward_prologue = _repaired_prologue
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    opt = engine.optimizer
    gas_seen = engine.gradient_accumulation_steps()
    engine.gradient_accumulation_steps = lambda: 1
    cls = type(opt)
    opt.__class__ = type("Recorded" + cls.__name__, (cls,), {"sum_buffer": property(
        lambda self: self.__dict__.get("_sb"),
        lambda self, v: self.__dict__.update(_sb=v, **({"_sb_last": v} if v is not None
                                                       else {})))})
    opt.param_id_sum_buffer_offset = _Offsets()
    steps, calls, critic = [], [], {}
    sel = opt.selective_optimizer
    for method in ("group_step", "temp_copy_param"):   # they drop selected_grad: read it first
        def keep(group_to_params, _inner=getattr(sel, method)):
            critic.update({id(p): float(p.selected_grad.abs().sum())
                           for ps in group_to_params.values() for p in ps if p.dim() == 2})
            return _inner(group_to_params)
        setattr(sel, method, keep)
    inner = cls._process_selected_fp32_groups_grad

    def process(self, tensor, total, dtype):
        inner(self, tensor, total, dtype)
        calls.append(1)
        rec = {}
        for group in self.bit16_groups:
            for p in group:
                if p.dim() != 2:
                    continue
                total_sum = 0
                for off in self.param_id_sum_buffer_offset.used[self.get_param_id(p)]:
                    total_sum += self._sb_last.narrow(0, off, 1)
                rec[names[id(p)]] = {"total": float(total_sum),
                                     "critic": critic.pop(id(p)),
                                     "non_critic_sum": float(p.non_critic_sum),
                                     "avg_critic_sum": float(p.avg_critic_sum)}
        steps.append({"weights": rec, "window_step": self.update_interval,
                      "num_need_update": self.num_need_update,
                      "flag": bool(self.zenflow_need_update[self.zenflow_state])})
    opt._process_selected_fp32_groups_grad = process.__get__(opt)
    for s in range(STEPS):
        x, y = batch(s, rank, world)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        steps[-1]["boundary"] = bool(engine.is_gradient_accumulation_boundary())
        engine.step()
    assert len(calls) == STEPS, "one reduction bucket per micro-step expected"
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"config": cfg, "engine_gradient_accumulation_steps": gas_seen,
                       "num_2d_weights": sum(p.dim() == 2 for p in model.parameters()),
                       "steps": steps}, fh)
    dist.barrier()


def unpatched_first_grad_finite() -> bool:
    """One rank, no patch: is the first backward's gradient finite?"""
    import deepspeed
    torch.manual_seed(0)
    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": BATCH,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                 "zenflow": ZENFLOW}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    seen = []
    inner = type(engine.optimizer).average_tensor

    def average(self, tensor, dtype):
        seen.append(bool(torch.isfinite(tensor).all()))
        return inner(self, tensor, dtype)
    engine.optimizer.average_tensor = average.__get__(engine.optimizer)
    x, y = batch(0, 0, 1)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    finite = bool(seen) and all(seen)
    return finite


def run(args: list[str], world: int) -> None:
    from ds_common import run_ranks
    run_ranks(__file__, args, world, str(args))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank":
        rank_main(argv[1], argv[2])
        return 0
    if argv and argv[0] == "--unpatched":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        with open(argv[1], "w") as fh:
            json.dump(unpatched_first_grad_finite(), fh)
        return 0
    import deepspeed
    work = os.path.join("/tmp", "zero_core_zenflow_auto_fixture")
    os.makedirs(work, exist_ok=True)
    result = {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
              "zenflow": ZENFLOW, "steps": STEPS, "cases": {}}
    path = os.path.join(work, "unpatched.json")
    run(["--unpatched", path], 1)
    with open(path) as fh:
        result["unpatched_first_grad_finite"] = json.load(fh)
    for name, (_, world) in CASES.items():
        print(f"[zenflow auto fixture] {name}", flush=True)
        path = os.path.join(work, f"{name}.json")
        run(["--rank", name, path], world)
        with open(path) as fh:
            result["cases"][name] = json.load(fh)
    with open(OUT, "w") as fh:
        json.dump(result, fh, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
