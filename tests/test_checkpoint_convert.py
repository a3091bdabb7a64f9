"""``zero-core convert``: any checkpoint -> one safetensors state dict that plain PyTorch
loads with ``model.load_state_dict(safetensors.torch.load_file(OUT))``.

Checkpoints come from real 2-rank jobs (tests/workers/ckpt_train.py): stage 3 in bf16
(fp32 master weights differ from the bf16 model, frozen parameters are bf16 partitions)
and stage 1 in fp32. Expected values are what the saving ranks reported for the fragments
they wrote, so the converter's reassembly is checked element by element, exactly.

Memory: while converting a 9.4M-parameter (36 MiB fp32, 108 MiB with Adam states)
checkpoint, the process's peak RSS may grow by less than a quarter of the model's fp32
size: the converter holds about one tensor (2.2 MiB here) at a time. The same measurement
around ``load_file`` of the output (which holds the whole model) is the control.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "ckpt_train.py")
BIG_LAYERS, BIG_WIDTH = 16, 768


def worker_module():
    spec = importlib.util.spec_from_file_location("ckpt_train_for_convert", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def convert_cli(*args):
    """Run ``zero-core convert`` in a child; returns (returncode, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "zero_core.cli", "convert", *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


# Runs in a child: everything imported first, then the kernel's peak-RSS mark (VmHWM) is
# reset through /proc/self/clear_refs, so the peak measures the conversion alone (after a
# warm-up conversion of the tiny checkpoint, which pays one-time costs). The same
# is measured around safetensors.torch.load_file of the output (which holds the whole
# model): a control showing that a whole-model allocation is visible to this measurement.
_MEASURE = r"""
import json, sys
import safetensors.torch
from zero_core.checkpoint.convert import convert

def status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

def peak_growth(fn):
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = status("VmRSS")
    result = fn()
    return status("VmHWM") - before, result

warm, src, out = sys.argv[1], sys.argv[2], sys.argv[3]
convert(warm, out, progress=False)  # first-use costs (code pages, allocator) are not per tensor
conv, _ = peak_growth(lambda: convert(src, out, progress=False))
ctrl, sd = peak_growth(lambda: [t.clone() for t in safetensors.torch.load_file(out).values()])
print(json.dumps({"convert": conv, "load_file": ctrl}))
"""


def conversion_memory(warm, src, out) -> dict:
    """Peak RSS growth (bytes) while converting *src* (after converting *warm* once), and
    while loading the result whole."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(warm), str(src), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("convert")
    results = run_ranks(WORKER, 2, "torchrun", args=[json.dumps(
        [["reshard_save", str(d / "s3bf16"), 3, "bf16"], ["reshard_save", str(d / "s1"), 1],
         ["save_big", str(d / "big"), BIG_LAYERS, BIG_WIDTH]])],
        env={"ZERO_CORE_COMM": "gloo"}, timeout=600)
    return d, [r.report for r in results]


def expected(savers: list, key_order=("master", "param")) -> dict:
    """name -> flat fp32 tensor assembled from every saving rank's fragments."""
    pieces: dict = {}
    for rep in savers:
        for name, start, end, keys in rep["fragments"]:
            key = next((k for k in key_order if k in keys), None)
            if key is None:
                continue  # e.g. no optimizer state for a frozen parameter
            pieces.setdefault(name, []).append((start, keys[key]))
    return {n: torch.tensor([v for _, vals in sorted(p) for v in vals]) for n, p in pieces.items()}


@pytest.mark.multirank
def test_convert_stage3_bf16_to_plain_state_dict(saved, tmp_path):
    d, reports = saved
    savers = [r[0] for r in reports]
    out = tmp_path / "model.safetensors"
    code, stdout, stderr = convert_cli(d / "s3bf16", out, "--optimizer-states")
    assert code == 0, stderr
    assert "convert [" in stderr and "100.0%" in stderr  # the progress bar
    assert "wrote" in stdout and str(out) in stdout
    w = worker_module()
    model = w.Net()
    state = load_file(str(out))
    assert list(state) == list(model.state_dict())  # own keys, tied 'head.weight' included
    model.load_state_dict(state)  # strict
    want = expected(savers)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p.detach().reshape(-1), want[name]), name
    assert model.head.weight is model.emb.weight
    assert torch.equal(state["head.weight"], state["emb.weight"])
    # bf16 training kept the buffer in bf16: its values round-trip exactly
    gain = w.make_model().gain.to(torch.bfloat16).float()
    assert torch.equal(model.gain, gain)
    # optimizer states, per parameter, full shape
    optim = tmp_path / "model.optim.safetensors"
    states = load_file(str(optim))
    adam = {k: expected(savers, (k,)) for k in ("exp_avg", "exp_avg_sq")}
    trained = [n for n, p in model.named_parameters() if p.requires_grad and n != "frozen.weight"
               and n != "frozen.bias"]
    assert sorted(states) == sorted(f"{k}/{n}" for k in adam for n in trained)
    for key, values in adam.items():
        for n in trained:
            assert torch.equal(states[f"{key}/{n}"].reshape(-1), values[n]), (key, n)
    with safe_open(str(optim), "pt") as f:
        info = json.loads(f.metadata()["optimizer"])
    assert info["kind"] == "adam" and info["global_steps"] == 10
    assert [g["step"] for g in info["param_groups"]] == [10, 10]
    assert sorted(info["param_groups"][1]["params"]) == sorted(
        ["l1.bias", "l2.bias", "ln.weight", "ln.bias"])


@pytest.mark.multirank
def test_convert_bf16_output_and_tag(saved, tmp_path):
    d, reports = saved
    out = tmp_path / "m16.safetensors"
    code, _, stderr = convert_cli(d / "s1", out, "--dtype", "bf16", "--tag", "step10")
    assert code == 0, stderr
    state = load_file(str(out))
    want = expected([r[1] for r in reports])
    for name, t in state.items():
        if name == "gain":
            assert t.dtype == torch.float32  # buffers keep their dtype
            continue
        src = "emb.weight" if name == "head.weight" else name
        assert t.dtype == torch.bfloat16 and torch.equal(t.reshape(-1), want[src].bfloat16()), name
    code, _, stderr = convert_cli(d / "s1", out, "--tag", "nope")
    assert code == 2 and "nope" in stderr


@pytest.mark.multirank
def test_convert_refuses_a_damaged_shard(saved, tmp_path):
    d, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(d / "s1", bad)
    shard = bad / "step10" / "rank_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = tmp_path / "x.safetensors"
    code, _, stderr = convert_cli(bad, out)
    assert code == 2 and "rank_00001.safetensors" in stderr and "SHA-256" in stderr
    assert not out.exists() and not (tmp_path / "x.safetensors.tmp").exists()


@pytest.mark.multirank
def test_convert_memory_is_about_one_tensor(saved, tmp_path):
    d, reports = saved
    big = reports[0][2]
    model_bytes = 4 * big["numel"]
    largest = 4 * BIG_WIDTH * BIG_WIDTH
    mem = conversion_memory(d / "s1", d / "big", tmp_path / "big.safetensors")
    print(f"convert peak RSS growth {mem['convert'] / 2**20:.1f} MiB for a "
          f"{model_bytes / 2**20:.1f} MiB model (largest tensor {largest / 2**20:.1f} MiB); "
          f"control: load_file of the result {mem['load_file'] / 2**20:.1f} MiB")
    assert mem["load_file"] > 0.9 * model_bytes  # the measurement sees a whole model
    assert mem["convert"] < model_bytes / 4, mem
    state = load_file(str(tmp_path / "big.safetensors"))
    assert len(state) == 2 * BIG_LAYERS
    for name, t in state.items():
        assert float(t.double().sum()) == pytest.approx(big["checksums"][name], rel=1e-9, abs=1e-9)


def test_a_damaged_deepspeed_checkpoint_is_refused_and_writes_nothing(tmp_path):
    # DeepSpeed's own checkpoints convert (tests/test_deepspeed_checkpoints.py); files that
    # only look like one are named, and no half-written output is left
    from zero_core.checkpoint.store import CheckpointError
    from zero_core.checkpoint.convert import convert
    tag = tmp_path / "global_step5"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step5")
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not read")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="DeepSpeed ZeRO checkpoint.*zero_to_fp32"):
        convert(str(tmp_path), str(tmp_path / "out.safetensors"))
    assert not (tmp_path / "out.safetensors").exists()
