"""Single-process fault scenarios for tests/test_offload_faults.py.

Usage: ``python offload_faults.py <scenario> <nvme_path>``. Prints one JSON line
``RESULT {...}`` (what happened) unless the scenario ends the process on purpose.

Scenarios: ``train`` (no fault: 2 steps), ``full`` (the disk fills while the swap files
are written), ``fsize`` (a file-size limit, RLIMIT_FSIZE, is hit), ``missing`` /
``not_dir`` / ``unwritable`` (bad nvme_path; the test mounts a read-only file system
for the last, since root ignores directory permissions), ``truncate`` / ``corrupt`` (a swap file is
shortened / overwritten between steps), ``param_truncate`` (a parameter swap file is
shortened), ``raise`` (an exception ends the script), ``sigterm`` / ``sigkill`` (the
process is signalled after creating its swap directory).
"""
from __future__ import annotations

import glob
import json
import os
import resource
import signal
import sys

import torch

import zero_core
from zero_core.offload import OffloadError, cleanup


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def build(path, stage=2, param=False, width=256):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8))
    zo = {"stage": stage, "reduce_bucket_size": 20000, "sub_group_size": 8192,
          "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 3}}
    if param:
        zo["offload_param"] = {"device": "nvme", "nvme_path": path, "buffer_size": 70000,
                               "max_in_cpu": 0}
        zo["stage3_param_persistence_threshold"] = 10
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zo,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = zero_core.initialize(model=model, config=cfg)
    return engine


def step(engine, width=256):
    x = torch.randn(2, width)
    engine.backward(engine(x).square().mean())
    engine.step()


def swap_files(pattern):
    return sorted(f for d in cleanup.registered() for f in glob.glob(os.path.join(d, pattern)))


def main():
    scenario, path = sys.argv[1], sys.argv[2]
    if scenario == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    try:
        if scenario in ("truncate", "corrupt", "param_truncate"):
            param = scenario == "param_truncate"
            engine = build(path, stage=3 if param else 2, param=param)
            step(engine)
            victim = swap_files("params*.swap" if param else "optimizer*exp_avg_sq.swap")[0]
            if scenario == "corrupt":
                with open(victim, "r+b") as fh:
                    # sub-group 6: beyond the read-ahead of the next step (3 slots)
                    fh.seek(4096 + 8192 * 4 * 6 + 100)
                    fh.write(b"\x7f" * 64)
            else:
                os.truncate(victim, 4096 + 1000)
            step(engine)
            result(error=None)
            return
        engine = build(path)
        dirs = cleanup.registered()
        if scenario == "raise":
            print("DIRS " + json.dumps(dirs), flush=True)
            raise RuntimeError("the training script failed")
        if scenario in ("sigterm", "sigkill"):
            print("DIRS " + json.dumps(dirs), flush=True)
            os.kill(os.getpid(), signal.SIGTERM if scenario == "sigterm" else signal.SIGKILL)
        step(engine)
        step(engine)
        result(error=None, dirs=dirs, offload=engine.memory_report()["offload"])
    except OffloadError as exc:
        result(error=str(exc), type=type(exc).__name__, dirs=cleanup.registered())


if __name__ == "__main__":
    main()
