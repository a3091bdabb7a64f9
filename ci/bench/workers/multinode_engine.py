"""One rank of the multi-node comparison on the emulated two-node cluster: zero-core's
node-aware ZeRO-3, MiCS and ZeRO++ against FSDP2 hybrid sharding and DeepSpeed.

    python ci/bench/cluster.py --worker ci/bench/workers/multinode_engine.py \\
        --variants zero3,zero3-nodeaware,mics,mics-zeropp,zeropp,fsdp2-hsdp,\\
deepspeed-3,deepspeed-mics --worker-args "--model bench --micro 2" \\
        --json docs/images/multinode.json

Same model (examples/gpt.py, seed 1234), text (examples/text_data.py), batches, bf16,
AdamW (lr ``--lr``, weight decay 0, default betas/eps) and stage-3 settings (reuse distance,
persistence threshold, live window) as ci/bench/workers/zeropp_engine.py, whose config and
DeepSpeed helpers this worker imports. R = ranks per node (``ZERO_CORE_RANKS_PER_NODE``).

zero-core variants (all stage 3):
``zero3``            ``node_aware_collectives: false``: the flat collectives over all ranks.
``zero3-nodeaware``  ``node_aware_collectives: true``: partition all-gathers go across nodes
                     among same-local-rank peers first, then inside the node; reduce-scatters
                     inside the node first, then across nodes.
``mics``             ``mics_shard_size: R``: model states sharded inside each node,
                     replicated across nodes (``--mics-hierarchical`` adds
                     ``mics_hierarchical_params_gather: true``).
``mics-zeropp``      ``mics`` + qwZ (``zero_quantized_weights: true``).
``zeropp``           ZeRO++ as zeropp_engine's ``stage3-zeropp``: qwZ + hpZ (R) + qgZ.
The last three leave ``node_aware_collectives`` at its default (true).

Peers (each reports the bytes that crossed the link, no zero-core ledger):
``fsdp2-hsdp``       PyTorch FSDP2 hybrid sharding: ``fully_shard`` on every transformer block
                     then the root, over the 2-D gloo mesh (nodes, R) named
                     ("replicate", "shard"): sharded inside the node, replicated across.
                     torch.optim.AdamW on the fp32 sharded parameters (the master copy).
                     Precision: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``,
                     the closest to zero-core's bf16 (bf16 compute weights gathered in bf16,
                     gradients reduced in bf16, which is zero-core's default
                     ``communication_data_type`` under bf16; fp32 master and AdamW states);
                     ``--fsdp-reduce-dtype fp32`` reduces in fp32 instead.
                     ``reshard_after_forward`` is FSDP2's default (True): backward gathers
                     again, as zero-core and DeepSpeed do at reuse distance 0.
``deepspeed-3``      DeepSpeed ZeRO-3, as in zeropp_engine (DS_ACCELERATOR=cpu, gloo, torch's
                     AdamW).
``deepspeed-mics``   DeepSpeed with ``mics_shard_size: R``, the model built under
                     ``deepspeed.zero.MiCS_Init``. DeepSpeed 0.19.8 (the benchmark environment's)
                     no longer has MiCS: the ranks then report ``{"error": ...}`` with
                     DeepSpeed's own words, and ci/bench/cluster.py shows the row as
                     "did not run: <reason>".
A peer that raises here (in setup or in training) reports ``{"error": ...}`` the same way,
saying where; a zero-core variant that raises fails the run (a bug, not a peer's limit).

Reports, in the protocol of ci/bench/cluster.py: ``step_times_s`` (timed steps, each started
after a barrier), ``ledger`` (zero-core only), ``link_tx_bytes`` on local rank 0,
``phase_times_s``, and ``peak_rss_mb`` (this rank's peak resident set, MB of 1e6 bytes, over
the whole run: model construction included, which for every variant but deepspeed-mics
builds the full fp32 model on each rank before it is sharded).
"""
from __future__ import annotations

import argparse
import datetime
import os
import resource
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples"))

from gpt import GPTConfig  # noqa: E402
from zeropp_engine import (DeepSpeedRun, add_training_args, build_model,  # noqa: E402
                           engine_config, time_steps)

from zero_core.testing.ranks import report  # noqa: E402

ZERO_CORE_VARIANTS = ("zero3", "zero3-nodeaware", "mics", "mics-zeropp", "zeropp")
PEER_VARIANTS = ("fsdp2-hsdp", "deepspeed-3", "deepspeed-mics")
VARIANTS = ZERO_CORE_VARIANTS + PEER_VARIANTS
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here, said in its own words (reported, not raised)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS, required=True)
    add_training_args(p)
    p.add_argument("--mics-hierarchical", action="store_true",
                   help="mics_hierarchical_params_gather: true (mics, mics-zeropp, "
                        "deepspeed-mics)")
    p.add_argument("--fsdp-reduce-dtype", choices=sorted(DTYPES), default="bf16",
                   help="fsdp2-hsdp's MixedPrecisionPolicy.reduce_dtype (default bf16)")
    return p.parse_args(argv)


def ranks_per_node_from_env(env=None) -> int:
    env = os.environ if env is None else env
    return int(env.get("ZERO_CORE_RANKS_PER_NODE") or env.get("LOCAL_WORLD_SIZE") or "1")


def mics_keys(a, ranks_per_node: int) -> dict:
    return {"mics_shard_size": ranks_per_node,
            "mics_hierarchical_params_gather": bool(a.mics_hierarchical)}


def zero_core_config(variant: str, a, ranks_per_node: int) -> dict:
    """zero-core's config for *variant*: zeropp_engine's stage-3 config plus the keys above."""
    if variant not in ZERO_CORE_VARIANTS:
        raise ValueError(f"{variant!r} is not a zero-core variant")
    config = engine_config("stage3-zeropp" if variant == "zeropp" else "stage3", a,
                           ranks_per_node)
    zero = config["zero_optimization"]
    if variant in ("zero3", "zero3-nodeaware"):
        zero["node_aware_collectives"] = variant == "zero3-nodeaware"
    elif variant in ("mics", "mics-zeropp"):
        zero.update(mics_keys(a, ranks_per_node))
        if variant == "mics-zeropp":
            zero["zero_quantized_weights"] = True
    return config


def deepspeed_config(variant: str, a, ranks_per_node: int) -> dict:
    """DeepSpeed's config: zeropp_engine's deepspeed-3 settings, MiCS keys for deepspeed-mics."""
    zero = {"stage": 3, "stage3_max_reuse_distance": a.max_reuse,
            "stage3_param_persistence_threshold": a.persistence,
            "stage3_max_live_parameters": a.max_live}
    if variant == "deepspeed-mics":
        zero.update(mics_keys(a, ranks_per_node))
    return {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,  # torch's AdamW
            "gradient_clipping": 0.0, "steps_per_print": 10**9}


def comm_timeout() -> datetime.timedelta:
    """The job's collective timeout (the cluster sets ZERO_CORE_COMM_TIMEOUT): a rank whose
    peer died fails instead of waiting torch's 30 minutes."""
    return datetime.timedelta(seconds=float(os.environ.get("ZERO_CORE_COMM_TIMEOUT") or 1800))


def fsdp_mesh_shape(world_size: int, ranks_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) for the ("replicate", "shard") mesh."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"world size {world_size} is not a multiple of {ranks_per_node} "
                         f"ranks per node")
    return world_size // ranks_per_node, ranks_per_node


class TorchRun:
    """FSDP2 hybrid sharding behind the calls the timing loop makes."""

    def __init__(self, model, a, ranks_per_node: int):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        dist.init_process_group("gloo", timeout=comm_timeout())
        self.dist = dist
        self.world_size, self.global_rank = dist.get_world_size(), dist.get_rank()
        self.num_parameters = sum(p.numel() for p in model.parameters())
        mesh = init_device_mesh("cpu", fsdp_mesh_shape(self.world_size, ranks_per_node),
                                mesh_dim_names=("replicate", "shard"))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                      reduce_dtype=DTYPES[a.fsdp_reduce_dtype])
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)

    def __call__(self, x):
        return self.model(x)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def barrier(self):
        self.dist.barrier()


class DeepSpeedPeer(DeepSpeedRun):
    """zeropp_engine's DeepSpeed runner with this worker's config (MiCS for deepspeed-mics);
    builds the model itself, under MiCS_Init when MiCS is asked for."""

    def __init__(self, variant: str, a, ranks_per_node: int):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        import torch.distributed as dist
        config = deepspeed_config(variant, a, ranks_per_node)
        mics_init = (getattr(deepspeed.zero, "MiCS_Init", None)
                     if variant == "deepspeed-mics" else None)
        deepspeed.init_distributed(dist_backend="gloo", timeout=comm_timeout())
        if mics_init is not None:
            with mics_init(config_dict_or_path=config):
                model = build_model(a.model, seed=1234)
        else:
            model = build_model(a.model, seed=1234)
        optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
        try:
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=config)
        except Exception as exc:
            if variant != "deepspeed-mics" or mics_init is not None:
                raise
            # DeepSpeed's own words on the MiCS config, next to the missing MiCS_Init
            raise PeerUnavailable(f"DeepSpeed {deepspeed.__version__} has no "
                                  f"deepspeed.zero.MiCS_Init, and deepspeed.initialize "
                                  f"says: {type(exc).__name__}: {exc}") from exc
        if variant == "deepspeed-mics" and mics_init is None:
            raise PeerUnavailable(f"DeepSpeed {deepspeed.__version__} has no "
                                  f"deepspeed.zero.MiCS_Init: its ZeRO-3 would not be MiCS")
        self.model = model
        self.dist = dist
        self.world_size, self.global_rank = dist.get_world_size(), dist.get_rank()
        self.num_parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # KiB on Linux


def setup(a, ranks_per_node: int):
    """(engine, comm or None, barrier) for the variant."""
    if a.variant in ZERO_CORE_VARIANTS:
        import zero_core
        model = build_model(a.model, seed=1234)
        engine, *_ = zero_core.initialize(
            model=model, config=zero_core_config(a.variant, a, ranks_per_node))
        return engine, engine.comm, engine.comm.barrier
    if a.variant == "fsdp2-hsdp":
        engine = TorchRun(build_model(a.model, seed=1234), a, ranks_per_node)
    else:
        engine = DeepSpeedPeer(a.variant, a, ranks_per_node)
    return engine, None, engine.barrier


def train(a, engine, comm, barrier) -> dict:
    """Warm-up, then timed steps; the report's numbers (zeropp_engine.time_steps)."""
    return time_steps(engine, a, a.seq or GPTConfig.preset(a.model).block_size, comm, barrier)


def leave(engine, comm) -> None:
    """Tear down, then exit without the interpreter's teardown (gloo can abort there after
    the results are reported; see zero_core.testing.ranks.leave_rank)."""
    if comm is not None:
        from zero_core.runtime.context import shutdown
        engine.destroy()
        shutdown()
    else:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> None:
    a = parse_args(argv)
    ranks_per_node = ranks_per_node_from_env()
    head = {"variant": a.variant, "model": a.model, "ranks_per_node": ranks_per_node,
            "rank": int(os.environ.get("RANK", "0"))}
    stage = "setup"
    try:
        engine, comm, barrier = setup(a, ranks_per_node)
        stage = "training"
        numbers = train(a, engine, comm, barrier)
    except Exception as exc:
        if a.variant in ZERO_CORE_VARIANTS:
            raise  # zero-core failing is a failure of the run, not a peer's limitation
        report({**head, "error": f"{type(exc).__name__} in {stage}: {exc}",
                "peak_rss_mb": peak_rss_mb()})
        leave(None, None)
    report({**head, "rank": engine.global_rank, "params": engine.num_parameters,
            "world_size": engine.world_size, **numbers, "peak_rss_mb": peak_rss_mb(),
            "zeropp": engine.memory_report().get("zeropp") if comm is not None else None})
    leave(engine, comm)


if __name__ == "__main__":
    main()
