"""ZenFlow (zero_optimization.zenflow) against plain ZeRO-Offload, side by side in one run.

    python ci/bench/zenflow.py [--accelerators cpu,vdev] [--layers 6] [--width 1024]
                               [--steps 12] [--update-interval 4] [--json out.json]

One rank per accelerator (a process each: one accelerator per process), stage 2,
``offload_optimizer.device: cpu``, an MLP of ``--layers`` Linear(width, width) layers trained
on a fixed random teacher. In the same process, one after the other and then again in the
reverse order (A B C C B A, so drift of the machine hits every mode alike), each mode trains
``--steps`` measured steps after 2 unmeasured ones:

* ``offload``: plain offloaded Adam, host step every step;
* ``zenflow``: topk_ratio 0.1, update_interval U, host update every U steps, inline;
* ``zenflow_overlap``: the same with ``overlap_step``: the host update on a worker thread.

Printed (markdown; JSON to --json): median ms per step, the ratio to ``offload``, the host
bytes per step copied each way (the engine's ledger, ``comm_report()["transfers"]``; 0 on
the cpu accelerator, where host and device are one memory), the
mean time per step the training thread waited for the host update (overlap), the loss after
the measured steps, and the machine's load average before and after (other work shares it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

MODES = ("offload", "zenflow", "zenflow_overlap")


def config(mode: str, accelerator: str, interval: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 32, "accelerator": accelerator,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "safety": {"launcher_notice": False}}
    if mode != "offload":
        cfg["zero_optimization"]["zenflow"] = {
            "topk_ratio": 0.1, "update_interval": interval,
            "overlap_step": mode == "zenflow_overlap"}
    return cfg


def worker(settings: dict) -> None:
    """One rank: every mode on the accelerator named in *settings*."""
    import torch

    import zero_core
    from zero_core.testing.ranks import report
    torch.manual_seed(0)
    width, layers = settings["width"], settings["layers"]
    teacher = torch.nn.Linear(width, width)
    x = torch.randn(32, width)
    y = teacher(x).detach()

    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(*[m for _ in range(layers)
                                     for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])

    engines = {}
    for mode in MODES:
        engines[mode], *_ = zero_core.initialize(
            model=make(), config=config(mode, settings["accelerator"], settings["interval"]))
    times = {m: [] for m in MODES}
    losses, transfers = {}, {}

    def run(mode, steps, measure):
        e = engines[mode]
        for i in range(steps):
            start = time.perf_counter()
            loss = torch.nn.functional.mse_loss(e(x), y.to(e.device))
            e.backward(loss)
            e.step()
            e.runtime.accelerator.synchronize()
            if measure:
                times[mode].append(time.perf_counter() - start)
                if i:  # the ledger is the process's: a block's first step also counts the
                    # other engines' copies since this engine's last step
                    transfers.setdefault(mode, []).append(e.comm_report().get("transfers", {}))
        losses[mode] = float(loss)

    load_before = os.getloadavg()
    for mode in MODES:
        run(mode, 2, False)
    half = settings["steps"] // 2
    for mode in MODES + MODES[::-1]:
        run(mode, half, True)
    load_after = os.getloadavg()
    rows = {}
    for mode in MODES:
        opt = engines[mode].optimizer
        waits = getattr(opt, "stats", {}).get("host_wait_s", 0.0)
        steps = len(times[mode]) + 2
        rows[mode] = {"ms_per_step": 1000 * statistics.median(times[mode]),
                      "loss": losses[mode], "host_wait_ms_per_step": 1000 * waits / steps,
                      "transfers": transfers[mode]}
        engines[mode].destroy()
    report({"accelerator": settings["accelerator"], "rows": rows,
            "load_before": load_before, "load_after": load_after,
            "params": sum(p.numel() for p in make().parameters())})


def per_step_mb(records: list) -> tuple[float, float]:
    """The ledger's transfers of the measured steps ([{what: {"h2d", "d2h"}}, ...]) -> mean
    MB per step host-to-device, device-to-host."""
    def total(rec, direction):
        return sum(d.get(direction, 0) for d in rec.values()) / 1e6
    return (statistics.mean(total(r, "h2d") for r in records),
            statistics.mean(total(r, "d2h") for r in records))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accelerators", default="cpu,vdev")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--update-interval", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json")
    args = ap.parse_args()
    from zero_core.testing.ranks import run_ranks
    results = []
    for acc in args.accelerators.split(","):
        settings = {"accelerator": acc, "layers": args.layers, "width": args.width,
                    "steps": args.steps, "interval": args.update_interval}
        env = {"ZERO_CORE_COMM": "gloo", "OMP_NUM_THREADS": str(args.threads)}
        if acc == "vdev":
            env["VDEV_ASYNC"] = "1"
        (r,) = run_ranks(__file__, 1, "torchrun", args=["--worker", json.dumps(settings)],
                         env=env, timeout=1800)
        results.append(r.report)
    print(f"{results[0]['params'] / 1e6:.1f}M parameters, stage 2, 1 rank, "
          f"OMP_NUM_THREADS={args.threads}, update_interval {args.update_interval}, "
          f"topk_ratio 0.1, {args.steps} measured steps per mode\n")
    print("| accelerator | mode | ms/step (median) | vs offload | host wait ms/step | "
          "MB/step host->device / device->host | loss after |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        base = res["rows"]["offload"]["ms_per_step"]
        for mode in MODES:
            row = res["rows"][mode]
            h2d, d2h = per_step_mb(row["transfers"])
            print(f"| {res['accelerator']} | {mode} | {row['ms_per_step']:.1f} | "
                  f"{row['ms_per_step'] / base:.2f} | {row['host_wait_ms_per_step']:.1f} | "
                  f"{h2d:.1f} / {d2h:.1f} | {row['loss']:.4f} |")
    for res in results:
        print(f"\nload average ({res['accelerator']} run) before "
              f"{res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f} "
              f"(1 min; {os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
