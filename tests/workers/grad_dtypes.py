"""Multi-rank worker for tests/test_grad_dtypes.py: the dtypes of the gradient path.

Usage: ``python grad_dtypes.py [seed]`` on every rank (2 ranks in the test). For ZeRO
stages 0-3 it builds engines over ``Probe``, a model whose gradients are known exactly —
each parameter w enters the loss as ``sum(w * x)``, so its gradient is x times the
engine's loss factor 1/(accumulation · world size), a power of two, with no rounding —
and reads the reduced gradient the optimizer would read (``reduced_grad_bucket``) after
the last backward of an accumulation window, before the step. Every rank draws every
rank's inputs from the seed, so it computes the float64 references itself:

- ``comm32``: bf16 training, ``communication_data_type: fp32``, one micro-step;
- ``comm16``: fp32 training, ``communication_data_type: bf16``, one micro-step;
- ``acc32_comm32`` / ``acc32`` / ``acc16``: bf16 training over WINDOWS optimizer steps of
  ACCUM micro-steps with ``data_types.grad_accum_dtype: fp32`` (with fp32 communication,
  with the default bf16 communication) and with the default bf16 accumulation (the second
  window checks that the accumulator starts again from nothing after a step);
- the memory ledger right after ``initialize`` of the ``acc32`` and ``acc16`` engines;
- the refusals: fp32 accumulation at stage 0, qgZ with a communication dtype of its own.

It reports numbers (differences, bytes per element, dtypes, ledgers, messages); the test
holds them to their bounds.
"""
from __future__ import annotations

import sys

import torch

import zero_core
from zero_core.errors import ConfigError
from zero_core.testing.ranks import report

#: parameter shapes: several reduce buckets of 200 elements, parameters straddling them
SHAPES = ((30, 10), (77,), (19, 27), (64,), (129,))
ACCUM = 4
WINDOWS = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Leaf(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(shape))

    def forward(self, x):
        return (self.w * x).sum()


class Probe(torch.nn.Module):
    """Loss = Σ_i sum(w_i * x_i): the gradient of w_i is x_i times the upstream factor."""

    def __init__(self):
        super().__init__()
        self.leaves = torch.nn.ModuleList(Leaf(s) for s in SHAPES)

    def forward(self, xs):
        out = None
        for leaf, x in zip(self.leaves, xs):
            y = leaf(x)
            out = y if out is None else out + y
        return out


def inputs(seed: int, micro: int, rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Rank *rank*'s inputs at micro-step *micro* (any rank can draw any rank's)."""
    g = torch.Generator().manual_seed(seed * 10_000 + micro * 100 + rank)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def make_engine(stage: int, precision: str, gas: int, comm: str | None = None,
                accum: str | None = None, qgz: bool = False):
    torch.manual_seed(0)
    model = Probe()
    zc = {"stage": stage, "reduce_bucket_size": 200}
    if stage == 3:
        zc.update(stage3_prefetch_bucket_size=200, stage3_param_persistence_threshold=0,
                  zero_quantized_gradients=qgz)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": zc, "bf16": {"enabled": precision == "bf16"}}
    if comm is not None:
        cfg["communication_data_type"] = comm
    if accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    engine, _, _, _ = zero_core.initialize(model=model, config=cfg)
    return engine, model


def per_rank_grads(seed, model, precision, gas, world, window=0):
    """g[(rank, micro)][id(param)]: the exact float64 gradient each rank produces in
    accumulation window *window*."""
    factor = 1.0 / (gas * world)
    params = [leaf.w for leaf in model.leaves]
    return {(r, m): {id(p): x.double().reshape(-1) * factor for p, x in
                     zip(params, inputs(seed, window * gas + m, r, DTYPES[precision]))}
            for r in range(world) for m in range(gas)}


def run_window(engine, seed, precision, gas, rank, window=0):
    """One optimizer step of *gas* micro-steps; the reduced gradients before the step."""
    dtype = DTYPES[precision]
    reduced = None
    for m in range(gas):
        engine.backward(engine(inputs(seed, window * gas + m, rank, dtype)))
        if m == gas - 1:
            engine.reducer.wait_all()
            reduced = owned_values(engine)
        engine.step()
    return reduced


def owned_values(engine):
    """{(group, bucket): (float64 copy of the reduced gradient, its dtype)} of this rank."""
    out = {}
    for j, gb in enumerate(engine.parts.buffers):
        if gb is None:
            continue
        for k in range(gb.num_buckets):
            t = gb.reduced_grad_bucket(k)
            out[(j, k)] = (t.detach().double().clone(), str(t.dtype).replace("torch.", ""))
    return out


def owned_reference(engine, ref: dict, rank: int, world: int) -> dict:
    """The same slices as owned_values, of the per-parameter float64 vectors *ref*."""
    out = {}
    for j, gb in enumerate(engine.parts.buffers):
        if gb is None:
            continue
        if hasattr(gb, "units"):   # stage 3: bucket k is fetch unit k
            for k, u in enumerate(gb.units):
                full = torch.zeros(u.padded_numel, dtype=torch.float64)
                for p, off in zip(u.params, u.offsets):
                    v = ref[id(p)]
                    full[off:off + v.numel()] = v
                shard = u.padded_numel // world
                out[(j, k)] = full[rank * shard:(rank + 1) * shard]
            continue
        lay = gb.layout
        full = torch.zeros(lay.padded_numel, dtype=torch.float64)
        for i, p in enumerate(gb.params):
            full[lay.offsets[i]:lay.offsets[i] + lay.numels[i]] = ref[id(p)]
        for k in range(gb.num_buckets):
            if gb.state_kind == "full":
                lo, n = lay.bucket_starts[k], lay.bucket_sizes[k]
            else:
                lo, n = lay.shard_start(k, rank), lay.shard_size(k)
            out[(j, k)] = full[lo:lo + n]
    return out


def compare(values: dict, reference: dict) -> dict:
    """max |engine - reference| and max |reference| over this rank's elements."""
    diff = max(float((values[key][0] - reference[key]).abs().max()) for key in values)
    scale = max(float(reference[key].abs().max()) for key in values)
    return {"max_abs": diff, "rel": diff / scale,
            "dtypes": sorted({values[key][1] for key in values})}


def bf16(t: torch.Tensor) -> torch.Tensor:
    """Round float64 *t* to bf16 once, back in float64. Via float32, which is exact for
    every value rounded here (sums of two bf16 or fp32-rounded values are checked)."""
    f = t.float()
    assert torch.equal(f.double(), t), "the float32 step would round: not a single rounding"
    return f.to(torch.bfloat16).double()


def reduce_elements(engine) -> int:
    """Padded elements one reduction of every bucket/unit carries."""
    total = 0
    for gb in engine.parts.buffers:
        if gb is None:
            continue
        total += (sum(u.padded_numel for u in gb.units) if hasattr(gb, "units")
                  else gb.layout.padded_numel)
    return total


def bytes_per_element(engine, stage: int, gas: int) -> float:
    """From the communicator's ledger: the gradient collectives' payload bytes divided by
    the elements they carried in the last step. Stage 0 all-reduces; stages 1-3
    reduce-scatter, which gloo carries as an all-to-all plus a local sum (the ledger names
    the wire operation)."""
    ops = engine.comm_report()["ops"]
    names = ("all_reduce",) if stage == 0 else ("reduce_scatter", "all_to_all_single")
    payload = sum(ops.get(op, {}).get("payload_bytes", 0) for op in names)
    if stage == 0:  # minus the step's one all_reduce of 3 float64 (norm, batch-size sums)
        payload -= 3 * 8
    reductions = gas if stage >= 2 else 1
    return payload / (reduce_elements(engine) * reductions)


def sum_refs(grads, keys, transform=lambda t: t):
    """Per parameter: Σ over *keys* of transform(gradient), float64."""
    ids = grads[keys[0]].keys()
    return {i: sum(transform(grads[key][i]) for key in keys) for i in ids}


def scenario_comm(stage, seed, rank, world, precision, comm):
    engine, model = make_engine(stage, precision, 1, comm=comm)
    got = run_window(engine, seed, precision, 1, rank)
    g = per_rank_grads(seed, model, precision, 1, world)
    keys = [(r, 0) for r in range(world)]
    exact = sum_refs(g, keys)
    if comm == "fp32":   # bf16 gradients summed in fp32 (exact), landing in bf16 once
        expected = {i: bf16(v) for i, v in exact.items()}
    else:                # each rank's fp32 gradient to bf16, summed, rounded to bf16 once
        expected = {i: bf16(v) for i, v in sum_refs(g, keys, bf16).items()}
    out = {"expected": compare(got, owned_reference(engine, expected, rank, world)),
           "vs_exact_sum": compare(got, owned_reference(engine, exact, rank, world)),
           "bytes_per_element": bytes_per_element(engine, stage, 1)}
    engine.destroy()
    return out


def scenario_accum(stage, seed, rank, world, accum, comm):
    engine, model = make_engine(stage, "bf16", ACCUM, comm=comm, accum=accum)
    out = {"ledger_at_init": engine.memory_report()["ledger"]}
    for window in range(WINDOWS):
        got = run_window(engine, seed, "bf16", ACCUM, rank, window)
        g = per_rank_grads(seed, model, "bf16", ACCUM, world, window)
        for key, value in window_checks(engine, stage, got, g, rank, world, comm).items():
            out[key] = worst(out[key], value) if key in out else value
    out.update(bytes_per_element=bytes_per_element(engine, stage, ACCUM),
               ledger_after_step=engine.memory_report()["ledger"],
               padded_elements=engine.num_parameters + engine.padding_elements)
    engine.destroy()
    return out


def worst(a: dict, b: dict) -> dict:
    return {"max_abs": max(a["max_abs"], b["max_abs"]), "rel": max(a["rel"], b["rel"]),
            "dtypes": sorted(set(a["dtypes"]) | set(b["dtypes"]))}


def window_checks(engine, stage, got, g, rank, world, comm) -> dict:
    keys = [(r, m) for r in range(world) for m in range(ACCUM)]
    exact = sum_refs(g, keys)
    out = {"vs_exact_sum": compare(got, owned_reference(engine, exact, rank, world))}
    if comm is None:
        # DeepSpeed's default communication dtype is bf16: what fp32 accumulation promises
        # then is each reduction rounded to bf16 once and those summed in fp32 — stage 1
        # sums each rank's micro-steps locally in fp32 first (order m = 0, 1, ...) and
        # reduces once at the boundary
        if stage >= 2:
            semantic = {i: sum(bf16(sum(g[(r, m)][i] for r in range(world)))
                               for m in range(ACCUM)) for i in exact}
        else:
            local = {(r, i): _fp32_sum([g[(r, m)][i] for m in range(ACCUM)])
                     for r in range(world) for i in exact}
            semantic = {i: bf16(sum(bf16(local[(r, i)]) for r in range(world)))
                        for i in exact}
        out["vs_fp32_accumulation"] = compare(got, owned_reference(engine, semantic, rank,
                                                                    world))
    return out


def _fp32_sum(vectors):
    acc = torch.zeros_like(vectors[0], dtype=torch.float32)
    for v in vectors:
        acc += v.float()
    return acc.double()


def refusal(stage, **kw):
    try:
        engine, _ = make_engine(stage, "bf16", 1, **kw)
    except ConfigError as e:
        return str(e)
    engine.destroy()
    return None


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rt = zero_core.get_runtime()
    rank, world = rt.rank, rt.world_size
    out = {"world": world}
    for stage in (0, 1, 2, 3):
        s = f"s{stage}"
        out[f"comm32/{s}"] = scenario_comm(stage, seed, rank, world, "bf16", "fp32")
        out[f"comm16/{s}"] = scenario_comm(stage, seed, rank, world, "fp32", "bf16")
        if stage == 0:
            out["refused/s0_accum"] = refusal(0, accum="fp32")
            continue
        out[f"acc32_comm32/{s}"] = scenario_accum(stage, seed, rank, world, "fp32", "fp32")
        out[f"acc32/{s}"] = scenario_accum(stage, seed, rank, world, "fp32", None)
        out[f"acc16/{s}"] = scenario_accum(stage, seed, rank, world, None, None)
    out["refused/s3_qgz"] = refusal(3, comm="fp32", qgz=True)
    report(out)


if __name__ == "__main__":
    main()
