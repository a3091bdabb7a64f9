"""One rank of ci/bench/infinity.py (launched by it): ZeRO-Infinity on this machine.

Builds examples/gpt.py at ``layers`` x ``width`` in bf16 (the model is created in bf16
inside the contender's Init, so no rank ever holds it in fp32), with parameters and
optimizer states (fp32 master, Adam's two moments) in swap files under ``nvme_dir``,
activation checkpointing per block, and trains ``steps`` AdamW steps of ``micro``
sequences of ``seq`` random tokens per rank.

Contenders (``contender`` in the JSON settings):

  zero_core  zero_core.Init + stage 3, offload_param and offload_optimizer on nvme
  deepspeed  deepspeed.zero.Init(remote_device="nvme", dtype=bf16) + ZeRO-3 with the same
             offload keys (its async_io op, JIT-built, needs libaio-dev), DeepSpeedCPUAdam

Per step it reports the wall time of forward, backward and optimizer step, and for
zero-core the disk traffic from the stores' counters: bytes read and written, the seconds
the kernel spent in those reads and writes (worker threads, overlapping compute), and the
seconds the training thread waited for the disk (stalls); for both contenders the bytes
the process moved to and from the block device (/proc/self/io). Peak resident memory is
VmHWM. A watchdog stops the rank before the machine runs out of memory.

Usage: ``python infinity_rank.py '<json settings>'``.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples"))

from offload_gpt import checkpoint_blocks, trim, watchdog  # noqa: E402
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402

from zero_core.backends.accelerators.cpu import peak_rss_bytes, rss_bytes  # noqa: E402
from zero_core.testing.ranks import report  # noqa: E402

ADAMW = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def unit_numel(width: int) -> int:
    """One transformer block's weights: the fetch unit, prefetch and reduce bucket."""
    return 12 * width * width + 13 * width


def ds_style_config(s: dict) -> dict:
    """The config both contenders get (zero-core reads DeepSpeed's keys)."""
    block = unit_numel(s["width"])
    part = -(-block // s["world_size"]) + 4096   # one unit's partition, padded
    zo = {"stage": 3, "stage3_prefetch_bucket_size": block, "reduce_bucket_size": block,
          "stage3_max_live_parameters": 2 * block, "stage3_max_reuse_distance": block,
          "stage3_param_persistence_threshold": 100_000, "sub_group_size": s["sub_group_size"],
          "offload_optimizer": {"device": "nvme", "nvme_path": s["nvme_dir"],
                                "buffer_count": s["buffer_count"], "pin_memory": False},
          "offload_param": {"device": "nvme", "nvme_path": s["nvme_dir"], "buffer_count": 4,
                            "buffer_size": part, "max_in_cpu": 0, "pin_memory": False}}
    return {"train_micro_batch_size_per_gpu": s["micro"], "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "zero_optimization": zo, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": dict(ADAMW)}}


def model_config(s: dict) -> GPTConfig:
    return GPTConfig(block_size=s["seq"], n_layer=s["layers"], n_head=s["width"] // 128,
                     n_embd=s["width"])


def build_zero_core(s: dict):
    import zero_core
    cfg = ds_style_config(s)
    cfg["comm_backend"] = "gloo"
    torch.set_default_dtype(torch.bfloat16)   # created in bf16: no fp32 copy ever
    try:
        with zero_core.Init(config=cfg):
            model = GPT(model_config(s))
    finally:
        torch.set_default_dtype(torch.float32)
    checkpoint_blocks(model)
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    return engine, engine.num_parameters


#: DeepSpeed's parameter swapper takes one staging buffer per parameter *tensor* in flight
#: (zero-core's, one per fetch unit): a block has 12 tensors, and prefetch (one block) plus
#: the live window (two) keep up to three blocks in flight; 40 buffers of the largest
#: tensor's partition (the MLP's 4·w² weight). With 4 it stops in the first forward
#: ("Not enough buffers 0 for swapping 1", measured).
DS_PARAM_BUFFERS = 40


def deepspeed_param_buffers(s: dict) -> dict:
    largest = -(-4 * s["width"] * s["width"] // s["world_size"]) + 4096
    return {"buffer_count": DS_PARAM_BUFFERS, "buffer_size": largest}


def build_deepspeed(s: dict):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = ds_style_config(s)
    cfg["zero_optimization"]["offload_param"].update(deepspeed_param_buffers(s))
    # DeepSpeed's nvme prefetch swaps in every not-yet-available parameter of the coming
    # trace window and fails on one listed twice ("param N already assigned swap buffer
    # id", measured): the tied embedding, and with checkpointing every block (recompute,
    # then backward). No prefetch bucket keeps its window to one parameter.
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1,
                  "single_submit": False, "overlap_events": True}
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme",
                             dtype=torch.bfloat16):
        model = GPT(model_config(s))
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    for block in model.blocks:   # DeepSpeed's own activation checkpointing
        block.forward = (lambda x, fwd=block.forward:
                         deepspeed.checkpointing.checkpoint(fwd, x))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    return engine, numel


def io_counters(engine) -> dict | None:
    """zero-core's swap counters (both stores, this rank), or None for DeepSpeed."""
    rep = getattr(engine, "memory_report", None)
    if rep is None:
        return None
    off = rep().get("offload")
    if not off or "params" not in off:
        return None
    p = off["params"]
    return {"opt_read": off["bytes_read"], "opt_written": off["bytes_written"],
            "param_read": p["bytes_read"], "param_written": p["bytes_written"],
            "read_s": off["read_s"] + p["read_s"], "write_s": off["write_s"] + p["write_s"],
            "wait_s": off["wait_s"] + p["wait_s"]}


def proc_io() -> dict:
    """This process's bytes that reached the block layer (/proc/self/io, all threads):
    the disk traffic of either contender, measured outside it."""
    with open("/proc/self/io") as fh:
        fields = dict(line.split(": ") for line in fh.read().splitlines())
    return {"read": int(fields["read_bytes"]), "written": int(fields["write_bytes"])}


def delta(after: dict | None, before: dict | None) -> dict | None:
    if after is None or before is None:
        return None
    return {k: after[k] - before[k] for k in after}


def main():
    s = json.loads(sys.argv[1])
    rank = int(os.environ.get("RANK", "0"))
    s["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
    threading.Thread(target=watchdog, args=(int(s["min_available"]), int(s["rss_limit"])),
                     daemon=True).start()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    engine, num_params = {"zero_core": build_zero_core,
                          "deepspeed": build_deepspeed}[s["contender"]](s)
    trim()
    build_s = time.perf_counter() - t0
    rss_built = rss_bytes()
    gen = torch.Generator().manual_seed(100 + rank)
    steps = []
    for _ in range(s["steps"]):
        idx = torch.randint(0, 256, (s["micro"], s["seq"] + 1), generator=gen)
        before, proc_before = io_counters(engine), proc_io()
        t = time.perf_counter()
        loss = lm_loss(engine(idx[:, :-1]), idx[:, 1:])
        t_fwd = time.perf_counter()
        engine.backward(loss)
        t_bwd = time.perf_counter()
        engine.step()
        t_end = time.perf_counter()
        trim()
        steps.append({"forward_s": t_fwd - t, "backward_s": t_bwd - t_fwd,
                      "step_s": t_end - t_bwd, "wall_s": t_end - t,
                      "loss": float(loss.detach().float()),
                      "io": delta(io_counters(engine), before),
                      "proc_io": delta(proc_io(), proc_before)})
        print(f"rank {rank}: step {len(steps)} {t_end - t:.1f} s, loss {steps[-1]['loss']:.4f}",
              flush=True)
    out = {"ok": True, "contender": s["contender"], "num_parameters": int(num_params),
           "config": ds_style_config(s),
           "build_s": build_s, "rss_after_build": rss_built, "peak_rss": peak_rss_bytes(),
           "steps": steps}
    if s["contender"] == "zero_core":
        off = engine.memory_report()["offload"]
        out["disk_bytes"] = off["disk_bytes"] + off["params"]["disk_bytes"]
        out["host_bytes"] = off["host_bytes"] + off["params"]["staging_bytes"]
    report(out)
    if s["contender"] == "zero_core":
        import zero_core
        zero_core.runtime.context.shutdown()


if __name__ == "__main__":
    main()
