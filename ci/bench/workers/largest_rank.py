"""One rank of one attempt of ci/bench/largest.py (launched by it, never by hand).

Builds a GPT of ``--layers`` x ``--width`` (examples/gpt.py's family: head size 64, context
128, byte vocabulary, tied embeddings) the way each contender builds a model too large for
one rank, trains ``--steps`` steps in fp32 with AdamW (micro batch ``--micro`` sequences of
``--seq`` tokens, random bytes), and reports what it cost:

  ddp        the whole model on every rank; DistributedDataParallel with
             gradient_as_bucket_view=True (gradients live in the buckets: no second copy),
             torch AdamW — the leanest plain DDP
  fsdp2      built on the meta device, fully_shard per block then the root, materialized
             shard by shard (to_empty) and initialized there, torch AdamW
  deepspeed  built inside deepspeed.zero.Init, ZeRO-3, torch AdamW as client optimizer
  zero_core  built inside zero_core.Init, stage 3, its AdamW

DeepSpeed and zero-core get the same stage-3 limits, sized to the model: prefetch, reuse
distance and gradient reduction bucket one block's parameters (12 width^2), live window two
blocks (FSDP2 frees a block's parameters after its forward, which is what these limits ask
of the other two).

The rank raises its own ``oom_score_adj`` to the maximum first, so that if the machine
itself runs out of memory the kernel kills a benchmark rank rather than anyone else's work.
A MemoryError (or an allocator failure) is reported as ``status: oom`` with exit status 3.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import contender as cw  # noqa: E402  (the stage 0-2 worker: AdamW settings, step adapters)
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402  (examples/ is on the path via contender)

from zero_core.runtime.launch import discover  # noqa: E402
from zero_core.testing.ranks import report  # noqa: E402

OOM_EXIT = 3
HEAD_DIM = 64


def model_config(layers: int, width: int) -> GPTConfig:
    """A member of the family: depth *layers*, width *width* (a multiple of 64)."""
    return GPTConfig(block_size=128, n_layer=layers, n_head=max(1, width // HEAD_DIM),
                     n_embd=width)


def stage3_limits(width: int) -> dict:
    """Stage-3 keys (elements) given to DeepSpeed and zero-core alike. The gradient bucket
    too: DeepSpeed's default (5e8 elements) is a 2 GB fp32 buffer per rank."""
    block = 12 * width * width
    return {"stage3_prefetch_bucket_size": block, "stage3_max_reuse_distance": block,
            "stage3_max_live_parameters": 2 * block, "reduce_bucket_size": block,
            "stage3_param_persistence_threshold": 100_000}


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def build_ddp(cfg, a, launch):
    from torch.nn.parallel import DistributedDataParallel as DDP
    cw.init_gloo(launch)
    model = GPT(cfg)
    ddp = DDP(model, gradient_as_bucket_view=True)
    return cw.TorchStep(ddp, cw.torch_adamw(ddp.parameters())), model.num_parameters()


def build_fsdp2(cfg, a, launch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    cw.init_gloo(launch)
    mesh = init_device_mesh("cpu", (launch.world_size,))
    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # allocate only this rank's shards, then initialize them as GPT.__init__ would have
    model.to_empty(device="cpu")
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.reset_parameters()
    model.apply(model._init_weights)
    # DTensor parameters report their global size
    return cw.TorchStep(model, cw.torch_adamw(model.parameters())), model.num_parameters()


def build_deepspeed(cfg, a, launch):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, **stage3_limits(cfg.n_embd)},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "steps_per_print": 10**9}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = GPT(cfg)
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=cw.torch_adamw(model.parameters()),
                                      config=config)
    return cw.EngineStep(engine), numel


def build_zero_core(cfg, a, launch):
    import zero_core
    config = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW",
                            "params": {**cw.ADAMW, "betas": list(cw.ADAMW["betas"])}},
              "zero_optimization": {"stage": 3, **stage3_limits(cfg.n_embd)},
              "comm_backend": a.comm}
    with zero_core.Init(config=config):
        model = GPT(cfg)
    engine, *_ = zero_core.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return cw.EngineStep(engine), engine.memory_report()["num_parameters"]


BUILDERS = {"ddp": build_ddp, "fsdp2": build_fsdp2, "deepspeed": build_deepspeed,
            "zero_core": build_zero_core}


def is_allocation_failure(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text
                                             or "out of memory" in text)


def train(a, launch) -> dict:
    cfg = model_config(a.layers, a.width)
    torch.manual_seed(0)  # every rank builds the same initial weights
    t0 = time.perf_counter()
    step, num_params = BUILDERS[a.contender](cfg, a, launch)
    build_s = time.perf_counter() - t0
    rss_after_build, peak_after_build = rss_bytes(), peak_rss_bytes()
    gen = torch.Generator().manual_seed(1000 + launch.rank)
    wall, cpu, losses = [], [], []
    # where the peak is reached: the process's peak RSS after each phase of each step
    phase_peaks = {"forward": [], "backward": [], "update": []}
    for _ in range(a.steps):
        tokens = torch.randint(0, cfg.vocab_size, (a.micro, a.seq + 1), generator=gen)
        t, c = time.perf_counter(), time.process_time()
        loss = step.forward(tokens[:, :-1], tokens[:, 1:])
        phase_peaks["forward"].append(peak_rss_bytes())
        step.backward(loss)
        phase_peaks["backward"].append(peak_rss_bytes())
        step.update()
        phase_peaks["update"].append(peak_rss_bytes())
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        losses.append(loss.item())
    extra = {}
    if a.contender == "zero_core":
        extra["memory_report"] = step.engine.memory_report()
    return {**extra, "status": "ok", "num_parameters": int(num_params), "build_s": build_s,
            "step_s": wall, "cpu_step_s": cpu, "losses": losses,
            "rss_after_build_bytes": rss_after_build, "peak_rss_after_build_bytes": peak_after_build,
            "peak_rss_after_phase_bytes": phase_peaks,
            "peak_rss_bytes": peak_rss_bytes()}


def teardown(contender: str) -> None:
    if contender == "zero_core":
        from zero_core.runtime.context import shutdown
        shutdown()
    elif dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("contender", choices=sorted(BUILDERS))
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro", type=int, default=1, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (<= 128)")
    p.add_argument("--comm", default="gloo", help="zero-core's communicator")
    a = p.parse_args()
    try:
        # the kernel's OOM killer, should it ever run, picks this rank first
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("1000")
    except OSError:
        pass
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    launch = discover()
    base = {"rank": launch.rank, "world_size": launch.world_size, "contender": a.contender,
            "layers": a.layers, "width": a.width, "torch": torch.__version__}
    try:
        out = train(a, launch)
    except BaseException as exc:  # noqa: BLE001 - an allocation failure is a result here
        if not is_allocation_failure(exc):
            raise
        report({**base, "status": "oom", "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                "peak_rss_bytes": peak_rss_bytes()})
        sys.stdout.flush()
        # the other ranks may be blocked in a collective with this one: leave at once
        os._exit(OOM_EXIT)
    report({**base, **out})
    teardown(a.contender)


if __name__ == "__main__":
    main()
