"""``offload_param`` without ``offload_optimizer`` at stage 3 (DeepSpeed accepts it; HF
accelerate's test config and axolotl's ``zero3_bf16_cpuoffload_params`` use it).

The parameter partitions (compute dtype) live in host memory or swap files; the master
weights and optimizer states stay on the device and are stepped there by the engine's own
kernels; each unit's updated values are written back into the store (offload/params.py,
``DeviceStepOptimizer``). Every operation on the values is the one stage 3 without offload
performs (the write-back rounds by a copy, as the kernels' ``param_lowp`` does), so the
runs must be bit-identical to stage 3 without offload, step for step. Stage 3 without
offload is itself held to the single-process plain-torch reference by
tests/test_stage3_multirank.py, and tests/test_device_matrix.py runs this mode on the
``vdev`` device (``off_ponly_*``: the partitions on the host, the master on the device,
the traffic counted, the reference) — this file runs on 2 gloo ranks, plus an in-process
check of the optimizers that do not go through the fused kernels (torch.optim classes,
Lamb).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "offload_train.py")


def _train(name, precision, param):
    return ["train", name, 3, precision, "none", param]


PLAN = ([_train(f"s3-{prec}-{param}", prec, param)
         for prec in ("fp32", "bf16") for param in ("none", "cpu", "nvme")]
        + [_train("s3-bf16m-none", "bf16m", "none"), _train("s3-bf16m-nvme", "bf16m", "nvme")]
        + [["resume", 3, "none", "cpu"], ["resume", 3, "none", "nvme"]])
_CACHE: dict = {}


def launch(tmp_path_factory):
    if "reports" not in _CACHE:
        scratch = tmp_path_factory.mktemp("ponly_swap")
        results = run_ranks(WORKER, 2, "torchrun", args=[json.dumps(PLAN), str(scratch)],
                            env={"ZERO_CORE_COMM": "gloo"}, timeout=900)
        reports = [r.report for r in results]
        assert all(rep is not None for rep in reports), "a rank did not report"
        _CACHE["reports"] = reports
    return _CACHE["reports"]


def by_name(rank_report):
    return {r["name"]: r for r in rank_report if "name" in r}


pytestmark = pytest.mark.multirank


def test_parameter_offload_alone_is_bit_identical_to_stage3(tmp_path_factory):
    reports = launch(tmp_path_factory)
    runs = by_name(reports[0])
    checked = 0
    for name, run in runs.items():
        stage, prec, param = name.split("-")
        if param == "none":
            continue
        base = runs[f"{stage}-{prec}-none"]
        # step for step: every loss, the last gradient norm, every final value
        assert run["losses"] == base["losses"], (name, run["losses"], base["losses"])
        assert run["grad_norm"] == base["grad_norm"], name
        for p, vals in base["values"].items():
            assert run["values"][p] == vals, f"{name}: {p} differs from stage 3 without offload"
        # it really ran offloaded: the optimizer on the device, the partitions in the store
        off = run["offload"]
        assert off["device"] == "none", off
        assert off["params"]["device"] == param, off
        if param == "nvme":
            assert off["params"]["bytes_read"] > 0 and off["params"]["bytes_written"] > 0
            assert off["params"]["read_ahead_hits"] > 0, off["params"]
        # the master is the device's, never read from the store
        assert not any(run["master_from_store"]), name
        checked += 1
    assert checked == 5
    for rank_report in reports[1:]:   # the ranks agree on the gathered result
        for name, run in by_name(rank_report).items():
            assert run["values"] == runs[name]["values"], name


def test_checkpoint_round_trip_with_parameter_offload_alone(tmp_path_factory):
    """Train 3 steps, save, train 3 (A); a fresh engine loads and trains the same 3 (B):
    the master and Adam states came back and the store was refilled from the master."""
    resumes = [r for r in launch(tmp_path_factory)[0] if "a" in r]
    assert len(resumes) == 2
    for r in resumes:
        assert r["a"] == r["b"]


# ---- in process: the optimizers outside the fused path --------------------------------------

def _train_in_process(tmp_path, param: str, make_opt, precision: str):
    import zero_core
    from zero_core.stage3 import GatheredParameters
    from zero_core.runtime.context import shutdown
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.GELU(), torch.nn.Linear(20, 6))
    zo = {"stage": 3, "stage3_param_persistence_threshold": 0,
          "stage3_prefetch_bucket_size": 200, "reduce_bucket_size": 200}
    if param != "none":
        zo["offload_param"] = {"device": param, "nvme_path": str(tmp_path), "buffer_count": 4,
                               "buffer_size": 400}
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zo,
           "safety": {"launcher_notice": False}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    kwargs = {}
    opt = make_opt(model)
    if isinstance(opt, dict):
        cfg["optimizer"] = opt
    else:
        kwargs["optimizer"] = opt
    engine, *_ = zero_core.initialize(model=model, config=cfg, **kwargs)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(4):
        x, y = torch.randn(4, 12, generator=g), torch.randn(4, 6, generator=g)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        loss = (engine(x.to(engine.device, dtype)).float() - y.to(engine.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with GatheredParameters(list(model.parameters())):
        values = [p.detach().float().clone().cpu() for p in model.parameters()]
    engine.destroy()
    shutdown()
    return losses, values


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("opt", ["rmsprop", "lamb"])
def test_torch_optimizers_and_lamb_write_back_too(tmp_path, precision, opt):
    make = {"rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2),
            "lamb": lambda m: {"type": "Lamb", "params": {"lr": 1e-2}}}[opt]
    ref_losses, ref_values = _train_in_process(tmp_path, "none", make, precision)
    for param in ("cpu", "nvme"):
        losses, values = _train_in_process(tmp_path, param, make, precision)
        assert losses == ref_losses, (param, losses, ref_losses)
        for a, b in zip(values, ref_values):
            assert torch.equal(a, b), param
    # and the run moved: a write-back that was lost would leave the first values
    assert ref_losses[0] != ref_losses[-1]
