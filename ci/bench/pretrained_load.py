"""Peak memory per rank of ``from_pretrained`` into stage-3 partitions, next to the
partition and the full model, and next to transformers' own loading.

    python ci/bench/pretrained_load.py              # GPT-2 shape, 8 layers x 512, 2 ranks
    python ci/bench/pretrained_load.py --layers 12 --width 768 --ranks 4

A GPT-2 built from a config (nothing downloaded) is saved with transformers' own
``save_pretrained`` (sharded), then loaded on N local ranks (gloo) twice, each in a fresh
launch: by zero-core's ``from_pretrained`` at stage 3 and by ``transformers``'
``from_pretrained``. Two figures per rank: the loader's own ledger peak (what it allocated,
``model.zero_core_load_report``) and the growth of the process's resident set across the
load (the high-water mark VmHWM, reset just before the load, minus the RSS then), which also sees what the ledger does not (the
model built one module at a time under ``zero_core.Init``, the allocator's slack).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

MIB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Linux: restart the process's resident-set high-water mark (VmHWM) from the current
    RSS, so that the peak read later belongs to the load, not to the imports before it."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        kib = next(line.split()[1] for line in fh if line.startswith("VmHWM:"))
    return int(kib) * 1024


def worker(path: str, how: str) -> None:
    import torch  # noqa: F401  (imported before the baseline is taken)
    import transformers
    import zero_core
    from zero_core.integrations.transformers import from_pretrained
    from zero_core.testing.ranks import leave_rank, report
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "comm_backend": "gloo"}
    zero_core.init_distributed(comm_backend="gloo")
    # the model's code is imported lazily by both loaders: import it before the baseline
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    reset_peak_rss()
    before = rss_bytes()
    if how == "zero-core":
        model = from_pretrained(path, config=cfg)
        ledger = model.zero_core_load_report
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        ledger = None
    grown = peak_rss_bytes() - before
    report({"rss_growth": grown, "ledger": ledger})
    del model
    leave_rank()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--worker", nargs=2, metavar=("PATH", "HOW"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from zero_core.testing.ranks import run_ranks
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64))
    with tempfile.TemporaryDirectory() as tmp:
        model = GPT2LMHeadModel(config)
        # tied tensors (GPT-2's lm_head is its embedding) count once
        unique = {t.data_ptr(): t for t in model.state_dict().values() if t.is_floating_point()}
        full = sum(t.numel() * t.element_size() for t in unique.values())
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp, max_shard_size="100MB")
        del model
        print(f"GPT-2 {args.layers} layers x {args.width}: {n_params / 1e6:.1f} M parameters, "
              f"{full / MIB:.0f} MiB in fp32; {args.ranks} ranks", flush=True)
        rows = {}
        for how in ("zero-core", "transformers"):
            res = run_ranks(os.path.abspath(__file__), args.ranks, "torchrun",
                            args=["--worker", tmp, how], timeout=900)
            rows[how] = [r.report for r in res]
    print("| loader | rank | RSS growth during the load | loader's ledger peak | its partition | full model |")
    print("|---|---|---|---|---|---|")
    for how, reps in rows.items():
        for rank, rep in enumerate(reps):
            led = rep["ledger"]
            ledger = (f"{led['peak_bytes'] / MIB:.1f} MiB", f"{led['partition_bytes'] / MIB:.1f} MiB") \
                if led else ("—", "—")
            print(f"| {how} | {rank} | {rep['rss_growth'] / MIB:.1f} MiB "
                  f"({rep['rss_growth'] / full:.2f}× the model) | {ledger[0]} | {ledger[1]} | "
                  f"{full / MIB:.1f} MiB |")


if __name__ == "__main__":
    sys.exit(main())
