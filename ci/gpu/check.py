#!/usr/bin/env python3
"""zero-core's GPU kit: run the project's GPU checks on one CUDA GPU and write one report.

    python ci/gpu/check.py [--out DIR] [--quick] [--budget SECONDS] [-k SUBSTRING] [--profile]
    python ci/gpu/check.py --device cpu --quick --out /tmp/kit   # dry run, no GPU needed
    bash ci/gpu_check.sh                                           # on the GPU machine

What runs (ci/gpu/check_plan.py lists the checks; each is defined, with its bounds, in the
``*_checks.py`` module of its group next to it):

* conformance/ -- the conformance suite for the cuda accelerator and the nccl communicator
  at world size 1, as ``python -m zero_core.conformance`` (TCP store on localhost), and
  through the Python API after torch.distributed was set up from a FileStore with
  ``cpu:gloo,cuda:nccl``;
* kernels/ -- the Triton quantization kernels bit for bit against quant_reference (fresh
  random inputs); their bandwidth against a device-to-device copy of the same bytes; the
  fused optimizer kernels of the cuda kernel set against optim_reference;
* engine/ -- the engine on cuda at world size 1: stages 0-3 in fp32 and bf16, optimizer
  offload to cpu and nvme, stage-3 parameter offload, ZeRO++ flags (what the engine says
  about each at world size 1 is recorded), each against plain torch on the same GPU (loss
  curve, gradient norm) plus a check that engine tensors are where the config says;
* checkpoint/ -- saved on the GPU, loaded by a second engine on the cpu accelerator in
  another process, weights and optimizer states compared bit for bit;
* ranks/ -- 2 and 4 ranks sharing the one GPU over gloo and MPI with device staging (NCCL
  refuses two ranks on one device): stages, bf16, qwZ/hpZ/qgZ through the Triton kernels,
  offload, a checkpoint saved by 2 GPU ranks and loaded by 4, against plain torch
  (ranks_checks.py);
* bench/ -- step time and peak memory of the examples/gpt.py GPT against torch.optim.AdamW,
  with a torch.profiler summary (host time, device busy time, launches, synchronizations
  per step) of the engine's stages and plain torch's bf16 step.

Each check is independent: checks run in worker processes per group (``--worker``); a check
that raises is recorded as failed with its traceback's last lines; a worker that crashes or
a check that outlives its time cap is recorded as failed and the worker is restarted for
the remaining checks; when the total ``--budget`` is spent the rest are skipped. The result
is ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` (date, GPU, versions, and per check:
status, seconds, numbers). Exit status: 0 when no check failed, 1 otherwise, 2 when the
device is missing.

``--device cpu`` runs the same checks on the cpu accelerator with gloo (Triton under its
interpreter, small sizes) so that the kit itself can be exercised without a GPU;
``--quick`` shrinks sizes and case lists (tests/test_gpu_kit.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))  # this file is ci/gpu/check.py
if HERE not in sys.path:  # the kit's modules sit next to this file
    sys.path.insert(0, HERE)

from check_plan import plan  # noqa: E402
from check_support import Ctx, clean_env, tail  # noqa: E402
from checkpoint_checks import checkpoint_load_main  # noqa: E402

JSON_NAME, MD_NAME = "gpu_check.json", "gpu_check.md"
#: errors after which a process's CUDA context (or NCCL communicator) is unusable
POISONED = re.compile(r"CUDA error|device-side assert|illegal memory access|CUBLAS_STATUS|"
                      r"cudaError|NCCL error|ncclUnhandled|ncclSystemError", re.IGNORECASE)
STATUSES = ("pass", "fail", "refused", "skip")


# ============================================================================ worker side
def _event(state: str, record: dict) -> None:
    with open(state, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _jsonable(obj):
    """Numbers as JSON: floats that are not finite become strings, unknown objects repr."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else str(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return repr(obj)


def run_one(check, ctx) -> dict:
    """Run one check in this process; never raises."""
    t0 = time.perf_counter()
    try:
        out = check.run(ctx) or {}
        failures = list(out.get("failures") or [])
        status = "fail" if failures else out.get("status", "pass")
        result = {"status": status, "detail": out.get("detail", ""),
                  "numbers": out.get("numbers", {}), "failures": failures}
    except Exception as exc:  # noqa: BLE001 - a failing check is a result, not the end
        result = {"status": "fail", "detail": f"{type(exc).__name__}: {str(exc)[:300]}",
                  "numbers": {}, "failures": [f"{type(exc).__name__}: {exc}"],
                  "traceback": tail(traceback.format_exc(), 15)}
    result.update(name=check.name, group=check.group,
                  seconds=round(time.perf_counter() - t0, 3))
    return _jsonable(result)


def worker_main(args) -> int:
    """Run the named checks in order, appending start/done events to the state file."""
    ctx = Ctx(args.device, args.quick, args.scratch, args.seed, args.profile)
    by_name = {c.name: c for c in plan(ctx)}
    for name in args.checks.split(","):
        _event(args.state, {"event": "start", "name": name, "t": time.time()})
        result = run_one(by_name[name], ctx)
        _event(args.state, {"event": "done", "result": result})
        if result["status"] == "fail" and POISONED.search(
                " ".join(result.get("failures") or []) + result.get("traceback", "")):
            # a CUDA context after such an error fails every later call: let the
            # orchestrator start a fresh worker for the remaining checks
            print(f"[worker] {name} left the device in an error state; exiting", flush=True)
            sys.stdout.flush()
            os._exit(3)
    sys.stdout.flush()
    # a clean, quick exit: teardown of communicators at interpreter exit is not a check
    os._exit(0)


# ============================================================================ orchestrator
def _read_events(state: str) -> list:
    if not os.path.exists(state):
        return []
    events = []
    with open(state) as fh:
        for line in fh:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
    return events


def _kill_group(proc) -> None:
    """Stop a worker and whatever it started (it runs in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class Runner:
    """Runs the plan group by group in worker processes within the time budget."""

    def __init__(self, args, ctx, checks, deadline: float):
        self.args, self.ctx, self.checks = args, ctx, checks
        self.deadline = deadline
        self.results: dict[str, dict] = {}
        self.runs = 0

    def worker_env(self, group: str) -> dict:
        extra = {}
        if self.ctx.device == "cpu":
            # the dry run: one thread per process keeps small ops fast on a busy machine
            # (OpenMP's barriers wait for cores that other processes hold)
            extra["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
            if group == "kernels":
                extra["TRITON_INTERPRET"] = "1"  # Triton's interpreter: CPU tensors, no GPU
        return clean_env(extra)

    def run_group(self, group: str, names: list) -> None:
        pending = list(names)
        while pending:
            if time.monotonic() >= self.deadline:
                for n in pending:
                    self.record_skip(n, group, "the kit's time budget (--budget) was spent")
                return
            pending = self.run_worker(group, pending)

    def run_worker(self, group: str, names: list) -> list:
        """Start a worker for *names*; returns the names it did not get to."""
        self.runs += 1
        state = os.path.join(self.ctx.scratch, f"worker{self.runs}.jsonl")
        log_path = os.path.join(self.ctx.scratch, f"worker{self.runs}.log")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--device",
               self.ctx.device, "--scratch", self.ctx.scratch, "--seed", str(self.ctx.seed),
               "--state", state, "--checks", ",".join(names)]
        if self.ctx.quick:
            cmd.append("--quick")
        if self.ctx.profile:
            cmd.append("--profile")
        caps = {c.name: c.cap_s for c in self.checks}
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env=self.worker_env(group), cwd=self.ctx.scratch,
                                    start_new_session=True)
        stopped = None
        started_at = {}
        while True:
            rc = proc.poll()
            events = _read_events(state)
            done = {e["result"]["name"] for e in events if e["event"] == "done"}
            for e in events:
                if e["event"] == "start" and e["name"] not in started_at:
                    started_at[e["name"]] = time.monotonic()
                    print(f"[gpu_check] {e['name']} ...", flush=True)
                elif e["event"] == "done" and e["result"]["name"] not in self.results:
                    self.results[e["result"]["name"]] = e["result"]
                    self.say(e["result"])
            if rc is not None:
                break
            current = [n for n in started_at if n not in done]
            now = time.monotonic()
            if current and now - started_at[current[0]] > caps[current[0]]:
                stopped = f"stopped after its time cap of {caps[current[0]]:.0f} s"
            elif now >= self.deadline:
                stopped = "stopped: the kit's time budget (--budget) was spent"
            if stopped:
                _kill_group(proc)
                break
            time.sleep(0.2)
        events = _read_events(state)
        for e in events:
            if e["event"] == "done" and e["result"]["name"] not in self.results:
                self.results[e["result"]["name"]] = e["result"]
                self.say(e["result"])
        started = [e["name"] for e in events if e["event"] == "start"]
        with open(log_path, errors="replace") as fh:
            log_tail = tail(fh.read(), 20)
        for name in started:
            if name not in self.results:
                why = stopped or f"the worker process died (exit status {proc.returncode})"
                self.results[name] = {
                    "name": name, "group": group, "status": "fail", "numbers": {},
                    "seconds": round(time.monotonic() - started_at.get(name, time.monotonic()), 3),
                    "detail": why, "failures": [why], "traceback": log_tail}
                self.say(self.results[name])
        remaining = [n for n in names if n not in started]
        if remaining and not started:
            # the worker died before its first check: do not restart it forever
            for name in remaining:
                why = f"the worker did not start (exit status {proc.returncode})"
                self.results[name] = {"name": name, "group": group, "status": "fail",
                                      "numbers": {}, "seconds": 0.0, "detail": why,
                                      "failures": [why], "traceback": log_tail}
                self.say(self.results[name])
            return []
        return remaining

    def record_skip(self, name, group, why):
        self.results[name] = {"name": name, "group": group, "status": "skip", "numbers": {},
                              "seconds": 0.0, "detail": why, "failures": []}
        self.say(self.results[name])

    @staticmethod
    def say(result: dict) -> None:
        print(f"[gpu_check] {result['status'].upper():7s} {result['name']} "
              f"({result.get('seconds', 0):.1f} s) {result.get('detail', '')[:160]}", flush=True)


# ---- environment --------------------------------------------------------------------------
def _run(cmd, timeout=15) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def environment(device: str) -> dict:
    """Date, machine, versions, GPU and the checkout this report is about."""
    import importlib.metadata as md

    import torch
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "platform": platform.platform(),
           "python": sys.version.split()[0], "executable": sys.executable,
           "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cudnn": None, "triton": None,
           "device": device}
    for dist in ("triton", "numpy", "pluggy", "safetensors", "mpi4py"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = None
    if env["triton"] is None:  # e.g. a torch build that vendors it under another name
        try:
            import triton
            env["triton"] = getattr(triton, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - recorded, the Triton check will fail
            env["triton"] = f"not importable ({type(exc).__name__})"
    try:
        import zero_core
        env["zero_core"] = getattr(zero_core, "__version__", "?")
        env["zero_core_path"] = os.path.dirname(zero_core.__file__)
    except Exception as exc:  # noqa: BLE001 - reported, the checks will fail and say why
        env["zero_core"] = f"not importable: {exc}"
    env["git_commit"] = _run(["git", "rev-parse", "HEAD"])
    env["git_dirty"] = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))
    if device == "cuda" and torch.cuda.is_available():
        try:
            props = torch.cuda.get_device_properties(0)
            env.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                       gpu_capability=f"{props.major}.{props.minor}",
                       gpu_memory_GiB=round(props.total_memory / 2**30, 1),
                       cudnn=torch.backends.cudnn.version(),
                       matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32)
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - the checks will say more
            env["gpu_error"] = f"{type(exc).__name__}: {exc}"
        env["driver"] = (_run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"]).splitlines() or [None])[0]
    else:
        env["gpu"] = None
    return env


# ---- the report ---------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _key_numbers(r: dict) -> str:
    """The few numbers of a check worth a table cell."""
    n = r.get("numbers") or {}
    keys = ("loss_curve_max_rel_diff", "grad_norm_rel_diff", "final_weights_rel_l2_diff",
            "comparisons", "mismatched_comparisons", "max_abs_diff", "weights_differing",
            "fragments_differing", "next_loss_rel_diff", "median_step_ms", "peak_MiB",
            "counts")
    parts = [f"{k}={_fmt(n[k])}" for k in keys if k in n]
    place = n.get("placement")
    if isinstance(place, dict):
        parts.append(f"device/host MiB={place.get('device_MiB')}/{place.get('host_MiB')}")
    return "; ".join(parts).replace("|", "/")


def markdown(report: dict) -> str:
    env, results = report["environment"], report["checks"]
    s = report["summary"]
    lines = [f"# zero-core GPU kit: {env.get('gpu') or 'no GPU (' + env['device'] + ' dry run)'}",
             "",
             f"{env['date']} · device `{env['device']}`{' · quick' if report['quick'] else ''} · "
             f"torch {env['torch']} (CUDA {env.get('torch_cuda')}) · Triton {env.get('triton')} · "
             f"Python {env['python']} · zero-core {env.get('zero_core')} @ "
             f"{(env.get('git_commit') or '?')[:12]}{' (dirty)' if env.get('git_dirty') else ''}",
             "",
             f"**{s['pass']} passed, {s['fail']} failed, {s['refused']} refused by the engine, "
             f"{s['skip']} skipped** in {s['seconds']:.0f} s (seed {report['seed']}).", "",
             "| check | status | s | numbers | detail |", "|---|---|---:|---|---|"]
    for r in results:
        detail = (r.get("detail") or "").replace("|", "/").replace("\n", " ")[:220]
        lines.append(f"| {r['name']} | {r['status']} | {r.get('seconds', 0):.1f} | "
                     f"{_key_numbers(r)} | {detail} |")
    bw = next((r for r in results if r["name"] == "kernels/quant-bandwidth"
               and r.get("numbers", {}).get("rows")), None)
    if bw:
        lines += ["", f"Quantization kernels ({bw['numbers']['module']}, "
                      f"{bw['numbers']['elements']:,} elements, block {bw['numbers']['block']}):",
                  "", "| kernel | ms | GB/s | copy GB/s | % of copy |", "|---|---:|---:|---:|---:|"]
        for row in bw["numbers"]["rows"]:
            lines.append(f"| {row['kernel']} | {row['ms']} | {row['GBps']} | {row['copy_GBps']} "
                         f"| {row['pct_of_copy']} |")
    bench = [r for r in results if r["name"].startswith("bench/") and r["status"] == "pass"]
    if bench:
        bases = {r["name"]: r["numbers"] for r in bench
                 if r["name"] in ("bench/torch-fp32", "bench/torch-bf16-autocast")}
        lines += ["", "GPT step time and peak memory (examples/gpt.py; ratios against plain torch "
                      "in the same precision: torch-fp32, or torch-bf16-autocast for bf16 rows):", "",
                  "| contender | parameters | median ms/step | vs torch | peak MiB | vs torch | "
                  "loss first → last |", "|---|---:|---:|---:|---:|---:|---|"]
        for r in bench:
            n = r["numbers"]
            base = bases.get("bench/torch-bf16-autocast" if "bf16" in r["name"]
                             else "bench/torch-fp32")
            rt = f"{n['median_step_ms'] / base['median_step_ms']:.2f}×" if base else ""
            rm = (f"{n['peak_MiB'] / base['peak_MiB']:.2f}×"
                  if base and base["peak_MiB"] else "")
            lines.append(f"| {r['name'][6:]} | {n['parameters']:,} | {n['median_step_ms']} | {rt} "
                         f"| {n['peak_MiB']} | {rm} | {n['loss_first']} → {n['loss_last']} |")
        profiled = [r for r in bench if "profile" in r["numbers"]]
        if profiled:
            lines += ["", "Profiled steps (torch.profiler; goals: zero-s2/s3-bf16 within 1.15× of "
                          "torch-bf16-autocast above, 0 synchronizations per step):", "",
                      "| contender | host ms/step | device busy ms/step | launches/step | "
                      "syncs/step (profiler) | syncs/step (sync debug mode) |",
                      "|---|---:|---:|---:|---:|---:|"]
            for r in profiled:
                q = r["numbers"]["profile"]
                lines.append(f"| {r['name'][6:]} | {q['wall_ms_per_step']} | "
                             f"{q['device_busy_ms_per_step']} | {q['kernel_launches_per_step']} | "
                             f"{q.get('syncs_per_step_profiler', '')} | "
                             f"{q.get('syncs_per_step_debug_mode', '')} |")
    failed = [r for r in results if r["status"] == "fail"]
    if failed:
        lines += ["", "Failures:", ""]
        for r in failed:
            lines.append(f"- **{r['name']}**: " + "; ".join(r.get("failures") or [r.get("detail", "")])
                         .replace("\n", " ")[:600])
            if r.get("traceback"):
                lines += ["", "  ```", *("  " + t for t in r["traceback"].splitlines()[-8:]),
                          "  ```"]
    lines.append("")
    return "\n".join(lines)


def write_report(out_dir: str, report: dict) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    jpath, mpath = os.path.join(out_dir, JSON_NAME), os.path.join(out_dir, MD_NAME)
    for path, text in ((jpath, json.dumps(report, indent=1)), (mpath, markdown(report))):
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    return jpath, mpath


# ---- main ---------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default), or cpu for a dry run of the kit without a GPU")
    p.add_argument("--out", default="gpu_check_out",
                   help="directory for gpu_check.json and gpu_check.md (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer cases")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all checks together (default: 400 on cuda, 900 on cpu)")
    p.add_argument("--seed", type=int, default=None, help="reuse a run's seed")
    p.add_argument("--profile", action="store_true",
                   help="bench checks also profile two steps (torch.profiler): host and device "
                        "time per step and the top ops, in the JSON report")
    p.add_argument("-k", "--select", action="append", default=[], metavar="SUBSTRING",
                   help="run only checks whose name contains SUBSTRING (repeatable)")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    # internal: the worker process of one group, the CPU side of a checkpoint check
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checks", help=argparse.SUPPRESS)
    p.add_argument("--state", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-load", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    if args.ckpt_load:
        return checkpoint_load_main(args.ckpt_load)
    if args.worker:
        return worker_main(args)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    budget = args.budget or (400.0 if args.device == "cuda" else 900.0)
    if args.list:
        for c in plan(Ctx(args.device, args.quick, "", seed)):
            print(f"{c.name:55s} group {c.group:20s} cap {c.cap_s:.0f} s")
        return 0
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no usable CUDA GPU (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda}; torch.cuda.is_available() is False). Run it on the GPU "
              f"machine, or use --device cpu for a dry run.", file=sys.stderr)
        return 2
    scratch = tempfile.mkdtemp(prefix="zero_core_gpu_check_")
    ctx = Ctx(args.device, args.quick, scratch, seed, args.profile)
    checks = plan(ctx)
    if args.select:
        checks = [c for c in checks if any(s in c.name for s in args.select)]
    print(f"[gpu_check] {len(checks)} checks on {args.device}, seed {seed}, budget "
          f"{budget:.0f} s, scratch {scratch}", flush=True)
    runner = Runner(args, ctx, checks, deadline=t0 + budget)
    try:
        env = environment(args.device)
        groups = []
        for c in checks:
            if c.group not in groups:
                groups.append(c.group)
        for group in groups:
            runner.run_group(group, [c.name for c in checks if c.group == group])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = [runner.results[c.name] for c in checks if c.name in runner.results]
    summary = {s: sum(r["status"] == s for r in results) for s in STATUSES}
    summary["seconds"] = round(time.monotonic() - t0, 1)
    report = {"kit": "zero-core ci/gpu/check.py", "format": 1, "device": args.device,
              "quick": args.quick, "seed": seed, "budget_s": budget,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "environment": env, "summary": summary, "checks": results}
    jpath, mpath = write_report(args.out, report)
    print(f"[gpu_check] {summary['pass']} passed, {summary['fail']} failed, "
          f"{summary['refused']} refused, {summary['skip']} skipped in {summary['seconds']} s; "
          f"report: {jpath}, {mpath}", flush=True)
    return 1 if summary["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
