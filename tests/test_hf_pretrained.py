"""Hugging Face pretrained weights: ``from_pretrained`` straight into stage-3 partitions and
``save_pretrained`` writing HF's sharded safetensors layout
(zero_core/integrations/transformers/pretrained.py, pretrained_load.py, hf_safetensors.py).

The references are transformers' own ``from_pretrained`` / ``save_pretrained`` on the same
tiny GPT-2 (built here, random weights, no download): loaded values must be equal exactly
(same dtype, same bits), and the files written must have HF's names, file assignment and
index.

The memory bound of the 2-rank test, ``peak < full / 2 + largest``: each rank's loader holds
its partitions of every parameter (full / 2; the sizes here are multiples of
2 × alignment, so there is no padding), plus, until the weights are tied, its half of the
untied lm_head (half the embedding), plus a staging chunk of at most its slice of one
tensor when the dtype is converted (half the largest tensor). Both extras together stay
under the largest tensor (the embedding is smaller than the largest MLP matrix here),
while a rank that read any whole model would hold ``full`` > ``full / 2 + largest``
(``full`` is more than 6x ``largest``): the bound fails if loading is not partitioned.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.testing.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "hf_pretrained.py")
SHARD = "60KB"   # the worker's max_shard_size too: several shards for this model
CASES = {"fp32_single": "torch.float32", "fp32_sharded": "torch.float32",
         "bf16_sharded": "torch.bfloat16", "bf16_as_fp32": "torch.float32"}

transformers = pytest.importorskip("transformers")


def tiny_gpt2(seed: int = 1):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=96, n_positions=32,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """transformers' own save_pretrained of one tiny GPT-2: single file and sharded, fp32
    and bf16."""
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("hf_ckpt")
    model = tiny_gpt2()
    model.save_pretrained(root / "fp32_single")
    model.save_pretrained(root / "fp32_sharded", max_shard_size=SHARD)
    model.to(torch.bfloat16).save_pretrained(root / "bf16_sharded", max_shard_size="30KB")
    return root


def zc(stage: int = 3) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.fixture
def runtime_down():
    """In-process stage-3 loads start a one-rank runtime: leave none behind."""
    yield
    from zero_core.runtime.context import shutdown
    shutdown()


# ---- two ranks, one launch ---------------------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.slow
def test_two_ranks_load_train_save(checkpoints, tmp_path):
    results = run_ranks(WORKER, 2, "torchrun", args=[str(checkpoints), str(tmp_path)],
                        timeout=300)
    reports = [r.report for r in results]
    assert all(rep is not None for rep in reports), "a rank did not report"
    for rank, rep in enumerate(reports):
        for case, dtype in CASES.items():
            res = rep[case]
            # equal to transformers' own from_pretrained of the same directory, bit for bit
            assert res["same_keys"] and res["unequal"] == [], (case, res["unequal"])
            assert res["dtypes"] == [dtype], case
            assert res["tied"], case
            load = res["load"]
            assert load["rank"] == rank and load["world_size"] == 2
            assert load["tensors"] == 28 and load["missing_keys"] == load["unexpected_keys"] == []
            # every parameter is partitioned: this rank holds half of it and no full copy
            for name, (partitioned, own, data, numel) in res["holds"].items():
                assert partitioned and data == 0 and own * 2 == numel, (case, name)
            full, part, peak = load["full_model_bytes"], load["partition_bytes"], load["peak_bytes"]
            assert part * 2 == full
            assert part <= peak < full / 2 + res["largest_bytes"], (case, peak, full)
            assert full > 6 * res["largest_bytes"]   # the bound above can fail
        for run in ("train_fp32", "train_bf16"):
            res = rep[run]
            assert res["exist"] and res["changed"] > 1e-3, run   # the steps moved the weights
            assert res["paths"] == reports[0][run]["paths"]
    for run, dtype in (("train_fp32", "torch.float32"), ("train_bf16", "torch.bfloat16")):
        res = reports[0][run]
        # transformers reads what save_pretrained wrote: the engine's trained values, exactly
        assert res["reload"]["same_keys"] and res["reload"]["unequal"] == [], run
        assert res["reload"]["dtypes"] == [dtype]
        # and writes the same layout for that model: names, file of each tensor, sizes
        assert res["index_equal"], run
        assert res["weight_map_names"] == res["hf_weight_map_names"]
        assert "lm_head.weight" not in res["weight_map_names"]   # tied: written once, as HF
        assert res["files"] == res["hf_files"] == res["paths"]
        assert sum(f.startswith("model-") for f in res["files"]) > 1
        assert res["leftover_tmp"] == []


# ---- save_pretrained, one process --------------------------------------------------------------
def _digest(directory) -> dict:
    return {f: hashlib.sha256(open(os.path.join(directory, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(directory)) if os.path.isfile(os.path.join(directory, f))}


def _tensors(path) -> tuple[list, dict, dict]:
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        return sorted(f.keys()), f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("max_shard_size", ["5GB", SHARD, 30_000])
def test_save_pretrained_writes_hf_layout(tmp_path, max_shard_size):
    from zero_core.integrations.transformers import save_pretrained
    model = tiny_gpt2(seed=3)
    model.save_pretrained(tmp_path / "hf", max_shard_size=max_shard_size)
    paths = save_pretrained(model, tmp_path / "zc", max_shard_size=max_shard_size)
    hf_files, zc_files = sorted(os.listdir(tmp_path / "hf")), sorted(os.listdir(tmp_path / "zc"))
    assert zc_files == hf_files and sorted(os.path.basename(p) for p in paths) == zc_files
    single = max_shard_size == "5GB"
    assert ("model.safetensors" in zc_files) == single
    assert ("model.safetensors.index.json" in zc_files) != single
    if not single:   # the index byte for byte: names, files, total size, total parameters
        assert (open(tmp_path / "zc" / "model.safetensors.index.json").read()
                == open(tmp_path / "hf" / "model.safetensors.index.json").read())
    for f in zc_files:
        if f.endswith(".safetensors"):
            names, meta, values = _tensors(tmp_path / "zc" / f)
            ref_names, ref_meta, ref_values = _tensors(tmp_path / "hf" / f)
            assert names == ref_names and meta == ref_meta == {"format": "pt"}
            assert all(torch.equal(values[k], ref_values[k]) for k in names)
        else:
            assert json.load(open(tmp_path / "zc" / f)) == json.load(open(tmp_path / "hf" / f))


def test_save_pretrained_stage3_engine_one_rank(tmp_path, runtime_down):
    """The fetch-unit path of an engine in this process (one rank), into a directory that
    held another layout: transformers loads the engine's values, stale files are gone."""
    import zero_core
    from zero_core.integrations.transformers import save_pretrained
    model = tiny_gpt2(seed=4)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine, *_ = zero_core.initialize(model=model, config=zc(3))
    save_pretrained(engine, tmp_path, max_shard_size=SHARD)
    assert "model.safetensors.index.json" in os.listdir(tmp_path)
    save_pretrained(engine, tmp_path)   # now one file: the shards and the index must go
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json",
                                            "model.safetensors"]
    assert not any(u.state.value != "released" for u in engine.parts.units if not u.persistent)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert sorted(reloaded) == sorted(expected)
    assert all(torch.equal(reloaded[k], expected[k]) for k in expected)
    # engine.module instead of the engine: its units' own gatherer, the same bytes
    save_pretrained(engine.module, tmp_path / "module")
    assert (_digest(tmp_path / "module")["model.safetensors"]
            == _digest(tmp_path)["model.safetensors"])
    engine.destroy()


def test_save_pretrained_failure_leaves_previous_files(tmp_path, monkeypatch):
    from zero_core.integrations.transformers import pretrained, save_pretrained
    model = tiny_gpt2(seed=5)
    save_pretrained(model, tmp_path, max_shard_size=SHARD)
    before = _digest(tmp_path)
    real, calls = pretrained.write_safetensors, []

    def failing(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)
    monkeypatch.setattr(pretrained, "write_safetensors", failing)
    with torch.no_grad():
        model.transformer.wpe.weight.add_(1.0)   # what a finished save would change
    with pytest.raises(ZeroCoreError, match=r"disk full \(ENOSPC\) — No space left on device"):
        save_pretrained(model, tmp_path, max_shard_size="40KB")
    assert _digest(tmp_path) == before   # nothing replaced, no temporary left
    assert all(os.path.dirname(p) != str(tmp_path) for p in calls)   # written under a temp dir

    def broken(path, *args, **kwargs):  # not the file system's: still caught and named
        raise RuntimeError("a tensor could not be read")
    monkeypatch.setattr(pretrained, "write_safetensors", broken)
    with pytest.raises(ZeroCoreError, match="RuntimeError: a tensor could not be read"):
        save_pretrained(model, tmp_path, max_shard_size="40KB")
    assert _digest(tmp_path) == before


def test_save_pretrained_arguments():
    from zero_core.integrations.transformers import save_pretrained
    from zero_core.integrations.transformers.hf_safetensors import parse_shard_size
    assert parse_shard_size("500MB") == 500 * 10 ** 6
    assert parse_shard_size(" 1.5GB ") == 1_500_000_000
    assert parse_shard_size("5gb") == 5 * 10 ** 9 and parse_shard_size(1234) == 1234
    for bad in ("5", "5 GiB", "GB", "-1MB", 0, True, 1.5):
        with pytest.raises(ConfigError, match="max_shard_size"):
            parse_shard_size(bad)
    with pytest.raises(ConfigError, match="safetensors"):
        save_pretrained(tiny_gpt2(), "/nonexistent", safe_serialization=False)
    with pytest.raises(ConfigError, match="engine"):
        save_pretrained(object(), "/nonexistent")
    with pytest.raises(ConfigError, match="no transformers config"):
        save_pretrained(torch.nn.Linear(2, 2), "/nonexistent")


# ---- from_pretrained, one process --------------------------------------------------------------
def _gathered(model) -> dict:
    import zero_core
    with zero_core.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_from_pretrained_missing_unexpected_and_symmetric_tie(checkpoints, tmp_path, runtime_down):
    """A checkpoint without one bias, with an extra tensor, and holding the tied weight
    only under lm_head.weight: values equal to transformers' load of it (the bias
    initialized by the model's _init_weights, the embedding tied to the lm_head's
    values), and the keys reported as transformers reports them."""
    from safetensors.torch import load_file, save_file
    from zero_core.integrations.transformers import from_pretrained
    src = checkpoints / "fp32_single"
    state = load_file(src / "model.safetensors")
    state["lm_head.weight"] = state.pop("transformer.wte.weight") * 0.5
    del state["transformer.h.1.mlp.c_fc.bias"]
    state["extra.weight"] = torch.ones(3)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", tmp_path / "config.json")
    model = from_pretrained(tmp_path, config=zc(3))
    report = model.zero_core_load_report
    assert report["missing_keys"] == ["transformer.h.1.mlp.c_fc.bias"]
    assert report["unexpected_keys"] == ["extra.weight"]
    assert model.lm_head.weight is model.transformer.wte.weight
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    got = _gathered(model)
    assert sorted(got) == sorted(ref)
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []
    assert torch.equal(got["transformer.wte.weight"], state["lm_head.weight"])


def test_from_pretrained_below_stage3_loads_with_transformers(checkpoints):
    from zero_core.integrations.transformers import from_pretrained
    model = from_pretrained(checkpoints / "bf16_sharded", config=zc(2), dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoints / "bf16_sharded",
                                                            dtype=torch.float32).state_dict()
    got = model.state_dict()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], ref[k]) for k in ref)
    assert model.zero_core_load_report["stage"] == 2


def test_from_pretrained_errors(checkpoints, tmp_path, runtime_down):
    from zero_core.integrations.transformers import from_pretrained
    from zero_core.integrations.transformers.hf_safetensors import PretrainedError
    # no weights at all
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    shutil.copy(checkpoints / "fp32_single" / "config.json", only_config)
    with pytest.raises(PretrainedError, match="neither model.safetensors nor"):
        from_pretrained(only_config, config=zc(3))
    # an index naming a shard that is not there
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints / "fp32_sharded", broken)
    os.remove(broken / "model-00003-of-00009.safetensors")
    with pytest.raises(PretrainedError, match="model-00003-of-00009.safetensors, which is missing"):
        from_pretrained(broken, config=zc(3))
    # a config that does not describe the checkpoint
    wrong = tmp_path / "wrong"
    shutil.copytree(checkpoints / "fp32_single", wrong)
    cfg = json.load(open(wrong / "config.json"))
    cfg["vocab_size"] = 100
    json.dump(cfg, open(wrong / "config.json", "w"))
    shapes = r"transformer\.wte\.weight: checkpoint \[96, 64\], model \[100, 64\]"
    with pytest.raises(PretrainedError, match=shapes):
        from_pretrained(wrong, config=zc(3))
    # not a directory; no zero-core config; a class without a path
    with pytest.raises(PretrainedError, match="not a local directory"):
        from_pretrained(tmp_path / "absent", config=zc(3))
    with pytest.raises(ConfigError, match="zero-core config"):
        from_pretrained(checkpoints / "fp32_single")
    with pytest.raises(ConfigError, match="pretrained_model_name_or_path"):
        from_pretrained(transformers.GPT2LMHeadModel, config=zc(3))
    with pytest.raises(ConfigError, match="floating torch.dtype"):
        from_pretrained(checkpoints / "fp32_single", config=zc(3), dtype="int8")
