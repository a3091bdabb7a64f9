"""One rank of ci/bench/offload.py: build examples/gpt.py at a given width/depth under
``zero_core.Init`` (stage 3), train a few steps, report memory, time and swap traffic.

Usage: ``python offload_gpt.py '<json settings>'``; settings: n_layer, n_embd, mode
("stage3" or "nvme"), nvme_dir, steps, seq, rss_limit (bytes of resident memory this
rank may use), data_limit (RLIMIT_DATA backstop against a runaway allocation),
min_available (bytes of MemAvailable below which every rank stops at once).
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples"))

import zero_core  # noqa: E402
from zero_core.backends.accelerators.cpu import peak_rss_bytes  # noqa: E402
from zero_core.testing.ranks import report  # noqa: E402
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402


def mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def watchdog(min_available: int, rss_limit: int):
    """Stop this rank when it exceeds its share of the memory budget, or before the
    machine runs out of memory (other work shares it)."""
    from zero_core.backends.accelerators.cpu import rss_bytes
    while True:
        if rss_bytes() > rss_limit:
            report({"ok": False, "why": f"out of memory budget: RSS > {rss_limit >> 20} MiB"})
            os._exit(3)
        if mem_available() < min_available:
            report({"ok": False, "why": f"watchdog: MemAvailable < {min_available >> 20} MiB"})
            os._exit(3)
        time.sleep(0.1)


def trim() -> None:
    """Give freed heap memory back to the system (glibc keeps large freed blocks), so that
    the resident set measures what is in use (both modes alike)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def checkpoint_blocks(model) -> None:
    """Activation checkpointing of every transformer block (both modes): without it,
    autograd keeps views of every gathered weight until backward (see stage3/gather.py),
    so each rank would hold the whole model during forward, offloaded or not."""
    from zero_core.checkpointing import checkpoint
    for block in model.blocks:
        block.forward = (lambda x, fwd=block.forward: checkpoint(fwd, x))


def config(s: dict) -> dict:
    zo = {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 30_000_000,
          "stage3_prefetch_bucket_size": 20_000_000}
    if s["mode"] == "nvme":
        zo["sub_group_size"] = s.get("sub_group_size", 4_000_000)
        zo["offload_optimizer"] = {"device": "nvme", "nvme_path": s["nvme_dir"], "buffer_count": 3}
        zo["offload_param"] = {"device": "nvme", "nvme_path": s["nvme_dir"], "buffer_count": 4,
                               "buffer_size": s.get("buffer_size", 12_000_000), "max_in_cpu": 0}
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zo,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}


def main():
    s = json.loads(sys.argv[1])
    limit = int(s["data_limit"])
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    threading.Thread(target=watchdog, args=(int(s["min_available"]), int(s["rss_limit"])),
                     daemon=True).start()
    t0 = time.perf_counter()
    cfg = config(s)
    try:
        gcfg = GPTConfig(block_size=s["seq"], n_layer=s["n_layer"], n_head=s["n_embd"] // 128,
                         n_embd=s["n_embd"])
        torch.manual_seed(0)
        with zero_core.Init(config=cfg):
            model = GPT(gcfg)
        checkpoint_blocks(model)
        engine, *_ = zero_core.initialize(model=model, config=cfg)
        trim()
        built = time.perf_counter() - t0
        g = torch.Generator().manual_seed(rank)
        steps, marks = [], []
        for i in range(s["steps"]):
            before = engine.memory_report().get("offload")
            t = time.perf_counter()
            idx = torch.randint(0, gcfg.vocab_size, (1, s["seq"] + 1), generator=g)
            loss = lm_loss(engine(idx[:, :-1]), idx[:, 1:])
            engine.backward(loss)
            engine.step()
            trim()
            steps.append(time.perf_counter() - t)
            marks.append((before, engine.memory_report().get("offload")))
        io = None
        if marks[-1][0] is not None:
            a, b = marks[-1]
            io = {"optimizer_read": b["bytes_read"] - a["bytes_read"],
                  "optimizer_written": b["bytes_written"] - a["bytes_written"],
                  "params_read": b["params"]["bytes_read"] - a["params"]["bytes_read"],
                  "params_written": b["params"]["bytes_written"] - a["params"]["bytes_written"],
                  "host_bytes": b["host_bytes"], "staging_bytes": b["params"]["staging_bytes"],
                  "disk_bytes": b["disk_bytes"] + b["params"]["disk_bytes"],
                  "direct_io": b["direct_io"]}
        report({"ok": True, "num_parameters": engine.num_parameters, "build_s": built,
                "step_s": steps, "loss": float(loss.detach()), "peak_rss": peak_rss_bytes(),
                "io_last_step": io})
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, MemoryError) or "alloc" in str(exc).lower() or "memory" in str(exc).lower():
            report({"ok": False, "why": f"out of memory: {type(exc).__name__}: {str(exc)[:200]}"})
            os._exit(4)
        raise
    zero_core.runtime.context.shutdown()


if __name__ == "__main__":
    main()
