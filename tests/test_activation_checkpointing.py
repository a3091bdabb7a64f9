"""Activation checkpointing (ZeRO-R): zero_core.checkpointing against plain autograd.

Single-process tests compare checkpointed and non-checkpointed runs of the same modules
(with dropout, so the RNG replay is exercised), check what is actually saved (with
torch's saved_tensors_hooks, independently of zero-core's own count), the hook contract
stage 3 relies on, the contiguous buffers, and the errors. The multi-rank test runs a
2-rank tensor-parallel MLP (tests/workers/actckpt_mp.py) under torchrun-style gloo and
under mpirun, and compares its gradients with the same MLP computed unpartitioned in one
process in float64.

Bounds: checkpointed vs non-checkpointed fp32 runs execute the same kernels on the same
values in the same order, so they agree to rounding (allclose with rtol 1e-6 / atol 1e-7;
measured: bitwise equal). The tensor-parallel float64 run splits the hidden-layer sums in
two partial sums added by the all-reduce: rounding of ~1e-16 relative, checked at 1e-10.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import weakref

import pytest
import torch
import torch.nn.functional as F

from zero_core import checkpointing
from zero_core.activation.buffers import SlotBuffers
from zero_core.activation.layout import ALIGN, chunk_bytes, plan, read_all, write_part
from zero_core.activation.partition import resolve_model_parallel
from zero_core.interfaces.communicator import Group
from zero_core.config import ActivationCheckpointingConfig, parse_config
from zero_core.errors import ConfigError, ZeroCoreError
from zero_core.testing.ranks import mpirun_path, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "actckpt_mp.py")
COMM = {"torchrun": "gloo", "mpirun": "mpi"}


@pytest.fixture(autouse=True)
def fresh_configuration():
    checkpointing.deconfigure()
    yield
    checkpointing.deconfigure()


def close(a, b, rtol=1e-6, atol=1e-7) -> bool:
    return torch.allclose(a, b, rtol=rtol, atol=atol)


class SavedBytes:
    """Records every tensor autograd saves inside the block (not zero-core's own count)."""

    def __init__(self):
        self.items = []

    def __enter__(self):
        def pack(t):
            self.items.append(t)
            return t
        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    def activations(self):
        return [t for t in self.items if not isinstance(t, torch.nn.Parameter)]

    def activation_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.activations())


# --- a transformer block with dropout: checkpointed == not checkpointed ----------------------

class Block(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(dim, heads, dim_feedforward=32,
                                                      dropout=0.25, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 24), torch.nn.GELU(),
                                       torch.nn.Dropout(0.3), torch.nn.Linear(24, dim))

    def forward(self, x):
        return self.mlp(self.layer(x)) + x


def train_blocks(blocks, use_checkpoint, steps=3, seed=0):
    """Per step: grads of every parameter, the input grad, and one draw of the global RNG
    after backward (the recompute must leave the RNG where plain autograd would)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        x = torch.randn(3, 5, 16, generator=gen).requires_grad_(True)
        for b in blocks:
            b.zero_grad(set_to_none=True)
        h = x
        for b in blocks:
            h = checkpointing.checkpoint(b, h) if use_checkpoint else b(h)
        (h.square().mean() + h.sum() * 0.01).backward()
        grads = [p.grad.clone() for b in blocks for p in b.parameters()]
        out.append((grads, x.grad.clone(), torch.rand(3)))
    return out


CONFIGS = {
    "default": {},
    "cpu": {"checkpoint_in_cpu": True},
    "contiguous": {"contiguous_checkpointing": True, "num_checkpoints": 3},
    "cpu_contiguous_sync_profile": {"checkpoint_in_cpu": True, "contiguous_checkpointing": True,
                                    "num_checkpoints": 3, "synchronize": True, "profile": True},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformer_blocks_with_dropout_match_plain_autograd(name):
    torch.manual_seed(123)
    blocks = [Block() for _ in range(3)]
    for b in blocks:
        b.train()
    reference = train_blocks(blocks, use_checkpoint=False)
    checkpointing.configure(**CONFIGS[name])
    got = train_blocks(blocks, use_checkpoint=True)
    for (g_ref, x_ref, r_ref), (g, x, r) in zip(reference, got):
        assert len(g) == len(g_ref) and all(close(a, b) for a, b in zip(g, g_ref))
        assert close(x, x_ref)
        assert torch.equal(r, r_ref)  # the RNG after backward is where plain autograd left it
    stats = checkpointing.memory_stats()
    assert stats["live_checkpoints"] == 0 and stats["stored_bytes"] == 0
    if "profile" in CONFIGS[name]:
        summary = checkpointing.profile_summary()
        assert summary["forward"]["calls"] == summary["recompute"]["calls"] == 3 * 3


def test_dropout_masks_really_depend_on_the_rng():
    # guards the test above: were the RNG not replayed, the masks (and grads) would differ
    blk = Block()
    torch.manual_seed(5)
    a = blk(torch.ones(1, 5, 16))
    b = blk(torch.ones(1, 5, 16))
    assert not torch.equal(a, b)


# --- arguments and outputs ----------------------------------------------------------------------

def test_non_tensor_args_nested_tensors_kwargs_and_tuple_outputs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)
    emb = torch.nn.Embedding(10, 6)

    def fn(x, ids, extras, scale, *, mode="sum", bias=None):
        h = lin(x * scale + emb(ids)) + extras["shift"][0]
        if mode == "sum":
            h = h + bias
        return h.tanh(), (ids * 2, None, "tag"), {"norm": h.norm(), "count": ids.numel()}

    def run(use):
        lin.zero_grad(set_to_none=True)
        emb.zero_grad(set_to_none=True)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))   # no grad needed
        shift = torch.randn(6, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
        bias = torch.randn(6, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
        ids = torch.tensor([1, 2, 3, 9])
        args = (x, ids, {"shift": [shift]}, 0.5)
        out = checkpointing.checkpoint(fn, *args, mode="sum", bias=bias) if use else \
            fn(*args, mode="sum", bias=bias)
        h, (ids2, none, tag), d = out
        (h.sum() + d["norm"]).backward()
        return (h.detach(), ids2, none, tag, d["count"], lin.weight.grad.clone(),
                emb.weight.grad.clone(), shift.grad.clone(), bias.grad.clone())

    ref, got = run(False), run(True)
    assert torch.equal(got[1], ref[1]) and got[1].dtype == torch.int64
    assert got[2] is None and got[3] == "tag" and got[4] == 4
    for a, b in zip(got[5:], ref[5:]):
        assert close(a, b)  # parameters get grads although x does not require grad
    assert close(got[0], ref[0])


def test_only_the_inputs_are_saved_and_no_grad_just_calls():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                              torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 8, requires_grad=True)
    with SavedBytes() as plain:
        mlp(x)
    with SavedBytes() as ckpt:
        y = checkpointing.checkpoint(mlp, x)
    assert [t is x for t in ckpt.activations()] == [True]          # the input, nothing else
    assert plain.activation_bytes() > 10 * ckpt.activation_bytes()  # the hidden activations
    del y
    gc.collect()
    with torch.no_grad():
        out = checkpointing.checkpoint(mlp, x)
    assert not out.requires_grad and checkpointing.memory_stats()["live_checkpoints"] == 0


def test_autograd_grad_is_refused_with_a_clear_error():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = checkpointing.checkpoint(lin, x).sum()
    with pytest.raises(ZeroCoreError, match=r"\.backward\(\)"):
        torch.autograd.grad(y, x)


# --- the recompute calls the module again: hooks that gather parameters (stage 3) ----------------

class GatheredLinear(torch.nn.Module):
    """A linear layer whose weight holds no data between uses, like a stage-3 parameter: a
    forward pre-hook and a backward pre-hook materialize it from a stored copy, a forward
    hook releases it again."""

    def __init__(self, full_weight):
        super().__init__()
        self.store = full_weight.clone()
        self.weight = torch.nn.Parameter(torch.empty(0))
        self.events = []
        self.register_forward_pre_hook(self._gather)
        self.register_forward_hook(self._release)
        self.register_full_backward_pre_hook(self._gather_for_backward)

    def _gather(self, module, args):
        self.events.append(("pre", torch.is_grad_enabled(), checkpointing.is_recomputing()))
        self.weight.data = self.store.clone()

    def _release(self, module, args, output):
        self.weight.data = torch.empty(0)

    def _gather_for_backward(self, module, grad_output):
        self.events.append(("backward", checkpointing.is_recomputing()))
        self.weight.data = self.store.clone()

    def forward(self, x):
        return F.linear(x, self.weight)


@pytest.mark.parametrize("name", ["default", "cpu_contiguous_sync_profile"])
def test_recompute_fires_the_gathering_hooks_again(name):
    torch.manual_seed(0)
    w1, w2 = torch.randn(12, 6, dtype=torch.float64), torch.randn(6, 12, dtype=torch.float64)
    x = torch.randn(5, 6, dtype=torch.float64)

    # reference: the same function with ordinary parameters
    p1, p2 = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    F.linear(torch.tanh(F.linear(xr, p1)), p2).pow(2).sum().backward()

    checkpointing.configure(**CONFIGS[name])
    m1, m2 = GatheredLinear(w1), GatheredLinear(w2)

    def block(h):
        return m2(torch.tanh(m1(h)))

    xc = x.clone().requires_grad_(True)
    out = checkpointing.checkpoint(block, xc)
    assert m1.weight.numel() == 0 and m2.weight.numel() == 0  # released after the forward
    out.pow(2).sum().backward()
    assert torch.allclose(m1.weight.grad, p1.grad, rtol=1e-12, atol=1e-12)
    assert torch.allclose(m2.weight.grad, p2.grad, rtol=1e-12, atol=1e-12)
    assert torch.allclose(xc.grad, xr.grad, rtol=1e-12, atol=1e-12)
    # forward (no grad), recompute (grad, recomputing), then backward inside the recompute
    assert m1.events == [("pre", False, False), ("pre", True, True), ("backward", True)]
    assert m2.events == [("pre", False, False), ("pre", True, True), ("backward", True)]
    assert not checkpointing.is_recomputing()


# --- what is stored: host copies and contiguous buffers ------------------------------------------

def test_cpu_checkpointing_keeps_a_host_copy_and_frees_the_original():
    checkpointing.configure(checkpoint_in_cpu=True)
    lin = torch.nn.Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)
    h = lin(x)                       # the activation entering the checkpoint
    ref = weakref.ref(h)
    with SavedBytes() as saved:
        y = checkpointing.checkpoint(torch.nn.functional.gelu, h)
    acts = saved.activations()
    assert len(acts) == 1 and acts[0].device.type == "cpu" and acts[0].dtype == torch.uint8
    assert acts[0].untyped_storage().data_ptr() != h.untyped_storage().data_ptr()
    assert acts[0].numel() == chunk_bytes(h.numel() * 4, 1)
    expected = F.gelu(h.detach())
    del h
    gc.collect()
    # only the copy is kept (lin's own graph saves x and its weight, not its output)
    assert ref() is None
    y.sum().backward()
    assert torch.allclose(y.detach(), expected)


def test_host_buffers_are_pinned_through_the_accelerator():
    pinned = []

    def pin(t):
        pinned.append(t.numel())
        return t.clone()

    slots = SlotBuffers(2, torch.device("cpu"), pin=pin)
    token = object.__new__(type("Tok", (), {}))
    slots.claim(100, token)
    assert pinned == [100]


def test_contiguous_buffers_are_reused_across_steps():
    checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=3)
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)]
    pointers = []
    for step in range(4):
        x = torch.randn(4, 16, requires_grad=True)
        with SavedBytes() as saved:
            h = x
            for b in blocks:
                h = checkpointing.checkpoint(b, h)
        pointers.append([t.untyped_storage().data_ptr() for t in saved.activations()])
        h.sum().backward()
    buffers = checkpointing.memory_stats()["contiguous_buffers"]
    assert [b["index"] for b in buffers] == [0, 1, 2]
    assert all(p == pointers[0] for p in pointers)                # same storage every step
    assert pointers[0] == [b["data_ptr"] for b in buffers]        # checkpoint k -> buffer k
    assert len(set(pointers[0])) == 3
    stats = checkpointing.memory_stats()
    assert stats["contiguous_allocations"] == 3 and stats["contiguous_reallocations"] == 0
    # a larger input no longer fits: the buffer is replaced, and counted
    h = checkpointing.checkpoint(blocks[0], torch.randn(40, 16, requires_grad=True))
    h.sum().backward()
    assert checkpointing.memory_stats()["contiguous_reallocations"] == 1


def test_too_few_checkpoints_reset_and_stale_buffers_are_clear_errors():
    checkpointing.configure(deepspeed_config={"activation_checkpointing": {
        "contiguous_memory_optimization": True, "number_checkpoints": 2}})
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    h = checkpointing.checkpoint(lin, checkpointing.checkpoint(lin, x))
    with pytest.raises(ZeroCoreError, match="number_checkpoints=2") as info:
        checkpointing.checkpoint(lin, h)
    assert "reset()" in str(info.value)
    # evaluation with grad enabled: outputs kept, no backward; reset() frees the buffers,
    # and the old graph then refuses its backward instead of reading overwritten data
    old = h
    checkpointing.reset()
    fresh = checkpointing.checkpoint(lin, checkpointing.checkpoint(lin, x))
    fresh.sum().backward()
    with pytest.raises(ZeroCoreError, match="taken by a later checkpointed call"):
        old.sum().backward()
    # a graph dropped without backward gives its buffers back by itself
    h = checkpointing.checkpoint(lin, checkpointing.checkpoint(lin, x))
    del h
    gc.collect()
    checkpointing.checkpoint(lin, checkpointing.checkpoint(lin, x)).sum().backward()


# --- configuration -------------------------------------------------------------------------------

def test_configure_reads_the_deepspeed_section_and_arguments_override(tmp_path):
    assert not checkpointing.is_configured()
    assert checkpointing.settings() == ActivationCheckpointingConfig()
    ds = {"train_batch_size": 8, "activation_checkpointing": {
        "cpu_checkpointing": True, "contiguous_memory_optimization": True,
        "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    expected = ActivationCheckpointingConfig(cpu_checkpointing=True,
                                             contiguous_memory_optimization=True,
                                             number_checkpoints=4,
                                             synchronize_checkpoint_boundary=True, profile=True)
    for source in (ds, str(path), path, json.dumps(ds), parse_config(ds, world_size=8)):
        checkpointing.configure(deepspeed_config=source)
        assert checkpointing.is_configured() and checkpointing.settings() == expected
    checkpointing.configure(None, ds, contiguous_checkpointing=False, num_checkpoints=9,
                            checkpoint_in_cpu=False, synchronize=False, profile=False)
    assert checkpointing.settings() == ActivationCheckpointingConfig(number_checkpoints=9)
    checkpointing.deconfigure()
    assert not checkpointing.is_configured()


def test_configuration_errors_say_what_to_do():
    with pytest.raises(ConfigError, match="partition_activations needs the model-parallel group"):
        checkpointing.configure(partition_activations=True)
    with pytest.raises(ConfigError, match="needs number_checkpoints"):
        checkpointing.configure(contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match="number_checkpoints"):
        checkpointing.configure(deepspeed_config={"activation_checkpointing": {
            "contiguous_memory_optimization": True}})
    with pytest.raises(ConfigError, match="integer >= 1"):
        checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=0)
    with pytest.raises(ConfigError, match="True or False"):
        checkpointing.configure(checkpoint_in_cpu="yes")
    with pytest.raises(ConfigError, match="did you mean 'number_checkpoints'"):
        checkpointing.configure(deepspeed_config={"activation_checkpointing": {
            "number_checkpoint": 2}})
    with pytest.raises(ConfigError, match="no get_model_parallel_group"):
        checkpointing.configure(object(), partition_activations=True)
    assert not checkpointing.is_configured()  # a refused configuration changes nothing


def test_mpu_checks_happen_before_any_communicator_is_needed():
    def no_comm():
        raise AssertionError("the communicator must not be asked for")

    class Mpu:
        def __init__(self, group, rank=None, size=None):
            self.group, self.rank, self.size = group, rank, size

        def get_model_parallel_group(self):
            return self.group

        def get_model_parallel_rank(self):
            return self.group.rank if self.rank is None else self.rank

        def get_model_parallel_world_size(self):
            return self.group.size if self.size is None else self.size

    group = Group("mp", (0, 1), 0, False)
    with pytest.raises(ConfigError, match=r"get_model_parallel_rank\(\) = 1"):
        resolve_model_parallel(Mpu(group, rank=1), no_comm)
    with pytest.raises(ConfigError, match=r"get_model_parallel_world_size\(\) = 4"):
        resolve_model_parallel(Mpu(group, size=4), no_comm)
    with pytest.raises(ConfigError, match="not a member"):
        resolve_model_parallel(Group("mp", (1, 2), -1, False), no_comm)
    with pytest.raises(ConfigError, match="not a zero-core Group"):
        resolve_model_parallel(Mpu("a string"), no_comm)
    mp = resolve_model_parallel(Mpu(group), lambda: "the comm")
    assert (mp.size, mp.rank, mp.comm) == (2, 0, "the comm")


def test_synchronize_calls_the_accelerator_at_every_boundary(monkeypatch):
    calls = []

    class CountingAccelerator:
        def synchronize(self):
            calls.append(checkpointing.is_recomputing())

    checkpointing.configure(synchronize=True)
    monkeypatch.setattr(checkpointing._STATE, "accelerator", CountingAccelerator())
    lin = torch.nn.Linear(4, 4)
    y = checkpointing.checkpoint(lin, torch.randn(2, 4))
    assert len(calls) == 2
    y.sum().backward()
    assert len(calls) == 4


# --- the byte layout -----------------------------------------------------------------------------

@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_layout_round_trips_any_dtype_through_the_parts(parts):
    g = torch.Generator().manual_seed(parts)
    tensors = [torch.randn(3, 5, generator=g), torch.randn((), generator=g, dtype=torch.float64),
               torch.randint(-9, 9, (7,), generator=g), torch.rand(4, 4, generator=g) > 0.5,
               torch.randn(2, 3, generator=g).half(), torch.empty(0, 4),
               torch.randn(5, generator=g, dtype=torch.complex64),
               torch.randn(6, 4, generator=g).t()]  # non-contiguous
    specs, payload_bytes = plan(tensors, parts)
    assert payload_bytes % ALIGN == 0
    for t, s in zip(tensors, specs):
        assert s.chunk * parts >= s.nbytes and s.chunk % ALIGN == 0 and s.offset % ALIGN == 0
    matrix = torch.full((parts, payload_bytes), 255, dtype=torch.uint8)
    for p in range(parts):
        write_part(matrix[p], tensors, specs, p)
    for t, r in zip(tensors, read_all(matrix, specs)):
        assert r.dtype == t.dtype and r.shape == t.shape and torch.equal(r, t)


def test_each_part_stores_its_share():
    assert chunk_bytes(2048, 2) == 1024 and chunk_bytes(960, 2) == 512
    assert chunk_bytes(1, 4) == ALIGN and chunk_bytes(0, 3) == 0


# --- real ranks: a 2-rank tensor-parallel MLP --------------------------------------------------

def _load_worker():
    spec = importlib.util.spec_from_file_location("actckpt_mp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def float64_reference(worker, seed):
    """The worker's MLP, unpartitioned, in one process: per step (loss, x grad, grads)."""
    weights = worker.full_weights(seed)
    params = [{k: v.clone().requires_grad_(True) for k, v in w.items()} for w in weights]
    torch.manual_seed(seed + 7)
    steps = []
    for x0, target in worker.batches(seed):
        for p in params:
            for t in p.values():
                t.grad = None
        x = x0.clone().requires_grad_(True)
        h = x
        for p in params:
            y = F.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
            keep = worker.KEEP
            mask = (torch.rand(y.shape, dtype=torch.float32) < keep).to(y.dtype) / keep
            h = h + y * mask
        loss = (h * target).sum()
        loss.backward()
        steps.append((loss.item(), x.grad.clone(),
                      [{k: t.grad.clone() for k, t in p.items()} for p in params]))
    return steps


def _launchers():
    return ["torchrun", pytest.param("mpirun", marks=pytest.mark.skipif(
        mpirun_path() is None, reason="mpirun not installed: pip install 'zero-core[mpi]'"))]


@pytest.mark.multirank
@pytest.mark.parametrize("launcher", _launchers())
def test_partitioned_activations_on_a_tensor_parallel_mlp(launcher):
    worker = _load_worker()
    seed = int.from_bytes(os.urandom(2), "little")
    results = run_ranks(WORKER, 2, launcher, args=[seed], env={"ZERO_CORE_COMM": COMM[launcher]},
                        timeout=300)
    reports = [r.report for r in results]
    assert all(rep is not None for rep in reports), "a rank did not report"
    reference = float64_reference(worker, seed)
    half, layers = worker.FF // 2, worker.LAYERS
    input_bytes = worker.B * worker.T * worker.H * 8          # one block input, float64

    for rep in reports:
        assert rep["comm"] == COMM[launcher]
        r = rep["mp_rank"]
        cols = slice(r * half, (r + 1) * half)
        by_name = {sc["name"]: sc for sc in rep["scenarios"]}
        assert list(by_name) == ["no_checkpoint", "plain", "partition", "partition_cpu",
                                 "partition_contiguous", "everything"]
        for name, sc in by_name.items():
            for step, (loss, x_grad, grads) in zip(sc["steps"], reference):
                assert step["loss"] == pytest.approx(loss, rel=1e-12), name
                assert torch.allclose(torch.tensor(step["x_grad"], dtype=torch.float64),
                                      x_grad.flatten(), rtol=1e-10, atol=1e-12), name
                for got, want in zip(step["grads"], grads):
                    shards = {"w1": want["w1"][:, cols], "b1": want["b1"][cols],
                              "w2": want["w2"][cols, :], "b2": want["b2"]}
                    for k, v in shards.items():
                        assert torch.allclose(torch.tensor(got[k], dtype=torch.float64),
                                              v.flatten(), rtol=1e-10, atol=1e-12), (name, k)
                assert step["live_after_backward"] == 0

        for step in by_name["plain"]["steps"]:
            # whole inputs saved (block 2's input is kept alive by it)
            assert [s["nbytes"] for s in step["saved"]] == [input_bytes] * layers
            assert step["inner_inputs_alive"] == 1 and step["all_gather_calls"] == 0
            assert step["stored_after_forward"] == layers * input_bytes
        for name in ("partition", "partition_cpu", "partition_contiguous", "everything"):
            for step in by_name[name]["steps"]:
                # each rank stores exactly half of every block input, as raw bytes ...
                assert [s["nbytes"] for s in step["saved"]] == [input_bytes // 2] * layers, name
                assert all(s["device"] == "cpu" for s in step["saved"])
                assert step["stored_after_forward"] == layers * input_bytes // 2
                assert step["live_after_forward"] == layers
                # ... the full activation is not kept, and backward gathers it once per block
                assert step["inner_inputs_alive"] == 0, name
                assert step["all_gather_calls"] == layers
                assert step["all_gather_payload_bytes"] == layers * input_bytes // 2
                # parameters are saved by reference (not copied, not partitioned)
                assert step["saved_param_count"] == \
                    by_name["plain"]["steps"][0]["saved_param_count"]
        for name in ("partition_contiguous", "everything"):
            steps = by_name[name]["steps"]
            pointers = [b["data_ptr"] for b in steps[0]["buffers"]]
            assert len(pointers) == layers
            assert all([b["data_ptr"] for b in s["buffers"]] == pointers for s in steps)
            assert all([s_["ptr"] for s_ in s["saved"]] == pointers for s in steps)
            assert by_name[name]["reallocations"] == 0
        prof = by_name["everything"]["profile"]
        assert prof["forward"]["calls"] == prof["recompute"]["calls"] == layers * worker.STEPS
        error = rep["torch_group_error"]
        assert "new_group" in error and "ProcessGroup" in error
        # ZeRO-2 reduces the gradients the recompute's backward produces: same training
        engine = rep["engine_stage2"]
        assert engine["moved"] > 1e-3 and engine["max_diff"] <= 1e-6 * engine["moved"], engine
