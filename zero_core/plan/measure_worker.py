"""Rank program of ``zero-core plan --measure``: times all_reduce and all_gather of 4 MB on
this job's communicator and reports the bytes/s this rank sent (the ledger's count); then,
on every rank at once (so that the ranks share the cores and the memory bus as in
training), the FLOP rate of a GPT block's forward + backward and the elements per second
of the CPU kernel set's Adam step.

Run by ``measure.rank_rates`` through ``zero_core.testing.ranks.run_ranks``."""
from __future__ import annotations

import sys
import time

import torch

from zero_core.runtime import registry
from zero_core.runtime.context import comm_timeout
from zero_core.runtime.launch import discover
from zero_core.runtime.topology import resolve_ranks_per_node
from zero_core.testing.ranks import report

ELEMENTS = 2 ** 20   # 4 MB of float32
REPS = 5


def timed(comm, op) -> float:
    """Bytes/s this rank sent in REPS calls of *op* (after one warm-up call)."""
    op()
    before = comm.ledger.snapshot()["sent_bytes"]
    start = time.perf_counter()
    for _ in range(REPS):
        op()
    elapsed = time.perf_counter() - start
    return (comm.ledger.snapshot()["sent_bytes"] - before) / elapsed


class _Block(torch.nn.Module):
    """A pre-LayerNorm GPT block: causal self-attention (scaled_dot_product_attention),
    then a 4x GELU MLP, each around a residual."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(h, dim=2))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


def block_train_flops(comm, hidden: int, heads: int, seq: int, batch: int,
                      dtype: torch.dtype = torch.float32, reps: int = 6) -> float:
    """FLOP/s of a GPT block's forward + backward in *dtype* (the planned precision: on a
    CPU without bf16 instructions bf16 runs at a third of float32's rate), counted as 6 x
    its parameters x tokens (the planner's count: attention's s^2 work, norms and
    activations are in the time but not in the FLOPs, as they are in a real step)."""
    block = _Block(hidden, heads).to(dtype)
    x = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)
    params = sum(p.numel() for p in block.parameters())

    def step():
        block(x).square().mean().backward()

    step()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    return 6 * params * batch * seq * reps / (time.perf_counter() - start)


def adam_elements_per_s(comm, elements: int = 2 ** 22, reps: int = 6) -> float:
    """Elements/s of the cpu kernel set's fused Adam step on flat fp32 buffers (the set
    the registry gives the engine on the cpu accelerator, as in training)."""
    adam_step = registry.load().kernel_set("cpu").adam_step
    p, g, m, v = (torch.randn(elements) for _ in range(4))
    v.abs_()
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)
    adam_step(p, g, m, v, step=1, **kw)
    comm.barrier()
    start = time.perf_counter()
    for i in range(reps):
        adam_step(p, g, m, v, step=2 + i, **kw)
    return elements * reps / (time.perf_counter() - start)


launch = discover()
topology = resolve_ranks_per_node(launch.world_size, launch.local_world_size)
comm = registry.load().communicator_class(None)(launch, topology, timeout=comm_timeout())
x = torch.ones(ELEMENTS)
out = torch.empty(ELEMENTS * comm.world_size)
# the block's hidden size, heads, sequence length, sequences (measure.DEFAULT_BLOCK) and
# dtype name (float32, bfloat16, float16)
hidden, heads, seq, batch = (int(v) for v in sys.argv[1:5])
dtype = getattr(torch, sys.argv[5]) if len(sys.argv) > 5 else torch.float32
report({"all_reduce": timed(comm, lambda: comm.all_reduce(x)),
        "all_gather": timed(comm, lambda: comm.all_gather_into(out, x)),
        "train_flops": block_train_flops(comm, hidden, heads, seq, batch, dtype),
        "optimizer_rate": adam_elements_per_s(comm)})
