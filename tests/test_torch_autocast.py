"""``torch_autocast`` as DeepSpeed 0.19.8 defines it — alone, and with ``bf16`` as
DeepSpeedExamples' ``training/bf16_master_weight`` configs combine them — and
``lower_precision_safe_modules`` (zero_core/engine/autocast.py).

Single-process checks: the config accepts bf16 + torch_autocast and refuses what DeepSpeed
cannot train; which parameters are marked lower-precision safe (exact class match, class
paths, DeepSpeed's default list, nothing at stage 0); an outer autocast around the engine.

Two ranks (gloo, tests/workers/torch_autocast.py), stages 0-3:

- ``grads`` (1 and 2 micro-steps): every reduced gradient element is compared with float64
  references — the gradients are exact (each parameter enters the loss as ``sum(w * x)``),
  so "equal" means bit-equal: safe parameters' reduction is the two ranks' bf16-rounded
  gradients summed with one bf16 rounding, landing in the fp32 accumulator (and visibly not
  the fp32 sum), every other parameter's is the fp32 sum (0 difference); at stage 0
  everything is the fp32 sum, as in DeepSpeed. The
  collectives' input dtypes (a spy on the communicator) and the ledger's bytes agree:
  2 bytes per bf16 element, 4 per fp32 one, fewer bytes than an all-fp32 reduction.
- ``train``: 4 steps of the model of ci/tools/make_autocast_fixture.py, for every case
  DeepSpeed ran there (tests/fixtures/deepspeed_autocast.json: stages 0-3 x fp32 / bf16 /
  bf16 master weights+states, and a custom safe list). Bounds, and why:
  against the plain-torch reference (same autocast, per-parameter reduction dtypes,
  clipping, torch.optim.Adam) and against DeepSpeed, fp32 parameters: TOL_FP32 = 1e-6
  absolute on weights of size ~1 (measured <= 1.2e-7 against DeepSpeed, 1.5e-8 against the
  reference: op order only); bf16 parameters/master: the
  values are bf16 (unit roundoff 2^-8 relative), so TOL_BF16 = 2^-6 relative to the
  largest weight — a few bf16 ulps, room for an update rounding the other way (measured:
  <= 2.0e-3 of 1.02, stage 0 against DeepSpeed's FP16_Optimizer 6.9e-3); losses within
  1e-6 relative (fp32; measured 0 against DeepSpeed, 5e-8 against the reference) and 2e-2
  (bf16; measured <= 3.1e-3). Mutation check: reducing every gradient in fp32 moves the
  fp32 weights by 2.7e-5 to 8.1e-5 and the losses by 1.1e-4 relative.
"""
from __future__ import annotations

import copy
import json
import logging
import os

import pytest
import torch

import zero_core
from zero_core.config import parse_config
from zero_core.engine import autocast as ac
from zero_core.errors import ConfigError
from zero_core.testing.ranks import run_ranks

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "workers", "torch_autocast.py")
FIXTURE = os.path.join(HERE, "fixtures", "deepspeed_autocast.json")
TOL_FP32, TOL_BF16 = 1e-6, 2.0 ** -6


# ---- config -------------------------------------------------------------------------------
def test_bf16_with_torch_autocast_is_accepted_as_in_deepspeed_examples():
    cfg = parse_config({"train_batch_size": 4,
                        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                 "bf16_optimizer_states": True},
                        "zero_optimization": {"stage": 3},
                        "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}})
    assert cfg.precision == "bf16" and cfg.torch_autocast.enabled
    assert cfg.torch_autocast.dtype == "bf16"


@pytest.mark.parametrize("extra,key", [
    ({"fp16": {"enabled": True}, "torch_autocast": {"enabled": True}}, "torch_autocast.enabled"),
    ({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "fp16"}},
     "torch_autocast.dtype"),
])
def test_combinations_that_would_need_a_grad_scaler_are_refused_by_name(extra, key):
    with pytest.raises(ConfigError, match=key):
        parse_config({"train_batch_size": 4, **extra})


# ---- which parameters are lower-precision safe --------------------------------------------
class MyLinear(torch.nn.Linear):
    """A subclass of torch.nn.Linear: DeepSpeed matches classes exactly, so not safe."""


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.conv = torch.nn.Conv1d(2, 2, 3)
        self.norm = torch.nn.LayerNorm(4)
        self.sub = MyLinear(4, 4)
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 2))


def marks(model, stage=2, **extra):
    cfg = parse_config({"train_batch_size": 1, "zero_optimization": {"stage": stage},
                        "torch_autocast": {"enabled": True, "dtype": "bf16"}, **extra})
    ac.mark_comm_dtypes(model, cfg, torch.device("cpu"))
    return {n: getattr(p, ac.COMM_DTYPE_ATTR, None) for n, p in model.named_parameters()}


def test_default_safe_modules_are_linear_and_conv_exactly():
    m = marks(Mixed())
    bf, f32 = torch.bfloat16, torch.float32
    assert m == {"lin.weight": bf, "lin.bias": bf, "conv.weight": bf, "conv.bias": bf,
                 "norm.weight": f32, "norm.bias": f32, "sub.weight": f32, "sub.bias": f32,
                 "block.0.weight": bf, "block.0.bias": bf}
    # bf16 training: the others travel in their own dtype, bf16
    assert set(marks(Mixed(), bf16={"enabled": True}).values()) == {bf}


def test_class_paths_replace_the_default_list():
    m = marks(Mixed(), torch_autocast={"enabled": True, "dtype": "bf16",
                                       "lower_precision_safe_modules": [
                                           "torch.nn.LayerNorm", f"{__name__}.MyLinear"]})
    assert {n for n, d in m.items() if d == torch.bfloat16} == {
        "norm.weight", "norm.bias", "sub.weight", "sub.bias"}


@pytest.mark.parametrize("path,why", [("torch.nn.NoSuchLayer", "cannot import"),
                                      ("no_such_package.Layer", "cannot import"),
                                      ("torch.float32", "not a torch.nn.Module class")])
def test_a_bad_class_path_is_a_config_error_naming_the_key(path, why):
    with pytest.raises(ConfigError, match=f"lower_precision_safe_modules.*{why}"):
        marks(Mixed(), torch_autocast={"enabled": True, "dtype": "bf16",
                                       "lower_precision_safe_modules": [path]})


def test_stage_0_and_stage_1_bf16_with_fp32_accumulation_use_communication_data_type(caplog):
    # DeepSpeed's engine all-reduce (stage 0) and its BF16_Optimizer (stage 1, bf16
    # parameters, fp32 accumulation) reduce everything in communication_data_type
    assert set(marks(Mixed(), stage=0).values()) == {None}
    assert set(marks(Mixed(), stage=1, bf16={"enabled": True},
                     data_types={"grad_accum_dtype": "fp32"}).values()) == {None}
    # a model given to a second engine loses the first one's marks
    model = Mixed()
    marks(model, stage=2)
    assert set(marks(model, stage=0).values()) == {None}
    with caplog.at_level(logging.WARNING, logger="zero_core.engine"):
        marks(Mixed(), stage=2, communication_data_type="fp32")
    assert "communication_data_type" in caplog.text and "no effect" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zero_core.engine"):
        marks(Mixed(), stage=0, torch_autocast={"enabled": True, "dtype": "bf16",
                                                "lower_precision_safe_modules": ["torch.nn.Linear"]})
    assert "lower_precision_safe_modules has no effect at ZeRO stage 0" in caplog.text


def test_bf16_with_a_null_dtype_on_a_device_whose_default_is_fp16_is_refused():
    # torch's autocast default on cuda is fp16: bf16 parameters would be cast to fp16
    cfg = parse_config({"train_batch_size": 1, "bf16": {"enabled": True},
                        "torch_autocast": {"enabled": True}})
    with pytest.raises(ConfigError, match="torch_autocast.dtype"):
        ac.mark_comm_dtypes(Mixed(), cfg, torch.device("cuda"))
    ac.mark_comm_dtypes(Mixed(), cfg, torch.device("cpu"))  # cpu's default is bf16


class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        y = self.lin(x)
        self.seen.append(y.dtype)
        return y


@pytest.mark.parametrize("section,expected", [(None, torch.float32),
                                              ({"enabled": True, "dtype": "fp16"}, torch.float16)])
def test_the_config_decides_over_an_outer_autocast(section, expected, caplog):
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if section is not None:
        cfg["torch_autocast"] = section
    model = Probe()
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="zero_core.engine"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                engine(torch.randn(2, 6))
        assert model.seen == [expected]
    finally:
        engine.destroy()


def test_bf16_with_autocast_casts_the_model_and_autocasts_the_forward():
    torch.manual_seed(3)
    model = Probe()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    engine, *_ = zero_core.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "torch_autocast": {"enabled": True, "dtype": "bf16"}})
    try:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        x = torch.randn(2, 6)  # fp32 input: autocast casts it, no caller cast needed
        out = engine(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = reference(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    finally:
        engine.destroy()


# ---- two ranks -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixture_data():
    with open(FIXTURE) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def reports():
    results = run_ranks(WORKER, 2, "torchrun", args=[FIXTURE], env={"ZERO_CORE_COMM": "gloo"},
                        timeout=600)
    reps = [r.report for r in results]
    assert all(rep is not None and rep["world"] == 2 for rep in reps), "a rank did not report"
    return reps


@pytest.mark.multirank
@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_modules_reduce_in_bf16_and_the_rest_in_fp32(reports, stage, gas):
    check_grads(reports, f"grads/s{stage}/gas{gas}", stage, gas)


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [2, 3])
def test_communication_data_type_does_not_round_the_other_gradients(reports, stage):
    # DeepSpeed ignores communication_data_type under torch_autocast at stages 1-3
    check_grads(reports, f"grads/s{stage}/comm_bf16", stage, 1)


def check_grads(reports, key, stage, gas):
    for rep in reports:
        r = rep[key]
        p = r["params"]
        assert all(p[k]["n"] > 0 for k in p), r  # every rank owns some of each kind
        for kind in ("plain", "sub"):  # the subclass of a safe class is not safe
            assert p[kind]["vs_fp32_rule"] == 0.0, r
        seen = r["collectives"]
        if stage == 0:
            assert p["safe"]["vs_fp32_rule"] == 0.0, r
            assert {k for k in seen if not k.endswith("float64")} == {"all_reduce/float32"}, r
            continue
        assert p["safe"]["vs_bf16_rule"] == 0.0, r
        assert p["safe"]["vs_fp32_rule"] > 1e-3, r  # the bf16 rounding is visible
        bf, f32 = seen["reduce_scatter/bfloat16"], seen["reduce_scatter/float32"]
        numel, reductions = r["numel"], gas if stage >= 2 else 1
        assert bf >= reductions * numel["safe"], r
        assert f32 >= reductions * (numel["plain"] + numel["sub"]), r
        assert r["wire_bytes"] == 2 * bf + 4 * f32, r  # the ledger counts what was sent
        assert r["wire_bytes"] < 4 * (bf + f32), r


def _close(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.multirank
def test_training_matches_deepspeed_and_the_plain_torch_reference(reports, fixture_data):
    cases = {n: c for n, c in fixture_data["cases"].items() if "refused" not in c}
    assert len(cases) >= 12, sorted(fixture_data["cases"])
    for name, ds in cases.items():
        ours = reports[0][f"train/{name}"]
        ref = reports[0][f"reference/{name}"]
        assert ours == reports[1][f"train/{name}"], name  # both ranks hold the same model
        assert ours["param_dtypes"] == {n: d for n, d in ds["param_dtypes"].items()}, name
        bf16 = "bf16" in name
        rel = 2e-2 if bf16 else 1e-6
        for losses in (ds["losses"], ref["losses"]):
            for a, b in zip(ours["losses"], losses):
                assert abs(a - b) <= rel * abs(b), (name, ours["losses"], losses)
        scale = max(abs(v) for vals in ds["final"].values() for v in vals)
        tol = TOL_BF16 * scale if bf16 else TOL_FP32
        for n, vals in ds["final"].items():
            assert _close(ours["final"][n], vals) <= tol, (name, n, "DeepSpeed")
            assert _close(ours["final"][n], ref["final"][n]) <= tol, (name, n, "reference")
