"""Multi-rank worker for tests/test_deepspeed_checkpoints.py: resume zero-core engines from
the DeepSpeed checkpoints of tests/fixtures/deepspeed_checkpoints.

Usage: ``python ds_resume.py '<json list of tasks>'`` on every rank; each rank reports the
list of the tasks' results. The model, param groups and data are those of
ci/tools/make_deepspeed_fixtures.py (imported from there, so they cannot drift apart).

Actions:

* ``["resume", case, stage, kwargs]`` — a zero-core engine at *stage* with the fixture's
  DeepSpeed config (``train_batch_size`` 12 split over this world size) loads the
  fixture's checkpoint (``engine.load_checkpoint(dir, **kwargs)``), reports the counters,
  learning rate, client state and the master-weight fragments it now owns, trains the 3
  steps DeepSpeed continued with and reports this rank's losses and final fragments.
* ``["error", case, stage, variant]`` — try a load that must fail (variants: "shape" — the
  model's l2 has another shape, head no bias; "missing" — the model has a parameter the
  checkpoint lacks; "mp_rank_01", "pipeline", "moe", "universal", "missing_rank" — the
  checkpoint's files are changed so); report the message.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile

import torch

import zero_core
from zero_core.checkpoint.store import CheckpointError
from zero_core.testing.ranks import report

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "deepspeed_checkpoints")
_spec = importlib.util.spec_from_file_location(
    "make_deepspeed_fixtures", os.path.join(REPO, "ci", "tools", "make_deepspeed_fixtures.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def expected_info(case: str) -> dict:
    from safetensors import safe_open
    with safe_open(os.path.join(FIXTURES, case, "expected.safetensors"), "pt") as f:
        return json.loads(f.metadata()["expected"])


def build(case: str, stage: int, variant=None):
    info = expected_info(case)
    cfg = json.loads(json.dumps(info["config"]))
    cfg["zero_optimization"]["stage"] = stage
    model = fx.make_model()
    if variant == "shape":
        model.head = torch.nn.Linear(9, 5, bias=False)  # no head.bias: one parameter missing
        model.l2 = torch.nn.Linear(16, 7)  # a shape that differs from the checkpoint's
    elif variant == "missing":
        model.extra = torch.nn.Linear(3, 3)  # a parameter the checkpoint does not have
    groups = [{**g, "params": [p for p in g["params"] if p is not None]}
              for g in fx.param_groups(model)]
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg, model_parameters=groups)
    return engine, info


def weight_fragments(engine) -> list:
    """This rank's fragments of the fp32 master weights (frozen: the parameter)."""
    out = []
    for f in engine.checkpoint_subject().fragments("save"):
        key = "master" if "master" in f.tensors else "param"
        out.append([f.name, f.start, f.end, f.tensors[key].float().tolist()])
    return out


def train(engine, info, steps) -> list:
    rank, world = engine.global_rank, engine.world_size
    dtype = DTYPES[info["precision"]]
    losses = []
    for s in steps:
        x, y = fx.batch(s, rank, world)
        pred = engine(x.to(dtype))
        loss = torch.nn.functional.mse_loss(pred.float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def resume(case, stage, kwargs):
    engine, info = build(case, stage)
    path, client = engine.load_checkpoint(os.path.join(FIXTURES, case, "ckpt"), **kwargs)
    out = {"path": os.path.relpath(path, FIXTURES), "client": client,
           "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
           "micro_steps": engine.micro_steps, "lr": engine.get_lr(),
           "step_counts": list(getattr(engine.optimizer, "step_counts", [])),
           "loaded": weight_fragments(engine)}
    out["losses"] = train(engine, info, range(fx.SAVE_AT, fx.SAVE_AT + fx.CONTINUE))
    out["final"] = weight_fragments(engine)
    out["final_lr"] = engine.get_lr()
    engine.destroy()
    return out


def error(case, stage, variant):
    src = os.path.join(FIXTURES, case, "ckpt")
    work = tempfile.mkdtemp(prefix="ds_err_")
    try:
        if variant in ("shape", "missing"):
            load_dir = src
        else:
            load_dir = os.path.join(work, "ckpt")
            shutil.copytree(src, load_dir)
            tag_dir = os.path.join(load_dir, "global_step3")
            names = sorted(os.listdir(tag_dir))
            if variant == "mp_rank_01":  # a tensor-parallel checkpoint
                for n in names:
                    shutil.copy(os.path.join(tag_dir, n),
                                os.path.join(tag_dir, n.replace("mp_rank_00", "mp_rank_01")))
            elif variant == "pipeline":
                shutil.copy(os.path.join(tag_dir, names[0]),
                            os.path.join(tag_dir, "layer_01-model_states.pt"))
            elif variant == "moe":
                shutil.copy(os.path.join(tag_dir, names[0]),
                            os.path.join(tag_dir, "expp_rank_0_mp_rank_00_optim_states.pt"))
            elif variant == "universal":
                os.makedirs(os.path.join(tag_dir, "zero", "l1.weight"))
            elif variant == "missing_rank":
                os.remove(os.path.join(tag_dir, [n for n in names if "zero_pp_rank_1" in n
                                                 and "optim" in n][0]))
            else:
                raise ValueError(variant)
        engine, _ = build(case, stage, variant)
        try:
            engine.load_checkpoint(load_dir)
        except CheckpointError as exc:
            return {"error": str(exc)}
        finally:
            engine.destroy()
        return {"error": None}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    tasks = json.loads(sys.argv[1])
    actions = {"resume": resume, "error": error}
    report([actions[t[0]](*t[1:]) for t in tasks])


if __name__ == "__main__":
    main()
