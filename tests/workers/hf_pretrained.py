"""Multi-rank worker for tests/test_hf_pretrained.py: HF checkpoints into stage-3 partitions
and back out.

Usage: ``python hf_pretrained.py <checkpoint root> <output root>`` on every rank. The root
holds checkpoints written by transformers' own ``save_pretrained`` (made by the test):
``fp32_single``, ``fp32_sharded``, ``bf16_sharded``. In one launch, each rank:

1. loads each checkpoint with zero-core's ``from_pretrained`` at stage 3 (and the bf16 one
   also into an fp32 model), gathers the weights and compares them with transformers' own
   ``from_pretrained`` of the same directory (done in this process, tiny model); reports the
   load report and what this rank holds of each parameter;
2. trains two fp32 runs and one bf16 run of two steps on the engine, then
   ``save_pretrained`` (sharded) from the stage-3 engine; rank 0 loads the output with
   transformers and compares it with the engine's gathered parameters, and re-saves that
   model with transformers' save_pretrained to compare the index (names, file of each
   tensor, sizes) and file list.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

import zero_core
from zero_core.integrations.transformers import from_pretrained, save_pretrained
from zero_core.stage3 import partitioned_params as pp
from zero_core.testing.ranks import leave_rank, report

SHARD = "60KB"


def zc_config(precision: str = "fp32") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 20000, "stage3_prefetch_bucket_size": 20000},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "comm_backend": "gloo"}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def gathered_state(model) -> dict:
    with zero_core.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare(a: dict, b: dict) -> dict:
    same_keys = sorted(a) == sorted(b)
    bad = [k for k in b if k not in a or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    return {"same_keys": same_keys, "unequal": bad[:5], "n": len(b),
            "dtypes": sorted({str(v.dtype) for v in a.values()})}


def load_case(root: str, name: str, dtype=None) -> tuple[dict, object]:
    from transformers import AutoModelForCausalLM
    path = os.path.join(root, name)
    kw = {"dtype": dtype} if dtype is not None else {}
    t = time.perf_counter()
    model = from_pretrained(path, config=zc_config(), **kw)
    t_zc = time.perf_counter() - t
    rank = torch.distributed.get_rank()
    holds = {n: [pp.is_partitioned(p),
                 pp.meta_of(p).own_part.numel() if pp.is_partitioned(p) else -1,
                 p.data.numel(), p.numel()] for n, p in model.named_parameters()}
    t = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(path, **kw)
    t_hf = time.perf_counter() - t
    out = compare(gathered_state(model), ref.state_dict())
    out["seconds"] = [t_zc, t_hf]
    largest = max(p.numel() * p.element_size() for p in ref.parameters())
    out.update(rank=rank, load=model.zero_core_load_report, holds=holds, largest_bytes=largest,
               tied=model.lm_head.weight is model.transformer.wte.weight)
    return out, model


def train_and_save(model, precision: str, out_dir: str, seed: int) -> dict:
    from transformers import AutoModelForCausalLM
    before = gathered_state(model)
    engine, *_ = zero_core.initialize(model=model, config=zc_config(precision))
    rank = engine.global_rank
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(2):
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    trained = engine.module_state_dict()
    paths = save_pretrained(engine, out_dir, max_shard_size=SHARD)
    res = {"paths": sorted(os.path.basename(p) for p in paths),
           "exist": all(os.path.exists(p) for p in paths),
           "changed": max(float((trained[k].float() - before[k].float()).abs().max())
                          for k in before)}
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(out_dir)
        res["reload"] = compare(trained, reloaded.state_dict())
        again = out_dir + "_hf"
        reloaded.save_pretrained(again, max_shard_size=SHARD)
        with open(os.path.join(out_dir, "model.safetensors.index.json")) as fh:
            ours = json.load(fh)
        with open(os.path.join(again, "model.safetensors.index.json")) as fh:
            theirs = json.load(fh)
        res["index_equal"] = ours == theirs
        res["weight_map_names"] = sorted(ours["weight_map"])
        res["hf_weight_map_names"] = sorted(theirs["weight_map"])
        res["files"] = sorted(os.listdir(out_dir))
        res["hf_files"] = sorted(os.listdir(again))
        res["leftover_tmp"] = [f for f in os.listdir(out_dir) if f.startswith(".")]
    engine.destroy()
    return res


def main():
    t0 = time.perf_counter()
    root, out_root = sys.argv[1], sys.argv[2]
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    out = {"seconds": {"import": time.perf_counter() - t0}}
    out["fp32_single"], fp32_model = load_case(root, "fp32_single")
    out["fp32_sharded"], _ = load_case(root, "fp32_sharded")
    out["bf16_sharded"], bf16_model = load_case(root, "bf16_sharded")
    out["bf16_as_fp32"], _ = load_case(root, "bf16_sharded", torch.float32)
    out["seconds"]["loads"] = time.perf_counter() - t0
    out["train_fp32"] = train_and_save(fp32_model, "fp32", os.path.join(out_root, "fp32"), 1)
    out["train_bf16"] = train_and_save(bf16_model, "bf16", os.path.join(out_root, "bf16"), 2)
    out["seconds"]["total"] = time.perf_counter() - t0
    report(out)
    leave_rank()


if __name__ == "__main__":
    main()
