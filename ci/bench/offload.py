"""The largest GPT (examples/gpt.py scaled in width and depth) that trains a few steps on
this machine: ZeRO stage 3 alone vs stage 3 + ZeRO-Infinity (optimizer states, master
weights and parameters offloaded to files on a local disk).

    python ci/bench/offload.py [--ranks 4] [--steps 3] [--nvme-dir /work/offload_bench]
                               [--budget-gb 14] [--json out.json]
    python ci/bench/offload.py --replot docs/images/offload.json   # redraw the chart only
    ZERO_CORE_ACCELERATOR=vdev python ci/bench/offload.py --accelerations [--rounds 5]
                                      [--accel-nvme DIR]
        # plain offload beside ratio < 1 and super_offload (accelerations()); with
        # --accel-nvme also the same with the states in swap files under DIR

Bounded time: each mode tries an explicit, increasing list of sizes (``--stage3-sizes``,
``--nvme-sizes``, as LAYERSxWIDTH) and stops at the first size that does not fit; a size
gets ``--timeout`` seconds. Bounded memory: a watchdog thread in every rank stops the
rank when its resident set exceeds budget / ranks (reported as out of memory budget) or
when the machine's MemAvailable falls below ``--min-available-gb`` (other work shares the
machine), and RLIMIT_DATA (the whole budget) stops a runaway allocation at once; so a
size that does not fit never pushes the machine into the OOM killer.

Printed (markdown; JSON to --json, the chart to --plot, default docs/images/offload.json and
.png, ci/bench/plots.py): per size, parameters, whether it trained,
build and step times, peak RSS per rank, and for the offloaded runs the bytes read and
written per rank in the last step against the theoretical volume for fp32 Adam:
optimizer read = written = 12Ψ/N (master, exp_avg, exp_avg_sq), parameters written 4Ψ/N
and read 12Ψ/N (each unit's partition in forward, in the recompute of its checkpointed
block, and in backward). Both modes checkpoint every block's activations (otherwise
autograd keeps every gathered weight alive until backward, see stage3/gather.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import plots  # noqa: E402  (JSON and PNG beside the table)

from zero_core.testing.ranks import run_ranks  # noqa: E402

WORKER = os.path.join(HERE, "workers", "offload_gpt.py")
GIB = 1 << 30


def parse_sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        layers, width = item.lower().split("x")
        out.append((int(layers), int(width)))
    return out


def approx_params(layers: int, width: int, seq: int, vocab: int = 256) -> int:
    """GPT parameters: 12·L·d² weights + biases/norms + token and position embeddings."""
    return layers * (12 * width * width + 13 * width) + (vocab + seq) * width + 2 * width


def run_size(mode, layers, width, args) -> dict:
    nvme_dir = os.path.join(args.nvme_dir, f"{mode}_{layers}x{width}")
    os.makedirs(nvme_dir, exist_ok=True)
    settings = {"n_layer": layers, "n_embd": width, "mode": mode, "nvme_dir": nvme_dir,
                "steps": args.steps, "seq": args.seq, "sub_group_size": args.sub_group_size,
                "rss_limit": int(args.budget_gb * GIB / args.ranks),
                "data_limit": int(args.budget_gb * GIB),
                "min_available": int(args.min_available_gb * GIB)}
    t = time.perf_counter()
    try:
        results = run_ranks(WORKER, args.ranks, "torchrun", args=[json.dumps(settings)],
                            env={"ZERO_CORE_COMM": "gloo",
                                 # freed large blocks go back to the system at once (glibc
                                 # otherwise keeps them, raising the threshold on each free)
                                 "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)},
                            timeout=args.timeout, check=False)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    reports = [r.report for r in results]
    row = {"mode": mode, "layers": layers, "width": width,
           "approx_params": approx_params(layers, width, args.seq),
           "wall_s": time.perf_counter() - t}
    ok = all(r is not None and r.get("ok") for r in reports) and all(
        r.returncode == 0 for r in results)
    row["ok"] = ok
    if not ok:
        whys = sorted({(r or {}).get("why") or f"exit {res.returncode}"
                       for r, res in zip(reports, results)})
        row["why"] = "; ".join(str(w) for w in whys)
        tail = results[0].log[-1500:] if results else ""
        row["log_tail"] = tail
        return row
    r0 = reports[0]
    row.update(num_parameters=r0["num_parameters"], build_s=r0["build_s"],
               step_s=[max(r["step_s"][i] for r in reports) for i in range(args.steps)],
               peak_rss_gib=[r["peak_rss"] / GIB for r in reports],
               loss=r0["loss"])
    if r0["io_last_step"] is not None:
        psi, n = r0["num_parameters"], args.ranks
        io = {k: sum(r["io_last_step"][k] for r in reports) / n
              for k in ("optimizer_read", "optimizer_written", "params_read", "params_written")}
        io["theory_optimizer"] = 12 * psi / n
        io["theory_params_read"] = 12 * psi / n
        io["theory_params_written"] = 4 * psi / n
        io["host_bytes"] = r0["io_last_step"]["host_bytes"]
        io["staging_bytes"] = r0["io_last_step"]["staging_bytes"]
        io["disk_bytes_per_rank"] = r0["io_last_step"]["disk_bytes"]
        io["direct_io"] = r0["io_last_step"]["direct_io"]
        row["io_per_rank"] = io
    return row


def markdown(rows) -> str:
    lines = ["| mode | layers×width | parameters | trained | build s | step s (1..n) | "
             "peak RSS/rank GiB | opt read/written per rank GB (theory) | "
             "param read/written per rank GB (theory) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        params = r.get("num_parameters", r["approx_params"])
        if not r["ok"]:
            lines.append(f"| {r['mode']} | {r['layers']}×{r['width']} | {params / 1e9:.2f} B | "
                         f"no: {r['why'][:60]} | | | | | |")
            continue
        steps = " / ".join(f"{s:.0f}" for s in r["step_s"])
        rss = f"{max(r['peak_rss_gib']):.2f}"
        opt = par = "—"
        if "io_per_rank" in r:
            io = r["io_per_rank"]
            opt = (f"{io['optimizer_read'] / 1e9:.2f} / {io['optimizer_written'] / 1e9:.2f} "
                   f"({io['theory_optimizer'] / 1e9:.2f})")
            par = (f"{io['params_read'] / 1e9:.2f} / {io['params_written'] / 1e9:.2f} "
                   f"({io['theory_params_read'] / 1e9:.2f} / "
                   f"{io['theory_params_written'] / 1e9:.2f})")
        lines.append(f"| {r['mode']} | {r['layers']}×{r['width']} | {params / 1e9:.2f} B | yes | "
                     f"{r['build_s']:.0f} | {steps} | {rss} | {opt} | {par} |")
    return "\n".join(lines)


ACCEL_MODES = {"plain offload": {}, "super_offload": {"super_offload": True},
               "ratio 0.5": {"ratio": 0.5}, "ratio 0.5 + super_offload":
               {"ratio": 0.5, "super_offload": True}}


def accel_modes(nvme_dir) -> dict:
    """ACCEL_MODES with device cpu, and with *nvme_dir* the same on swap files there."""
    modes = {name: {"device": "cpu", **extra} for name, extra in ACCEL_MODES.items()}
    if nvme_dir:
        os.makedirs(nvme_dir, exist_ok=True)
        modes.update({f"nvme: {name}": {"device": "nvme", "nvme_path": nvme_dir, **extra}
                      for name, extra in ACCEL_MODES.items()})
    return modes


def accelerations(args) -> str:
    """Plain offload beside its accelerations (offload/partial.py, offload/speculative.py):
    one process, one engine per mode built once, the modes timed in turn for
    ``--rounds`` rounds (so machine load hits them alike); the median seconds per optimizer
    step (forward, backward, step) and the ratio to plain offload."""
    import statistics
    import torch
    import zero_core
    width, layers = args.accel_width, args.accel_layers
    engines = {}
    for name, off in accel_modes(args.accel_nvme).items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
               "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
               "zero_optimization": {"stage": 3, "sub_group_size": args.accel_sub_group,
                                     "offload_optimizer": off}}
        engines[name] = zero_core.initialize(model=model, config=cfg)[0]
    times = {name: [] for name in engines}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds + 1):   # round 0 warms up; then A B C D, D C B A, ...
        for name, eng in (list(engines.items())[::-1] if r % 2 == 0 else engines.items()):
            x = torch.randn(8, width, dtype=torch.bfloat16).to(eng.device)
            t0 = time.perf_counter()
            for _ in range(args.steps if r else 1):
                loss = eng(x).float().square().mean()
                eng.backward(loss)
                eng.step()
            eng.runtime.accelerator.synchronize()
            if r:
                times[name].append((time.perf_counter() - t0) / args.steps)
        load.append(os.getloadavg()[0])
    device = next(iter(engines.values())).device
    lines = [f"stage 3, bf16, {layers} x Linear({width}, {width}) "
             f"({layers * (width * width + width) / 1e6:.1f} M parameters), sub_group_size "
             f"{args.accel_sub_group}, device {device}, warm-up step, then {args.rounds} "
             f"rounds x {args.steps} steps (mode order alternating); 1-min load average {min(load):.1f}-{max(load):.1f} on "
             f"{os.cpu_count()} cores", "",
             "| mode | s/step (median) | vs plain offload | speculations accepted/redone/"
             "rolled back | host steps started during backward |", "|---|---|---|---|---|"]
    for name, eng in engines.items():
        med = statistics.median(times[name])
        # against plain offload to the same device (cpu or nvme)
        base = statistics.median(times["nvme: plain offload" if name.startswith("nvme")
                                       else "plain offload"])
        rep = eng.memory_report()["offload"]
        c = rep.get("super_offload")
        spec = f"{c['accepted']}/{c['redone']}/{c['rolled_back']}" if c else "-"
        early = (f"{c['started_in_backward']} of "
                 f"{c['speculated'] * (rep['subgroups'] - rep['device_subgroups'])}" if c else "-")
        lines.append(f"| {name} | {med:.4f} | {med / base:.2f}x | {spec} | {early} |")
    for eng in engines.values():
        eng.destroy()
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accelerations", action="store_true",
                    help="only: plain offload vs ratio < 1 and super_offload, one process "
                         "(ZERO_CORE_ACCELERATOR picks the device)")
    ap.add_argument("--accel-width", type=int, default=1024)
    ap.add_argument("--accel-layers", type=int, default=4)
    ap.add_argument("--accel-sub-group", type=int, default=1 << 20)
    ap.add_argument("--accel-nvme", default=None,
                    help="--accelerations: also time the modes with the states in swap files "
                         "in this directory")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--nvme-dir", default="/work/offload_bench")
    ap.add_argument("--budget-gb", type=float, default=10.0,
                    help="resident memory for all ranks together (each rank: budget/ranks)")
    ap.add_argument("--min-available-gb", type=float, default=2.5,
                    help="stop a run when the machine's MemAvailable drops below this")
    ap.add_argument("--stage3-sizes", default="6x2048,7x2048,8x2048,9x2048")
    ap.add_argument("--nvme-sizes", default="20x2048,24x2048,26x2048,28x2048,30x2048")
    ap.add_argument("--sub-group-size", type=int, default=4_000_000,
                    help="elements per offloaded optimizer sub-group (3 slots of 3 states)")
    ap.add_argument("--modes", default="stage3,nvme")
    ap.add_argument("--mmap-threshold", type=int, default=1 << 20,
                    help="MALLOC_MMAP_THRESHOLD_ for the ranks (both modes), bytes")
    ap.add_argument("--timeout", type=float, default=1500)
    plots.add_arguments(ap, "offload")
    args = ap.parse_args(argv)
    if args.accelerations:
        print(accelerations(args))
        return 0
    meta = plots.start(args, "offload", __file__, sys.argv[1:] if argv is None else argv)
    os.makedirs(args.nvme_dir, exist_ok=True)
    free = shutil.disk_usage(args.nvme_dir).free
    print(f"# offload bench: {args.ranks} ranks, budget {args.budget_gb} GiB, disk free at "
          f"{args.nvme_dir}: {free / GIB:.0f} GiB", flush=True)
    rows = []
    sizes = {"stage3": parse_sizes(args.stage3_sizes), "nvme": parse_sizes(args.nvme_sizes)}
    for mode in args.modes.split(","):
        for layers, width in sizes[mode]:
            need = 16 * approx_params(layers, width, args.seq) * 1.1
            if mode == "nvme" and need > free:
                rows.append({"mode": mode, "layers": layers, "width": width, "ok": False,
                             "approx_params": approx_params(layers, width, args.seq),
                             "why": f"needs ~{need / GIB:.0f} GiB of disk, {free / GIB:.0f} free"})
                break
            row = run_size(mode, layers, width, args)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
            if not row["ok"]:
                break
    print(markdown(rows))
    for mode in sizes:
        done = [r for r in rows if r["mode"] == mode and r["ok"]]
        if done:
            best = max(done, key=lambda r: r["num_parameters"])
            print(f"largest {mode}: {best['num_parameters'] / 1e9:.2f} B parameters")
    ok3 = [r["num_parameters"] for r in rows if r["mode"] == "stage3" and r["ok"]]
    okn = [r["num_parameters"] for r in rows if r["mode"] == "nvme" and r["ok"]]
    if ok3 and okn:
        print(f"ratio nvme / stage3: {max(okn) / max(ok3):.2f}x")
    print()
    plots.finish(args, "offload", {"benchmark": "offload", "ranks": args.ranks,
                                   "budget_gb": args.budget_gb, "steps": args.steps,
                                   "seq": args.seq, "results": rows}, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
