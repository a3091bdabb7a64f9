"""The GPU kit's checkpoint checks: a checkpoint saved on the device, loaded back there by a
fresh engine and, in another process (``check.py --ckpt-load``), by an engine on the cpu
accelerator; weights and every checkpoint fragment compared bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

from check_support import (HERE, Ctx, clean_env, gpt_module, import_torch, learnable_batches,
                           release_memory, runtime, same_bits, tail)
from engine_cases import EngineCase, Sizes, build_engine, engine_weights, sizes, train_engine


def fragments(engine) -> dict:
    """The engine's checkpoint fragments (every state of every owned slice) as CPU tensors,
    keyed ``name[start:end]/state``."""
    out = {}
    for f in engine.checkpoint_subject().fragments("save"):
        for key, t in f.tensors.items():
            out[f"{f.name}[{f.start}:{f.end}]/{key}"] = t.detach().cpu().clone()
    return out


def run_checkpoint_case(ctx: Ctx, case: EngineCase) -> dict:
    """Train on the device, save a checkpoint, load it back into a fresh engine on the
    device, then in a separate process build the same model with the *cpu* accelerator and
    gloo and load it there; both loads are compared bit for bit with what was saved: the
    model's weights (compute dtype) and every checkpoint fragment (fp32 master weights and
    Adam states). The CPU side then evaluates the next batch; its loss must agree with the
    device's within 2e-2 relative (different hardware)."""
    torch = import_torch()
    rt = runtime(ctx)
    sz = sizes(ctx)
    work = tempfile.mkdtemp(prefix=f"ckpt_{case.name}_", dir=ctx.scratch)
    gpt = gpt_module()
    vocab = gpt.GPTConfig.preset(sz.preset).vocab_size
    batches = learnable_batches(sz.steps * sz.gas + 1, sz.micro, sz.seq, vocab, ctx.seed + 1)
    engine, _, cfg = build_engine(ctx, case, sz, os.path.join(work, "nvme_gpu"), ctx.seed)
    try:
        train_engine(engine, batches[:-1], rt.device)  # losses and norms not needed
        t0 = time.perf_counter()
        ckpt_dir = engine.save_checkpoint(os.path.join(work, "ckpt"))
        save_s = time.perf_counter() - t0
        expected = {"weights": engine_weights(engine), "fragments": fragments(engine),
                    "global_steps": engine.global_steps}
        x, y = batches[-1]
        engine.module.eval()
        with torch.no_grad():
            next_loss = float(gpt.lm_loss(engine(x.to(rt.device)), y.to(rt.device)))
    finally:
        engine.destroy()
    torch.save(expected, os.path.join(work, "expected.pt"))
    # the same checkpoint loaded back on the device by a fresh engine (other initial values)
    reload_failures, reload_numbers = [], {}
    try:
        again, _, _ = build_engine(ctx, case, sz, os.path.join(work, "nvme_gpu2"), ctx.seed + 3)
        try:
            again.load_checkpoint(os.path.join(work, "ckpt"))
            got_w, got_f = engine_weights(again), fragments(again)
        finally:
            again.destroy()
        w_bad = [n for n, t in expected["weights"].items()
                 if n not in got_w or not same_bits(got_w[n], t)[0]]
        f_bad = [k for k, t in expected["fragments"].items()
                 if k not in got_f or not same_bits(got_f[k], t)[0]]
        reload_numbers = {"device_reload_weights_differing": len(w_bad),
                          "device_reload_fragments_differing": len(f_bad)}
        if w_bad or f_bad:
            reload_failures.append(f"reloaded on {ctx.device}: {len(w_bad)} weight(s) and "
                                   f"{len(f_bad)} fragment(s) differ: {(w_bad + f_bad)[:4]}")
    except Exception as exc:  # noqa: BLE001 - recorded; the CPU side still runs
        reload_failures.append(f"loading it back on {ctx.device} failed: "
                               f"{type(exc).__name__}: {str(exc)[:400]}")
        reload_numbers = {"device_reload_traceback": tail(traceback.format_exc(), 8)}
    release_memory(ctx)
    spec = {"case": case.__dict__, "sizes": sz.__dict__, "seed": ctx.seed, "work": work,
            "quick": ctx.quick, "next_loss": next_loss, "batch_seed": ctx.seed + 1}
    with open(os.path.join(work, "spec.json"), "w") as fh:
        json.dump(spec, fh)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "check.py"), "--ckpt-load",
                           os.path.join(work, "spec.json")],
                          env=clean_env(), capture_output=True, text=True, timeout=240,
                          cwd=ctx.scratch)
    result_path = os.path.join(work, "loaded.json")
    if not os.path.exists(result_path):
        return {"failures": [f"the cpu loader wrote no result (exit {proc.returncode}): "
                             f"{tail(proc.stdout + proc.stderr, 12)}"]}
    with open(result_path) as fh:
        loaded = json.load(fh)
    numbers = {"checkpoint": os.path.basename(str(ckpt_dir)), "save_seconds": round(save_s, 3),
               **reload_numbers, **loaded.get("numbers", {})}
    return {"numbers": numbers, "failures": reload_failures + loaded.get("failures", []),
            "detail": loaded.get("detail", "") + (
                f"; reloaded on {ctx.device}: " + ("FAILED" if reload_failures else "bit-equal"))}


def checkpoint_load_main(spec_path: str) -> int:
    """The CPU side of run_checkpoint_case (``check.py --ckpt-load SPEC``)."""
    torch = import_torch()
    with open(spec_path) as fh:
        spec = json.load(fh)
    work = spec["work"]
    out_path = os.path.join(work, "loaded.json")
    try:
        ctx = Ctx("cpu", spec["quick"], work, spec["seed"])
        case = EngineCase(**spec["case"])
        sz = Sizes(**spec["sizes"])
        engine, _, _ = build_engine(ctx, case, sz, os.path.join(work, "nvme_cpu"), spec["seed"] + 7,
                              accelerator="cpu", comm="gloo")
        path, _ = engine.load_checkpoint(os.path.join(work, "ckpt"))
        expected = torch.load(os.path.join(work, "expected.pt"), weights_only=True)
        got_w, got_f = engine_weights(engine), fragments(engine)
        failures = []
        w_bad = [n for n, t in expected["weights"].items()
                 if n not in got_w or not same_bits(got_w[n], t)[0]]
        f_missing = sorted(set(expected["fragments"]) ^ set(got_f))
        f_bad = [k for k, t in expected["fragments"].items()
                 if k in got_f and not same_bits(got_f[k], t)[0]]
        if w_bad:
            failures.append(f"{len(w_bad)} weight(s) differ after loading on the CPU: {w_bad[:4]}")
        if f_missing:
            failures.append(f"fragments present on one side only: {f_missing[:4]}")
        if f_bad:
            failures.append(f"{len(f_bad)} checkpoint fragment(s) differ: {f_bad[:4]}")
        if engine.global_steps != expected["global_steps"]:
            failures.append(f"global_steps {engine.global_steps} after loading, saved "
                            f"{expected['global_steps']}")
        gpt = gpt_module()
        vocab = gpt.GPTConfig.preset(sz.preset).vocab_size
        x, y = learnable_batches(sz.steps * sz.gas + 1, sz.micro, sz.seq, vocab,
                                 spec["batch_seed"])[-1]
        engine.module.eval()
        with torch.no_grad():
            cpu_loss = float(gpt.lm_loss(engine(x), y))
        engine.destroy()
        diff = abs(cpu_loss - spec["next_loss"]) / abs(spec["next_loss"])
        if diff > 2e-2:
            failures.append(f"next-batch loss on the CPU {cpu_loss:.5f} vs on the device "
                            f"{spec['next_loss']:.5f} ({diff:.3g} relative, bound 2e-2)")
        numbers = {"weights_compared": len(expected["weights"]),
                   "fragments_compared": len(expected["fragments"]),
                   "weights_differing": len(w_bad), "fragments_differing": len(f_bad),
                   "device_next_loss": spec["next_loss"], "cpu_next_loss": cpu_loss,
                   "next_loss_rel_diff": diff}
        result = {"numbers": numbers, "failures": failures,
                  "detail": f"{len(expected['weights'])} weights + {len(expected['fragments'])} "
                            f"fragments bit-equal on the CPU: {not (w_bad or f_bad)}; "
                            f"next loss diff {diff:.2e}"}
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result = {"failures": [f"{type(exc).__name__}: {exc}"],
                  "numbers": {"traceback": tail(traceback.format_exc(), 12)}}
    with open(out_path, "w") as fh:
        json.dump(result, fh)
    return 0
