"""The main job: train a small GPT on the Python standard library's source with zero-core.

Run on 2 local CPU ranks::

    mpirun -np 2 python examples/train_gpt.py                     # MPI carries ZeRO's traffic
    torchrun --nproc-per-node 2 examples/train_gpt.py --comm gloo  # torch.distributed (gloo)

Rank 0 shows a progress bar (loss, tokens/s, step time) on stderr, prints the validation loss
before and after training, and finishes with every rank's memory report (measured bytes next
to the ZeRO formula) and communication report (bytes per collective, from the ledger).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import zero_core
from zero_core.progress import ProgressBar

# the example modules sit next to this file; running it as a script puts them on sys.path,
# importing it (tests) may not
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import build_model, lm_loss  # noqa: E402
from text_data import GlobalBatchSampler, load_stdlib_text, validation_batches  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage")
    p.add_argument("--zeropp", action="store_true",
                   help="ZeRO++ (stage 3): qwZ int8 weight all-gather, hpZ secondary partition "
                        "inside a node, qgZ int4 gradient all-to-all")
    p.add_argument("--mics", type=int, default=-1, metavar="G",
                   help="MiCS (stages 1-3): one copy of the model states per group of G ranks "
                        "(normally the ranks per node), replicated across groups; -1: off")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none",
                   help="where the optimizer states live (ZeRO-Offload / ZeRO-Infinity)")
    p.add_argument("--nvme-path", default=None,
                   help="directory for --offload nvme (default: a temporary directory)")
    p.add_argument("--accelerator", default=None,
                   help="cpu, cuda, hpu, xpu, vdev (examples/vdev) or a plugin's (default: "
                        "ZERO_CORE_ACCELERATOR, else auto-detection)")
    p.add_argument("--comm", choices=("gloo", "mpi", "oneccl"), default=None,
                   help="communication backend (default: the CPU accelerator's: mpi under mpirun, else gloo)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--model", choices=("tiny", "small", "bench"), default="small",
                   help="model preset from examples/gpt.py")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
    p.add_argument("--val-sequences", type=int, default=32,
                   help="validation sequences (split across ranks)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: OMP_NUM_THREADS, else cores / local ranks)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (summary lines only)")
    p.add_argument("--save-dir", default=None,
                   help="save checkpoints here and resume from the newest one at start "
                        "(a restarted job carries on: see README 'When a rank dies')")
    p.add_argument("--save-interval", type=int, default=50, help="optimizer steps between saves")
    p.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training goes on")
    p.add_argument("--step-log", default=None,
                   help="rank 0 appends one JSON line per optimizer step (step, loss, time)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.micro_batch < 1 or args.grad_accum < 1:
        p.error("--steps, --micro-batch and --grad-accum must be at least 1")
    return args


def build_config(args: argparse.Namespace) -> dict:
    """The DeepSpeed-style configuration this run hands to zero_core.initialize."""
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": float("inf"),  # the progress bar shows the steps (and the lr)
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                 "weight_decay": 0.1}},
        # linear warm-up, then cosine decay to 10% of the peak rate
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.steps, "warmup_num_steps": min(warmup, args.steps),
                                 "warmup_type": "linear", "warmup_min_ratio": 0.0,
                                 "cos_min_ratio": 0.1}},
        "zero_optimization": {"stage": args.stage, "overlap_comm": True,
                              "reduce_bucket_size": 5_000_000},
    }
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif args.precision == "fp16":
        cfg["fp16"] = {"enabled": True}
    if args.comm:
        cfg["comm_backend"] = args.comm
    if args.accelerator:
        cfg["accelerator"] = args.accelerator
    if args.zeropp:
        if args.stage != 3:
            raise SystemExit("--zeropp needs --stage 3 (ZeRO++ extends stage 3)")
        cfg["zero_optimization"].update(zero_quantized_weights=True, zero_quantized_gradients=True,
                                        zero_hpz_partition_size=_ranks_per_node())
    if args.mics != -1:
        cfg["zero_optimization"]["mics_shard_size"] = args.mics
    if args.save_dir:
        cfg["checkpoint"] = {"save_dir": args.save_dir, "save_interval_steps": args.save_interval,
                             "async_save": args.async_save, "keep_last": 2}
    if args.offload != "none":
        if args.stage == 0:
            raise SystemExit("--offload needs --stage 1, 2 or 3")
        offload = {"device": args.offload}
        if args.offload == "nvme":
            offload["nvme_path"] = args.nvme_path or tempfile.gettempdir()
        cfg["zero_optimization"]["offload_optimizer"] = offload
    return cfg


def _ranks_per_node() -> int:
    """Ranks per (possibly emulated) node: hpZ keeps its secondary partition inside one."""
    from zero_core.runtime.launch import discover
    from zero_core.runtime.topology import resolve_ranks_per_node
    launch = discover()
    return resolve_ranks_per_node(launch.world_size, launch.local_world_size).ranks_per_node


def default_threads(args: argparse.Namespace) -> int:
    """Threads per rank: ranks on one machine share its cores, so do not oversubscribe them."""
    if args.threads:
        return args.threads
    if os.environ.get("OMP_NUM_THREADS"):
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or 1)
    return max(1, (os.cpu_count() or 1) // local)


def mean_over_ranks(value: float) -> float:
    """Average a Python float over all ranks (torch.distributed is up under every backend)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@torch.no_grad()
def validation_loss(model: torch.nn.Module, val_x: torch.Tensor, val_y: torch.Tensor,
                    rank: int, world: int) -> float:
    """Mean next-token loss (nats) on the fixed validation set; each rank scores its share."""
    was_training = model.training
    model.eval()
    mine = slice(rank, None, world)  # strided split: every rank gets a share when n >= world
    device = next(model.parameters()).device
    x, y = val_x[mine].to(device), val_y[mine].to(device)
    # a weighted mean, so unequal shares still give the loss over the whole set
    local = lm_loss(model(x), y).item() * x.shape[0] if x.shape[0] else 0.0
    model.train(was_training)
    total = torch.tensor([local, float(x.shape[0])], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def _flatten(report, prefix: str = "") -> dict:
    """Nested dicts -> {"a.b": leaf}; lists of scalars are kept as one cell."""
    if not isinstance(report, dict):
        return {prefix or "value": report}
    flat = {}
    for key, value in report.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        flat.update(_flatten(value, name) if isinstance(value, dict) else {name: value})
    return flat


def _cell(name: str, value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int) and "bytes" in name.lower():
        return f"{value / 2**20:,.2f} MiB"
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_rank_table(reports: list) -> str:
    """One row per report field, one column per rank; byte counts shown in MiB."""
    flats = [_flatten(r) for r in reports]
    names = list(dict.fromkeys(k for f in flats for k in f))
    header = ["", *(f"rank {i}" for i in range(len(flats)))]
    rows = [[n, *(_cell(n, f.get(n, "")) for f in flats)] for n in names]
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) if c == 0 else str(v).rjust(w)
                       for c, (v, w) in enumerate(zip(r, widths))) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


MIB = 2**20
# ARCHITECTURE §4: model-state bytes per rank for Adam, Ψ parameters, N ranks
FORMULA_TEXT = {("fp32", 0): "16Ψ", ("fp32", 1): "8Ψ + 8Ψ/N", ("fp32", 2): "4Ψ + 12Ψ/N",
                ("fp32", 3): "16Ψ/N",
                ("mixed", 0): "16Ψ", ("mixed", 1): "4Ψ + 12Ψ/N", ("mixed", 2): "2Ψ + 14Ψ/N",
                ("mixed", 3): "16Ψ/N"}
MODEL_STATE_ROWS = (("parameters", "parameters"), ("gradients", "gradients"),
                    ("master_weights", "fp32 master weights"),
                    ("optimizer_states", "optimizer states (Adam m, v)"))


def _table(header: list, rows: list) -> str:
    """Left-aligned first column, right-aligned others, a rule under the header."""
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]
    fmt = lambda r: "  ".join(str(v).ljust(w) if c == 0 else str(v).rjust(w)  # noqa: E731
                               for c, (v, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def format_memory_table(reports: list, stage: int, precision: str, world: int,
                        copies: int = 1) -> str:
    """Per-rank bytes the engine allocated, next to ARCHITECTURE §4's formula, in MiB;
    *world*: the ranks one copy of the model states is spread over (MiCS: the shard group),
    *copies*: how many such copies the job holds."""
    if not all(isinstance(r, dict) and "ledger" in r for r in reports):
        return "memory per rank\n" + format_rank_table(reports)
    formula = reports[0].get("formula") or {}
    psi = reports[0].get("num_parameters", 0)
    header = ["memory per rank (MiB)", *(f"rank {i}" for i in range(len(reports))), "formula"]
    mib = lambda v: "–" if v is None else f"{v / MIB:,.2f}"  # noqa: E731
    rows = [[label, *(mib(r["ledger"].get(key)) for r in reports), mib(formula.get(key))]
            for key, label in MODEL_STATE_ROWS]
    rows.append(["= model states", *(mib(r["ledger"].get("model_states")) for r in reports),
                 mib(formula.get("model_states"))])
    rows.append(["communication buffers",
                 *(mib(r["ledger"].get("communication_buffers")) for r in reports), "–"])
    # the accelerator's peak: the process's resident memory on the CPU, the device
    # allocator's peak elsewhere
    device = reports[0].get("device", "cpu")
    rows.append(["process resident memory (peak)" if device == "cpu"
                 else f"{device.split(':')[0]} memory allocated (peak)",
                 *(mib((r.get("accelerator") or {}).get("peak")) for r in reports), "–"])
    kind = "fp32" if precision == "fp32" else "mixed"
    title = (f"ZeRO stage {stage}, {precision}: model states per rank = "
             f"{FORMULA_TEXT[(kind, stage)]} with Ψ = {psi:,} parameters, N = {world} ranks"
             + (f" (MiCS: {copies} copies)" if copies > 1 else ""))
    return title + "\n" + _table(header, rows)


def format_comm_table(reports: list, stage: int, precision: str, world: int) -> str:
    """Bytes each rank sent in the last optimizer step, by collective, from the ledger."""
    if not all(isinstance(r, dict) and "ops" in r for r in reports):
        return "communication per rank\n" + format_rank_table(reports)
    ops = list(dict.fromkeys(op for r in reports for op in r["ops"]))
    header = ["last step, per rank", *(f"rank {i} sent (MiB)" for i in range(len(reports))),
              "calls"]
    rows = [[op, *(f"{r['ops'].get(op, {}).get('sent_bytes', 0) / MIB:,.2f}" for r in reports),
             reports[0]["ops"].get(op, {}).get("calls", 0)] for op in ops]
    rows.append(["= total", *(f"{r.get('sent_bytes', 0) / MIB:,.2f}" for r in reports), ""])
    if any(r.get("staged_bytes") for r in reports):
        rows.append(["staged host<->device (copies)",
                     *(f"{r.get('staged_bytes', 0) / MIB:,.2f}" for r in reports), ""])
    try:
        from zero_core.memory import comm_bytes_per_step
        psi = reports[0].get("num_parameters")
    except ImportError:
        psi = None
    text = "communication per rank (from the ledger)"
    if psi:
        expected = comm_bytes_per_step(stage, psi, world, precision)
        label = ("expected (at most 3Ψ elements, ring)" if stage == 3
                 else "expected (2Ψ elements, ring)")
        rows.append([label, *([f"{expected / MIB:,.2f}"] * len(reports)), ""])
    return text + "\n" + _table(header, rows)


def gather_to_rank0(obj):
    """Every rank's *obj* as a list on rank 0 (None elsewhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(default_threads(args))
    torch.manual_seed(args.seed)  # same initial weights on every rank

    model = build_model(args.model, seed=args.seed)
    engine, _optimizer, _, lr_scheduler = zero_core.initialize(
        model=model, model_parameters=model.parameters(), config=build_config(args))
    rank, world = engine.global_rank, engine.world_size
    is_main = rank == 0

    text = load_stdlib_text()
    seq_len = model.cfg.block_size
    # a resumed run may accumulate more steps than asked (the global batch is kept on fewer
    # ranks): the engine's value counts; the data of a step depend only on the step
    grad_accum = engine.gradient_accumulation_steps
    first_step = engine.global_steps  # > 0 when checkpoint.resume loaded a checkpoint
    sampler = GlobalBatchSampler(text.train, seq_len, args.micro_batch, world, grad_accum,
                                 seed=args.seed)
    val_x, val_y = validation_batches(text.val, seq_len, args.val_sequences)
    eval_model = getattr(engine, "module", model)
    tokens_per_step = sampler.global_batch * seq_len

    def say(msg: str) -> None:
        if is_main:
            print(msg, flush=True)

    say(f"zero-core demo: GPT '{args.model}' ({model.num_parameters() / 1e6:.2f}M parameters), "
        f"ZeRO stage {args.stage}, {args.precision}, {world} ranks, "
        f"communicator {zero_core.get_runtime().comm.name!r}")
    say(f"data: {text}; global batch {sampler.global_batch} x {seq_len} tokens "
        f"({args.micro_batch}/rank x {grad_accum} accumulation)")
    val_start = validation_loss(eval_model, val_x, val_y, rank, world)
    say(f"validation loss at start: {val_start:.3f}")

    bar = ProgressBar(args.steps, enabled=is_main and not args.quiet)
    step_log = open(args.step_log, "a") if args.step_log and is_main else None
    losses, step_times = [], []
    model.train()
    t_start = time.perf_counter()
    for step in range(first_step, args.steps):
        t0 = time.perf_counter()
        step_loss = 0.0
        for micro in range(grad_accum):
            x, y = sampler.rank_batch(step, rank, micro)
            loss = lm_loss(engine(x), y.to(engine.device))
            engine.backward(loss)
            engine.step()  # DeepSpeed semantics: steps the optimizer at the accumulation boundary
            step_loss += loss.item() / grad_accum
        step_loss = mean_over_ranks(step_loss)
        dt = time.perf_counter() - t0
        losses.append(step_loss)
        step_times.append(dt)
        lr = lr_scheduler.get_last_lr()[0] if lr_scheduler is not None else args.lr
        bar.update(step + 1, {"loss": f"{step_loss:.3f}", "tok/s": f"{tokens_per_step / dt:,.0f}",
                              "s/step": f"{dt:.3f}", "lr": f"{lr:.2e}"})
        if step_log is not None:
            step_log.write(json.dumps({"step": step + 1, "loss": step_loss, "time": time.time(),
                                       "world_size": world, "pid": os.getpid()}) + "\n")
            step_log.flush()
    bar.close()
    engine.wait_for_checkpoint()  # an async save still being written is committed
    elapsed = time.perf_counter() - t_start

    val_end = validation_loss(eval_model, val_x, val_y, rank, world)
    steps_run = args.steps - first_step
    median_step = sorted(step_times)[len(step_times) // 2] if step_times else 0.0
    say(f"validation loss at end:   {val_end:.3f}  (start {val_start:.3f}, "
        f"{'fell' if val_end < val_start else 'did NOT fall'} by {val_start - val_end:.3f})")
    say(f"{steps_run} steps in {elapsed:.1f} s: median step {median_step:.3f} s, "
        f"{tokens_per_step * steps_run / elapsed:,.0f} tokens/s over all ranks"
        + (f" (resumed at step {first_step})" if first_step else ""))

    memory = gather_to_rank0(engine.memory_report())
    # the comm table compares against the formula, which needs Ψ
    comm = gather_to_rank0(dict(engine.comm_report(), num_parameters=engine.num_parameters))
    if is_main:
        print()
        print(format_memory_table(memory, args.stage, args.precision,
                                  engine.build_context.world_size,
                                  world // engine.build_context.world_size))
        print()
        print(format_comm_table(comm, args.stage, args.precision, world))
    return {"rank": rank, "world_size": world, "val_start": val_start, "val_end": val_end,
            "losses": losses, "median_step_s": median_step,
            "communicator": zero_core.get_runtime().comm.name}


if __name__ == "__main__":
    result = main()
    if os.environ.get("ZERO_CORE_REPORT_DIR"):  # launched by zero_core.testing.ranks.run_ranks
        from zero_core.testing.ranks import report
        report(result)
    # Tear down the communicator and torch.distributed before the interpreter exits: a gloo
    # process group still alive at exit can abort the process while Python finalizes.
    from zero_core.runtime.context import shutdown
    shutdown()
