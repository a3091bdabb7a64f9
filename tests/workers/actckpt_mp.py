"""Multi-rank worker for tests/test_activation_checkpointing.py: a 2-rank tensor-parallel MLP.

Usage: ``python actckpt_mp.py <seed>`` on 2 ranks. Both ranks form one model-parallel group.
Each block is Megatron-style: column-parallel first layer (rank r holds output features
[r*F/2, (r+1)*F/2) of W1, B1), row-parallel second layer (rows of W2), an all-reduce of
the partial outputs, a bias, a dropout mask drawn from the global RNG inside the block,
and a residual. The input of every block is therefore identical on both ranks, which is
what partition_activations relies on.

Several configurations run in one launch; for each, two training steps (same RNG stream
carried across steps) report the gradients, what autograd saved during the forward
(measured with saved_tensors_hooks, not by zero-core's own count), whether the blocks'
input activations were kept alive, the ledger's all-gather traffic in backward, and the
contiguous buffers. The test compares all of it with a float64 single-process reference.
Last, the ZeRO stage-2 engine trains a small data-parallel model with and without
checkpointing (its gradient hooks fire inside the recompute's backward).
"""
from __future__ import annotations

import gc
import sys
import weakref

import torch
import torch.nn.functional as F

import zero_core
from zero_core import checkpointing
from zero_core.runtime import context as runtime
from zero_core.errors import ConfigError
from zero_core.interfaces.ledger import CommLedger
from zero_core.testing.ranks import report

B, T, H, FF, LAYERS, STEPS, KEEP = 4, 4, 16, 24, 2, 2, 0.75
DTYPE = torch.float64


def full_weights(seed: int) -> list[dict]:
    """Unsharded weights of every block (the test regenerates the same)."""
    g = torch.Generator().manual_seed(seed)
    return [{"w1": torch.randn(H, FF, generator=g, dtype=DTYPE) / H ** 0.5,
             "b1": torch.randn(FF, generator=g, dtype=DTYPE) * 0.1,
             "w2": torch.randn(FF, H, generator=g, dtype=DTYPE) / FF ** 0.5,
             "b2": torch.randn(H, generator=g, dtype=DTYPE) * 0.1} for _ in range(LAYERS)]


def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, target) per step, from their own generator so that the global RNG only
    feeds the dropout masks."""
    g = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(B, T, H, generator=g, dtype=DTYPE),
             torch.randn(B, T, H, generator=g, dtype=DTYPE)) for _ in range(STEPS)]


class MPU:
    """DeepSpeed-convention model-parallel unit over a zero-core Group."""

    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group

    def get_model_parallel_rank(self):
        return self.group.rank

    def get_model_parallel_world_size(self):
        return self.group.size


def make_layers(comm, group):
    class CopyToMP(torch.autograd.Function):
        """Identity forward; backward sums the input gradient over the group."""

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous().clone()
            comm.all_reduce(g, group=group)
            return g

    class ReduceFromMP(torch.autograd.Function):
        """Sum of the partial outputs over the group; identity backward."""

        @staticmethod
        def forward(ctx, x):
            y = x.contiguous().clone()
            comm.all_reduce(y, group=group)
            return y

        @staticmethod
        def backward(ctx, g):
            return g

    def block(x, params, keep):
        h = CopyToMP.apply(x)
        a = F.gelu(h @ params["w1"] + params["b1"])
        y = ReduceFromMP.apply(a @ params["w2"]) + params["b2"]
        mask = (torch.rand(y.shape, dtype=torch.float32) < keep).to(y.dtype) / keep
        return x + y * mask

    return block


def shard(weights: list[dict], rank: int) -> list[dict]:
    half = FF // 2
    cols = slice(rank * half, (rank + 1) * half)
    return [{"w1": torch.nn.Parameter(w["w1"][:, cols].clone()),
             "b1": torch.nn.Parameter(w["b1"][cols].clone()),
             "w2": torch.nn.Parameter(w["w2"][cols, :].clone()),
             "b2": torch.nn.Parameter(w["b2"].clone())} for w in weights]


def run_scenario(name, use_checkpoint, block, params, data, comm, seed):
    torch.manual_seed(seed + 7)
    steps = []
    for x0, target in data:
        for p in params:
            for t in p.values():
                t.grad = None
        x = x0.clone().requires_grad_(True)
        saved = []

        def pack(t):
            saved.append({"nbytes": t.numel() * t.element_size(), "device": t.device.type,
                          "param": isinstance(t, torch.nn.Parameter),
                          "ptr": t.untyped_storage().data_ptr(),
                          "pinned": t.is_pinned() if t.device.type == "cpu" else False})
            return t

        alive = []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = x
            for p in params:
                if h is not x:
                    alive.append(weakref.ref(h))
                h = checkpointing.checkpoint(block, h, p, keep=KEEP) if use_checkpoint \
                    else block(h, p, KEEP)
        loss = (h * target).sum()
        del h
        gc.collect()
        inner_inputs_alive = sum(r() is not None for r in alive)
        stats_after_forward = checkpointing.memory_stats()
        before = comm.ledger.snapshot()
        loss.backward()
        traffic = CommLedger.difference(comm.ledger.snapshot(), before)
        ag = traffic["ops"].get("all_gather_into", {"calls": 0, "payload_bytes": 0})
        steps.append({
            "loss": loss.item(),
            "x_grad": x.grad.flatten().tolist(),
            "grads": [{k: t.grad.flatten().tolist() for k, t in p.items()} for p in params],
            "saved": [s for s in saved if not s["param"]],
            "saved_param_count": sum(s["param"] for s in saved),
            "inner_inputs_alive": inner_inputs_alive,
            "live_after_forward": stats_after_forward["live_checkpoints"],
            "stored_after_forward": stats_after_forward["stored_bytes"],
            "all_gather_calls": ag["calls"], "all_gather_payload_bytes": ag["payload_bytes"],
            "buffers": checkpointing.memory_stats()["contiguous_buffers"],
            "live_after_backward": checkpointing.memory_stats()["live_checkpoints"],
        })
    return {"name": name, "steps": steps,
            "reallocations": checkpointing.memory_stats()["contiguous_reallocations"],
            "profile": checkpointing.profile_summary()}


class DataParallelNet(torch.nn.Module):
    """Two dropout MLP blocks, optionally checkpointed, for the ZeRO-2 engine check."""

    def __init__(self):
        super().__init__()
        self.use_checkpoint = False
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 8)) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = checkpointing.checkpoint(b, x) if self.use_checkpoint else b(x)
        return x.pow(2).mean()


def engine_check(seed: int, rank: int) -> dict:
    """ZeRO stage 2 (gradients reduced by hooks that fire in the recompute's backward):
    parameters after 3 steps with and without checkpointing, same data and RNG."""
    import copy
    torch.manual_seed(seed)
    base = DataParallelNet()
    finals = []
    for use in (False, True):
        model = copy.deepcopy(base)
        model.use_checkpoint = use
        engine, *_ = zero_core.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 60}})
        torch.manual_seed(seed + 100 + rank)  # per-rank dropout masks, same in both runs
        g = torch.Generator().manual_seed(seed + 200 + rank)
        for _ in range(3):
            loss = engine(torch.randn(2, 8, generator=g))
            engine.backward(loss)
            engine.step()
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        engine.destroy()
    start = torch.cat([p.detach().flatten() for p in base.parameters()])
    return {"max_diff": (finals[0] - finals[1]).abs().max().item(),
            "moved": (finals[0] - start).abs().max().item()}


def main() -> None:
    seed = int(sys.argv[1])
    rt = zero_core.init_distributed()
    comm = rt.comm
    assert rt.world_size == 2, "this worker runs on exactly 2 ranks"
    group = comm.new_group([0, 1], name="model_parallel")
    mpu = MPU(group)
    block = make_layers(comm, group)
    params = shard(full_weights(seed), group.rank)
    data = batches(seed)
    results = {"rank": rt.rank, "mp_rank": group.rank, "comm": comm.name, "scenarios": []}

    scenarios = [
        ("no_checkpoint", False, dict()),
        ("plain", True, dict()),
        ("partition", True, dict(partition_activations=True)),
        ("partition_cpu", True, dict(partition_activations=True, checkpoint_in_cpu=True)),
        ("partition_contiguous", True, dict(partition_activations=True,
                                            contiguous_checkpointing=True, num_checkpoints=LAYERS)),
        ("everything", True, dict(deepspeed_config={"activation_checkpointing": {
            "partition_activations": True, "cpu_checkpointing": True,
            "contiguous_memory_optimization": True, "number_checkpoints": LAYERS,
            "synchronize_checkpoint_boundary": True, "profile": True}})),
    ]
    for name, use, kwargs in scenarios:
        checkpointing.deconfigure()
        if kwargs:
            checkpointing.configure(mpu, **kwargs)
        results["scenarios"].append(run_scenario(name, use, block, params, data, comm, seed))

    checkpointing.deconfigure()
    results["engine_stage2"] = engine_check(seed, rt.rank)

    # a Megatron-style mpu whose group is a torch.distributed group is refused by name
    import torch.distributed as dist

    class TorchMPU(MPU):
        def get_model_parallel_group(self):
            return dist.group.WORLD
    try:
        checkpointing.configure(TorchMPU(group), partition_activations=True)
        results["torch_group_error"] = None
    except ConfigError as exc:
        results["torch_group_error"] = str(exc)
    report(results)
    runtime.shutdown()


if __name__ == "__main__":
    main()
