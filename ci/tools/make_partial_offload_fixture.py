#!/usr/bin/env python
"""Write tests/fixtures/deepspeed_partial_offload.json, DeepSpeed's own runs of partial
optimizer offload (``zero_optimization.offload_optimizer.ratio``) that
tests/test_offload_partial_deepspeed.py compares zero-core against.

Run where DeepSpeed is installed, on the CPU::

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python ci/tools/make_partial_offload_fixture.py

(a comma-separated list of case names as the only argument reruns just those cases; rerun a
ratio 1.0 case together with its ratio < 1 twins, which may point at its masters.)

Per case (ZeRO stage x precision x ``ratio``), two ranks on this host (gloo) build the small
model below from ``torch.manual_seed(0)`` and train it for STEPS optimizer steps of GAS
micro-steps each on fixed data (micro-step ``k`` of step ``s``:
``torch.Generator().manual_seed(700 + 10 * s + k)``, ``x = randn(8, 48)``,
``y = randn(8, 8)``, rank r of 2 taking rows ``[4r, 4r + 4)``), with the config's ``AdamW``
(offloaded: DeepSpeed builds its DeepSpeedCPUAdam) and gradient clipping. Recorded: the
mean loss of each step (over micro-steps and ranks), every parameter's fp32 master value
after the last step (base64 of its little-endian float32 bytes; a ratio < 1 run whose
masters are bit-identical to its ratio 1.0 twin's records ``final_identical_to`` instead), and — where DeepSpeed's stage-3 optimizer has them — its sub-group
count per rank and where it put each sub-group (``subgroup_to_device``: "cpu" is its host
path, DeepSpeedCPUAdam; anything else would be its device path, torch.optim.AdamW).
A case DeepSpeed refuses is recorded with its message instead.

What this machine can show: DeepSpeed's CPU accelerator is named "cpu", so its partial
offload rule (stage3.py: sub-group i goes to the accelerator when
``i < int((1 - ratio) * n)``) sends the "device" sub-groups to a device called "cpu", and
its step takes the host branch for them too: every sub-group is stepped by DeepSpeedCPUAdam
whatever ``ratio`` says. The runs with ``ratio`` < 1 are therefore DeepSpeed's full offload
run under another config, and the fixture records that (``device_path_subgroups`` is 0).
At stages 1 and 2, DeepSpeed refuses ``ratio`` < 1 at config validation.
"""
from __future__ import annotations

import base64
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(REPO, "tests", "fixtures", "deepspeed_partial_offload.json")
STEPS, GAS, MICRO, RANKS = 4, 2, 4, 2
SUB_GROUP_SIZE = 1024

#: name -> (stage, precision, ratio)
CASES = {
    **{f"stage3_{p}_ratio{r}": (3, p, r) for p in ("fp32", "bf16") for r in (1.0, 0.7, 0.5, 0.3)},
    **{f"stage{s}_{p}_ratio{r}": (s, p, r) for s in (1, 2) for p in ("fp32", "bf16")
       for r in (1.0, 0.5)},
}


class Net(torch.nn.Module):
    """Three linear layers, 7816 parameters: each rank's partition (3908 elements) is
    several sub-groups in both libraries (DeepSpeed: 3 per rank at stage 3, cut at
    parameter boundaries; zero-core: 4, cut at multiples of 1024 elements)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(48, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, micro: int, rank: int, world: int):
    g = torch.Generator().manual_seed(700 + 10 * step + micro)
    x = torch.randn(MICRO * world, 48, generator=g)
    y = torch.randn(MICRO * world, 8, generator=g)
    return x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]


def config(stage: int, precision: str, ratio: float) -> dict:
    zo = {"stage": stage, "sub_group_size": SUB_GROUP_SIZE, "reduce_bucket_size": 3000,
          "offload_optimizer": {"device": "cpu", "ratio": ratio}}
    if stage == 3:
        zo["stage3_param_persistence_threshold"] = 0
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "gradient_clipping": 0.05, "zero_optimization": zo,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99],
                                                     "eps": 1e-8, "weight_decay": 0.01}},
           "steps_per_print": 1000}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def encode(t: torch.Tensor) -> str:
    """base64 of *t*'s values as little-endian float32 bytes."""
    return base64.b64encode(t.detach().float().cpu().reshape(-1).numpy().astype("<f4")
                            .tobytes()).decode()


def decode(text: str) -> torch.Tensor:
    """The flat float32 tensor :func:`encode` wrote."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.float32).clone()


def rank_main(name: str, out: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stage, precision, ratio = CASES[name]
    model = make_model()
    cfg = config(stage, precision, ratio)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=cfg)
    except Exception as exc:  # noqa: BLE001 - the refusal is what gets recorded
        if rank == 0:
            with open(out, "w") as fh:
                json.dump({"config": cfg, "refused": f"{type(exc).__name__}: {exc}"}, fh)
        return
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    losses = []
    for s in range(STEPS):
        total = torch.zeros(())
        for k in range(GAS):
            x, y = batch(s, k, rank, world)
            loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(float(total) / (world * GAS))
    final = {}
    for n, p in engine.module.named_parameters():
        v = safe_get_full_fp32_param(p)
        final[n] = encode(v)
    opt = engine.optimizer
    placement = getattr(opt, "subgroup_to_device", None)
    subgroups = {"n": len(placement), "to_device": [placement[i] for i in range(len(placement))],
                 "device_path": sum(d != "cpu" for d in placement.values())} \
        if placement is not None else None
    all_subgroups = [None] * world
    dist.all_gather_object(all_subgroups, subgroups)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"config": cfg, "losses": losses, "final": final,
                       "subgroups_per_rank": all_subgroups,
                       "optimizer": type(getattr(opt, "optimizer", opt)).__name__,
                       "wrapper": type(opt).__name__}, fh)
    dist.barrier()


def run_case(name: str, work: str) -> dict:
    from ds_common import run_ranks
    out = os.path.join(work, f"{name}.json")
    run_ranks(__file__, ["--rank", name, out], RANKS, f"case {name}")
    with open(out) as fh:
        return json.load(fh)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank":
        rank_main(argv[1], argv[2])
        return 0
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    work = os.path.join("/tmp", "zero_core_partial_offload_fixture")
    os.makedirs(work, exist_ok=True)
    only = set(argv[0].split(",")) if argv else None
    result = {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
              "accelerator": get_accelerator()._name, "steps": STEPS, "gas": GAS,
              "micro_batch": MICRO, "cases": {}}
    if os.path.exists(OUT) and only:
        with open(OUT) as fh:
            result["cases"] = json.load(fh)["cases"]
    for name in CASES:
        if only and name not in only:
            continue
        print(f"[partial offload fixture] {name}", flush=True)
        result["cases"][name] = run_case(name, work)
    for name, case in result["cases"].items():  # record bit-identical twins once
        twin = result["cases"].get(name.rsplit("_ratio", 1)[0] + "_ratio1.0")
        if twin is not case and "final" in case and twin is not None and "final" in twin \
                and case["final"] == twin["final"]:
            del case["final"]
            case["final_identical_to"] = name.rsplit("_ratio", 1)[0] + "_ratio1.0"
    with open(OUT, "w") as fh:
        json.dump(result, fh, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
