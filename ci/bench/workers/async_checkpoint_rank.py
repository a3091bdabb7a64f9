"""One rank of ci/bench/async_checkpoint.py: how long a checkpoint save stops training, saved
synchronously and in the background, for zero-core or FSDP2 + PyTorch DCP.

    python -m torch.distributed.run --nproc-per-node 2 ci/bench/workers/async_checkpoint_rank.py \\
        --impl zc --stage 2 --dtype bf16 --dir /tmp/ck

Every measured interval starts and ends with a barrier, so it is the slowest rank's. After
the warm-up: ``--steps`` plain steps (the normal step time); one synchronous save (its time
is the stall it causes); then ``--saves`` asynchronous saves, each timed at the call (the
stall: the host snapshot, and for DCP its staging) and followed by steps until the save is
committed (zero-core: its metadata.json appears; DCP: the future is done), each step timed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "examples"))
import gpt  # noqa: E402

from zero_core.testing.ranks import report  # noqa: E402

MODELS = {"bench": gpt.GPTConfig.preset("bench"),
          # ~101M parameters: the offload rows (1.2 GB of fp32 master + Adam state)
          "large": gpt.GPTConfig(block_size=128, n_layer=8, n_head=16, n_embd=1024)}


class ZeroCore:
    def __init__(self, model, a):
        import zero_core
        zero = {"stage": a.stage}
        if a.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {"train_micro_batch_size_per_gpu": a.micro, "zero_optimization": zero,
                  "bf16": {"enabled": a.dtype == "bf16"},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        self.engine, *_ = zero_core.initialize(model=model, config=config)

    def step(self, idx):
        e = self.engine
        e.backward(gpt.lm_loss(e(idx[:, :-1]), idx[:, 1:]))
        e.step()

    def save(self, directory, tag, background):
        self.engine.save_checkpoint(directory, tag=tag, async_save=background)
        return os.path.join(directory, tag, "metadata.json")

    def committed(self, handle) -> bool:
        return os.path.exists(handle)

    def finish(self):
        self.engine.wait_for_checkpoint()
        self.engine.destroy()


class FSDP2:
    def __init__(self, model, a):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        dist.init_process_group("gloo")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if a.dtype == "bf16" else None,
                                  reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # DCP's background save runs collectives on its own thread: on a group of its own,
        # as the DCP docs advise, so they cannot interleave with training's
        self.group = dist.new_group(backend="gloo")

    def state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, opt_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": opt_sd}

    def save(self, directory, tag, background):
        import torch.distributed.checkpoint as dcp
        path = os.path.join(directory, tag)
        if not background:
            dcp.save(self.state(), checkpoint_id=path)
            return None
        return dcp.async_save(self.state(), checkpoint_id=path, process_group=self.group)

    def committed(self, handle) -> bool:
        return handle is None or handle.done()

    def finish(self):
        pass


def fsdp2_step(impl: FSDP2, idx):
    loss = gpt.lm_loss(impl.model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    impl.opt.step()
    impl.opt.zero_grad()


def timed(fn):
    dist.barrier()
    t = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=["zc", "fsdp2"], required=True)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--model", choices=sorted(MODELS) + ["small", "tiny"], default="bench")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--saves", type=int, default=2)
    ap.add_argument("--max-steps-per-save", type=int, default=40)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)   # two ranks on two cores
    torch.manual_seed(0)
    cfg = MODELS.get(a.model) or gpt.GPTConfig.preset(a.model)
    model = gpt.GPT(cfg)
    impl = FSDP2(model, a) if a.impl == "fsdp2" else ZeroCore(model, a)
    step = (lambda idx: fsdp2_step(impl, idx)) if a.impl == "fsdp2" else impl.step
    g = torch.Generator().manual_seed(1 + dist.get_rank())

    def batch():
        return torch.randint(0, cfg.vocab_size, (a.micro, cfg.block_size + 1), generator=g)

    for _ in range(a.warmup):
        step(batch())
    normal = [timed(lambda: step(batch()))[0] for _ in range(a.steps)]
    sync_s, _ = timed(lambda: impl.save(a.dir, "sync", False))
    saves = []
    for i in range(a.saves):
        call_s, handle = timed(lambda: impl.save(a.dir, f"async{i}", True))
        during, t0 = [], time.perf_counter()
        while len(during) < a.max_steps_per_save:
            during.append(timed(lambda: step(batch()))[0])
            done = torch.tensor([int(impl.committed(handle))])
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if int(done):
                break
        saves.append({"call_s": call_s, "during_steps_s": during,
                      "commit_s": call_s + time.perf_counter() - t0})
    impl.finish()
    report({"normal_step_s": statistics.median(normal), "sync_save_s": sync_s,
            "async": saves})
    # the result is out; leave without the interpreter's teardown, where gloo (with DCP's
    # extra group) sometimes aborts ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
