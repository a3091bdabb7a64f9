"""DeepSpeed ZeRO checkpoints load, resume and convert — without DeepSpeed.

The fixtures (tests/fixtures/deepspeed_checkpoints, README there) were written by DeepSpeed
0.19.8 itself (ci/tools/make_deepspeed_fixtures.py, 2 ranks, stages 0-3 x fp32/bf16; fp16 is
refused by DeepSpeed on the CPU that made them), with DeepSpeed's own continuation and
zero_to_fp32 output recorded next to each checkpoint.

Checked:

1. the restricted unpickler: every global the fixtures reference is allow-listed; a planted
   pickle that would run ``os.system`` (or names a DeepSpeed class not on the list) is
   refused by name and its side effect never happens;
2. resume (tests/workers/ds_resume.py, real ranks): the master weights zero-core loads are
   bit-for-bit DeepSpeed's (``saved/``), counters, learning rate, step counts and client
   state are DeepSpeed's, and 3 more steps land on DeepSpeed's continuation (``final/``):
   max |p - p_ds| / max |p_ds| <= RTOL = 1e-5 in fp32 at any world size and stage, and in
   bf16 at the saving world size (2). bf16 at another world size: RTOL_BF16_RESHARD = 5e-4
   — the ranks reduce bf16 gradients of other row splits, each rounded to 8 significant
   bits (2^-9 relative), which Adam's normalized update carries into the weights at up to
   about lr x 2^-9 per step (measured 7e-5 to 1.2e-4). A missing or misplaced state is
   orders of magnitude away: without the optimizer states the same continuation is 3.3e-2
   off (negative control);
3. convert: ``zero-core convert <dir> out.safetensors`` equals DeepSpeed's zero_to_fp32
   output key by key; it also keeps the frozen parameters zero_to_fp32 drops at stage 1,
   and casts bf16 frozen parameters to the output dtype, as DeepSpeed's
   ``convert_zero_checkpoint_to_state_dict(dtype=...)`` does; it reads each file once;
4. unsupported layouts (tensor/pipeline parallelism, MoE, universal, missing ranks) and a
   different model are refused with the reason, naming the parameters.

The measured differences are printed (``pytest -s``).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import types
import weakref

import pytest
import torch

from zero_core.checkpoint.store import CheckpointError
from zero_core.testing.ranks import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "deepspeed_checkpoints")
WORKER = os.path.join(HERE, "workers", "ds_resume.py")
CASES = sorted(d for d in os.listdir(FIXTURES)
               if os.path.exists(os.path.join(FIXTURES, d, "expected.safetensors")))
RTOL = 1e-5
ALIASES = {"unmix.weight": "mix.weight"}  # the fixture model's tied weight
RTOL_BF16_RESHARD = 5e-4
NO_STATES_AT_LEAST = 1e-3


def expected(case: str) -> tuple[dict, dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file
    path = os.path.join(FIXTURES, case, "expected.safetensors")
    with safe_open(path, "pt") as f:
        info = json.loads(f.metadata()["expected"])
    return load_file(path), info


def ckpt(case: str) -> str:
    return os.path.join(FIXTURES, case, "ckpt")


# ---- the fixtures and the restricted unpickler ---------------------------------------------------
def test_every_stage_and_precision_is_a_fixture_or_refused_by_deepspeed():
    with open(os.path.join(FIXTURES, "refused.json")) as fh:
        refused = json.load(fh)
    for stage in range(4):
        for precision in ("fp32", "bf16", "fp16"):
            name = f"stage{stage}_{precision}"
            assert (name in CASES) != (name in refused), name
    assert {c for c in CASES if c.endswith("fp32") or c.endswith("bf16")} == set(CASES)
    assert len(CASES) == 8
    assert all("not supported on your device" in why for why in refused.values())


def test_the_fixtures_reference_only_allow_listed_globals():
    from zero_core.checkpoint.deepspeed_pickle import (ALLOWED_GLOBALS, DEEPSPEED_STAND_INS,
                                                       _pickle_bytes, pickle_globals)
    seen = set()
    for case in CASES:
        for root, _, files in os.walk(ckpt(case)):
            for f in files:
                if f.endswith(".pt"):
                    for data in _pickle_bytes(os.path.join(root, f)):
                        seen.update(pickle_globals(data))
    assert seen <= ALLOWED_GLOBALS | set(DEEPSPEED_STAND_INS)
    assert {n for n in seen if n.startswith("deepspeed.")} == {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address"}


def test_stand_ins_carry_the_saved_attributes():
    from zero_core.checkpoint.deepspeed_pickle import (FragmentAddress, StaticLossScalerState,
                                                       ZeroStage, load_deepspeed_file)
    path = os.path.join(ckpt("stage2_fp32"), "global_step3",
                        "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    osd = load_deepspeed_file(path)["optimizer_state_dict"]
    assert isinstance(osd["loss_scaler"], StaticLossScalerState)
    assert osd["loss_scaler"].cur_scale == 1.0 and osd["loss_scaler"].dynamic is False
    assert osd["zero_stage"] is ZeroStage.gradients
    addr = osd["param_slice_mappings"][0]["l2.weight"]
    assert isinstance(addr, FragmentAddress) and (addr.numel, addr.start) == (100, 0)


class _Planted:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_planted_pickle_is_refused_by_name_and_never_runs(tmp_path):
    from zero_core.checkpoint.convert import convert
    from zero_core.checkpoint.deepspeed_pickle import load_deepspeed_file
    marker = tmp_path / "pwned"
    planted = tmp_path / "evil.pt"
    torch.save({"module": {}, "x": _Planted(f"touch {marker}")}, planted)
    with pytest.raises(CheckpointError, match=rf"references {os.system.__module__}\.system"):
        load_deepspeed_file(str(planted))
    assert not marker.exists()
    # inside a DeepSpeed checkpoint: load and convert refuse it the same way
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt("stage2_fp32"), d)
    shutil.copy(planted, d / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1.*references .*\.system"):
        convert(str(d), str(tmp_path / "out.safetensors"), progress=False)
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def _fake_deepspeed_class(monkeypatch, module: str, name: str):
    """A class pickled under DeepSpeed's *module*.*name* (a stand-in module in sys.modules)."""
    cls = type(name, (), {"__module__": module})
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    setattr(sys.modules[module], name, cls)
    return cls


def test_deepspeed_classes_off_the_list_are_refused(tmp_path, monkeypatch):
    from zero_core.checkpoint.deepspeed_pickle import load_deepspeed_file
    engine_cls = _fake_deepspeed_class(monkeypatch, "deepspeed.runtime.engine", "DeepSpeedEngine")
    path = tmp_path / "engine.pt"
    torch.save({"engine": engine_cls()}, path)
    with pytest.raises(CheckpointError, match=r"deepspeed\.runtime\.engine\.DeepSpeedEngine"):
        load_deepspeed_file(str(path))
    # a protocol-4 pickle names its globals on the stack (STACK_GLOBAL): found all the same
    raw = tmp_path / "p4.pt"
    torch.save({"x": _Planted("true")}, raw, pickle_protocol=4)
    with pytest.raises(CheckpointError, match=r"\.system"):
        load_deepspeed_file(str(raw))


def test_the_dynamic_loss_scaler_of_fp16_checkpoints_loads(tmp_path, monkeypatch):
    # DeepSpeed refuses fp16 on this CPU, so no fixture holds one: a pickle made under the
    # class's name, with the attributes DeepSpeed's DynamicLossScaler has
    from zero_core.checkpoint.deepspeed_pickle import DynamicLossScalerState, load_deepspeed_file
    cls = _fake_deepspeed_class(monkeypatch, "deepspeed.runtime.fp16.loss_scaler",
                                "DynamicLossScaler")
    s = cls()
    s.__dict__.update(cur_scale=256.0, cur_iter=7, last_overflow_iter=2, scale_factor=2.0,
                      scale_window=1000, min_scale=1.0, delayed_shift=2, cur_hysteresis=1,
                      consecutive_hysteresis=False, raise_error_at_min_scale=True,
                      dynamic=True, dtype=torch.float16)
    path = tmp_path / "scaler.pt"
    torch.save({"loss_scaler": s}, path)
    monkeypatch.undo()  # DeepSpeed is gone again when zero-core reads it
    got = load_deepspeed_file(str(path))["loss_scaler"]
    assert isinstance(got, DynamicLossScalerState)
    assert (got.cur_scale, got.cur_iter, got.cur_hysteresis, got.dtype) == (256.0, 7, 1,
                                                                             torch.float16)


# ---- convert -------------------------------------------------------------------------------------
def _first_tensor(obj):
    if torch.is_tensor(obj) and obj.numel():
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
    for v in items:
        t = _first_tensor(v)
        if t is not None:
            return t
    return None


@pytest.mark.parametrize("case", CASES)
def test_convert_gives_what_zero_to_fp32_gives(tmp_path, monkeypatch, case):
    from safetensors.torch import load_file
    from zero_core.checkpoint import deepspeed_layout
    from zero_core.checkpoint.convert import convert
    tensors, info = expected(case)
    reads, held = [], []
    real = deepspeed_layout.load_deepspeed_file

    def reader(path):
        # one rank file at a time: the previous one's tensors are gone when the next is read
        assert all(w() is None for w in held), (reads, os.path.basename(path))
        reads.append(os.path.basename(path))
        obj = real(path)
        if path.endswith("_optim_states.pt") or len(reads) > 1:
            held.append(weakref.ref(_first_tensor(obj)))
        return obj
    monkeypatch.setattr(deepspeed_layout, "load_deepspeed_file", reader)
    summary = convert(ckpt(case), str(tmp_path / "out.safetensors"), progress=False)
    assert len(reads) == len(set(reads)), reads  # each DeepSpeed file read once
    assert info["stage"] == 0 or len(held) == len(reads) - 1
    got = load_file(str(tmp_path / "out.safetensors"))
    assert summary["stage"] == info["stage"] and summary["tensors"] == len(got)
    z2f = {k[len("zero_to_fp32/"):]: v for k, v in tensors.items() if k.startswith("zero_to_fp32/")}
    if info["stage"] == 0:  # zero_to_fp32 cannot read stage 0; the module's weights as saved
        assert "zero_to_fp32_error" in info and not z2f
        for name, t in got.items():
            if name != "gain":
                ref = tensors[f"saved/{ALIASES.get(name, name)}"]
                assert torch.equal(t, ref.to(torch.bfloat16).float()
                                   if info["precision"] == "bf16" else ref), name
        return
    for key, ref in z2f.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], ref.float()), key
    assert set(got) - set(z2f) <= ({"frozen.weight"} if info["stage"] == 1 else set())
    assert torch.equal(got["frozen.weight"], tensors["saved/frozen.weight"])
    assert torch.equal(got["unmix.weight"], got["mix.weight"])


def test_convert_through_the_cli_and_in_bf16(tmp_path):
    from safetensors.torch import load_file
    from zero_core.cli import main
    tensors, _ = expected("stage3_bf16")
    out = tmp_path / "m.safetensors"
    assert main(["convert", ckpt("stage3_bf16"), str(out), "--dtype", "bf16"]) == 0
    got = load_file(str(out))
    for key in ("l1.weight", "head.bias"):
        assert got[key].dtype == torch.bfloat16
        assert torch.equal(got[key], tensors[f"zero_to_fp32/{key}"].to(torch.bfloat16))


# ---- unsupported layouts (no engine needed) -----------------------------------------------------
@pytest.mark.parametrize("variant,message", [
    ("mp_rank_01", "tensor \\(model\\) parallelism.*not supported"),
    ("pipeline", "pipeline engine.*not supported"),
    ("moe", "mixture-of-experts.*not supported"),
    ("universal", "universal checkpoint.*not supported"),
    ("missing_rank", "saved by 2 ranks but holds 1 optimizer-states files \\(missing: "
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt\\)"),
])
def test_unsupported_layouts_are_refused_with_the_reason(tmp_path, variant, message):
    from zero_core.checkpoint.convert import convert
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt("stage3_fp32"), d)
    tag = d / "global_step3"
    names = sorted(os.listdir(tag))
    if variant == "mp_rank_01":
        for n in names:
            shutil.copy(tag / n, tag / n.replace("mp_rank_00", "mp_rank_01"))
    elif variant == "pipeline":
        shutil.copy(tag / names[0], tag / "layer_01-model_states.pt")
    elif variant == "moe":
        shutil.copy(tag / names[0], tag / "expp_rank_0_mp_rank_00_optim_states.pt")
    elif variant == "universal":
        (tag / "zero" / "l1.weight").mkdir(parents=True)
    else:
        (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=message):
        convert(str(d), str(tmp_path / "out.safetensors"), progress=False)


# ---- resume on real ranks ---------------------------------------------------------------------------
def launch(tasks, nprocs):
    results = run_ranks(WORKER, nprocs, "torchrun", args=[json.dumps(tasks)],
                        env={"ZERO_CORE_COMM": "gloo", "ZERO_CORE_COMM_TIMEOUT": "120"},
                        timeout=600)
    assert all(r.report is not None for r in results), "a rank did not report"
    return [r.report for r in results]


def _merge(reports: list, key: str, shapes: dict) -> dict:
    """Full flat tensors from every rank's fragments; each element covered."""
    out = {n: torch.full((k,), float("nan")) for n, k in shapes.items()}
    for rep in reports:
        for name, start, end, values in rep[key]:
            out[name][start:end] = torch.tensor(values, dtype=torch.float32)
    for name, t in out.items():
        assert not torch.isnan(t).any(), (key, name)
    return out


def check_resume(case, stage, reports, kwargs=None) -> float:
    """Compare one resumed case, from every rank's report, with DeepSpeed's; return the
    relative difference of the final weights."""
    kwargs = kwargs or {}
    tensors, info = expected(case)
    label = f"{case} -> stage {stage} on {len(reports)} rank(s) {kwargs or ''}"
    shapes = {k[len("saved/"):]: v.numel() for k, v in tensors.items() if k.startswith("saved/")}
    r0 = reports[0]
    assert r0["path"] == os.path.join(case, "ckpt", "global_step3"), label
    assert r0["client"] == {"epoch": 1, "sampler": {"position": 36, "seed": 1234},
                            "note": "fixture"}, label
    loaded = _merge(reports, "loaded", shapes)
    for name in shapes:  # the master weights are DeepSpeed's, bit for bit
        assert torch.equal(loaded[name], tensors[f"saved/{name}"].reshape(-1)), (label, name)
    final = _merge(reports, "final", shapes)
    num = max(float((final[n] - tensors[f"final/{n}"].reshape(-1)).abs().max()) for n in shapes)
    den = max(float(tensors[f"final/{n}"].abs().max()) for n in shapes)
    rel = num / den
    if kwargs.get("load_module_only"):
        assert r0["global_steps"] == 0 and r0["step_counts"] == [0, 0], label
        assert rel > NO_STATES_AT_LEAST, (label, rel)
        print(f"{label}: weights only, continuation differs by {rel:.1e} (expected)")
        return rel
    ds_steps = 4 if case == "stage0_bf16" else 3  # FP16_Optimizer's extra step at build
    assert r0["global_steps"] == 3 and r0["skipped_steps"] == 0, label
    assert r0["micro_steps"] == 3 and r0["lr"] == info["lrs"][2], label
    assert r0["final_lr"] == info["lrs"][5], label
    if kwargs.get("load_optimizer_states") is False:
        assert r0["step_counts"] == [0, 0], label
        assert rel > NO_STATES_AT_LEAST, (label, rel)  # the negative control
        print(f"{label}: no optimizer states, continuation differs by {rel:.1e} (expected)")
        return rel
    assert r0["step_counts"] == [ds_steps, ds_steps], label
    losses = [sum(r["losses"][k] for r in reports) / len(reports) for k in range(3)]
    tol = RTOL_BF16_RESHARD if info["precision"] == "bf16" and len(reports) != 2 else RTOL
    assert losses == pytest.approx(info["losses"][3:], rel=max(tol, 1e-6)), label
    assert rel <= tol, (label, rel)
    print(f"{label}: final weights vs DeepSpeed's continuation {rel:.2e} (tolerance {tol:g})")
    return rel


SAME = [[case, int(case[5])] for case in CASES]
OTHER_1 = [["stage3_fp32", 1, {}], ["stage2_bf16", 3, {}], ["stage0_fp32", 2, {}],
           ["stage1_fp32", 0, {"load_optimizer_states": False}],
           ["stage3_bf16", 2, {"load_module_only": True}]]
OTHER_3 = [["stage1_fp32", 3, {}], ["stage0_bf16", 1, {}]]


@pytest.mark.multirank
def test_each_fixture_resumes_on_two_ranks_at_its_stage():
    errors = [["error", "stage2_fp32", 2, "shape"], ["error", "stage3_fp32", 3, "missing"],
              ["error", "stage1_bf16", 1, "mp_rank_01"]]
    reps = launch([["resume", c, s, {}] for c, s in SAME] + errors, 2)
    for i, (case, stage) in enumerate(SAME):
        check_resume(case, stage, [r[i] for r in reps])
    shape, missing, mp = (reps[0][len(SAME) + k]["error"] for k in range(3))
    assert "parameter 'l2.weight' has shape [9, 16] in the checkpoint but [7, 16]" in shape
    assert "'head.bias'" in shape and "'extra.weight', 'extra.bias'" in missing
    assert "tensor (model) parallelism" in mp and "not supported" in mp
    for k in range(3):  # every rank raised the same error (each in its own copy)
        mine, theirs = (r[len(SAME) + k]["error"].split("global_step3")[-1] for r in reps)
        assert mine == theirs


@pytest.mark.multirank
@pytest.mark.parametrize("nprocs,tasks", [(1, OTHER_1), (3, OTHER_3)], ids=["1rank", "3ranks"])
def test_fixtures_resume_on_other_world_sizes_and_stages(nprocs, tasks):
    reps = launch([["resume", *t] for t in tasks], nprocs)
    for i, (case, stage, kwargs) in enumerate(tasks):
        check_resume(case, stage, [r[i] for r in reps], kwargs)
