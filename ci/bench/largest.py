#!/usr/bin/env python
"""The largest GPT that trains on this machine with 4 ranks: DDP, FSDP2, DeepSpeed ZeRO-3 and
zero-core stage 3, under one memory budget.

The models are examples/gpt.py's family scaled in width and depth together: rung k of the
ladder has 4 + k layers of width 512 + 64k (head size 64, context 128, byte vocabulary, tied
embeddings), 12.6M parameters at rung 0 and about 1.15x more per rung. An attempt builds
rung k the way the contender builds large models (DDP: whole model per rank; FSDP2: meta
device, then shards; DeepSpeed: deepspeed.zero.Init; zero-core: zero_core.Init) and trains
3 steps in fp32 with AdamW, 4 ranks, 1 sequence of 32 tokens per rank and step
(ci/bench/workers/largest_rank.py). Every attempt is a job of its own.

Memory cap. All 4 ranks together get ``--budget-gib`` of resident memory (default 12 of the
machine's 24 GiB, leaving room for the other work on it). A guard thread samples the RSS of
every process the attempt started ten times a second and kills the attempt when the ranks'
sum exceeds the budget (the model did not fit), or when the machine's MemAvailable falls under
``--floor-gib`` (someone else needs the memory: the attempt is repeated later, not counted).
Ranks also raise their oom_score_adj, report a MemoryError as ``oom``, and a rank left
waiting for one that died is stopped after 20 s.

Search. Rungs whose model states alone cannot fit are not run: 16 bytes per parameter per
rank for DDP (16Psi x 4 ranks <= budget), 16 bytes per parameter over all ranks for the
sharded engines (16Psi <= budget). Below that bound, a bisection: DDP from nothing, the
others starting from DDP's largest (checked by running it, never assumed). The result for a
contender is a rung that trained and the next rung that did not (or the bound).

    python ci/bench/largest.py                   # the ladder above, 12 GiB budget
    python ci/bench/largest.py --quick           # two tiny rungs: a smoke run
    python ci/bench/largest.py --only 'ddp,zero-core-3' --budget-gib 10
    python ci/bench/largest.py --replot docs/images/largest.json   # redraw the chart only

The tables go to stdout, every number to --json and the chart to --plot (default
docs/images/largest.json and .png; ci/bench/plots.py).
"""
from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import engine as be  # noqa: E402  (contender records, selection, the deepspeed venv)
import plots  # noqa: E402  (JSON and PNG beside the table)
import stage3 as s3  # noqa: E402  (wait for a quiet machine)

WORKER = os.path.join(HERE, "workers", "largest_rank.py")
RANKS = 4
GIB = 2 ** 30
# zero-core's targets from the issue: parameters trained relative to DDP, and to FSDP2
TARGET_VS_DDP = 3.5
DEFAULT_SELECTION = "ddp,fsdp2,deepspeed-3,zero-core-3"


# ---------------------------------------------------------------- the ladder

@dataclass(frozen=True)
class Rung:
    index: int
    layers: int
    width: int

    @property
    def params(self) -> int:
        """Parameters of examples/gpt.py's GPT at this shape (tied head counted once): per
        block 12 w^2 + 13 w (qkv, proj, fc, proj, two LayerNorms, biases), plus token (256)
        and position (128) embeddings and the final LayerNorm, 386 w."""
        w = self.width
        return self.layers * (12 * w * w + 13 * w) + 386 * w

    def label(self) -> str:
        return f"{self.layers}×{self.width}"


def full_ladder(count: int = 41) -> list[Rung]:
    """Rung k: 4 + k layers of width 512 + 64k."""
    return [Rung(k, 4 + k, 512 + 64 * k) for k in range(count)]


def quick_ladder() -> list[Rung]:
    return [Rung(0, 1, 64), Rung(1, 2, 64)]


def bytes_bound(contender: str, params: int) -> int:
    """Least resident bytes, all ranks together, of fp32 AdamW model states (4 parameters +
    4 gradient + 8 moment bytes per parameter): replicated on every rank for DDP, spread
    over the ranks for the sharded engines."""
    return 16 * params * (RANKS if contender == "ddp" else 1)


# ---------------------------------------------------------------- the memory guard

def _read_int(path: str, field: int) -> int | None:
    try:
        with open(path) as fh:
            return int(fh.read().split()[field])
    except (OSError, ValueError, IndexError):
        return None


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def descendants(root: int) -> list[int]:
    """Pids of every process below *root* (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                # after "pid (comm)": state ppid ...; comm may hold spaces and parentheses
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def _runs_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return os.path.basename(WORKER).encode() in fh.read()
    except OSError:
        return False


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def rank_pids(pids: list[int]) -> set[int]:
    """The rank processes among *pids*: those running the worker whose parent does not
    (a rank's forked helper shares its command line and, copy-on-write, its pages)."""
    workers = {p for p in pids if _runs_worker(p)}
    return {p for p in workers if _parent(p) not in workers}


class MemoryGuard:
    """While active, watches every process this one started (see the module docstring) and
    kills them all — they are this benchmark's own — when the ranks together go over *budget*
    bytes of RSS (launchers and compilers are not the contender's memory), when MemAvailable drops below *floor* bytes, or when a rank has
    exited and the others are still running *straggler_s* seconds later."""

    def __init__(self, budget: int, floor: int, poll_s: float = 0.1, rescan_s: float = 1.0,
                 straggler_s: float = 20.0):
        self.budget, self.floor = budget, floor
        self.poll_s, self.rescan_s, self.straggler_s = poll_s, rescan_s, straggler_s
        self.reason: str | None = None        # why the guard killed the attempt
        self.peak_total = 0                   # bytes, sum over the rank processes, sampled
        self.peak_everything = 0              # ... and over every process started (launchers,
                                              # DeepSpeed's one-off JIT compiler)
        self.peak_rank: dict[int, int] = {}   # pid -> peak bytes, rank processes only
        self.min_available = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    def _kill(self, pids: list[int], reason: str) -> None:
        self.reason = self.reason or reason
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _watch(self) -> None:
        me = os.getpid()
        pids: list[int] = []
        ranks: set[int] = set()
        most_ranks, fewer_since, last_scan = 0, None, 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_scan >= self.rescan_s:
                pids = descendants(me)
                ranks = rank_pids(pids)
                last_scan = now
            total = everything = 0
            alive_ranks = 0
            for pid in pids:
                pages = _read_int(f"/proc/{pid}/statm", 1)
                if pages is None:
                    continue
                rss = pages * self._page
                everything += rss
                if pid in ranks:
                    total += rss
                    alive_ranks += 1
                    self.peak_rank[pid] = max(self.peak_rank.get(pid, 0), rss)
            self.peak_total = max(self.peak_total, total)
            self.peak_everything = max(self.peak_everything, everything)
            available = mem_available_bytes()
            self.min_available = available if self.min_available is None else min(self.min_available, available)
            if total > self.budget:
                self._kill(pids, f"over budget: {total / GIB:.2f} GiB resident in total "
                                 f"> {self.budget / GIB:.2f} GiB")
            elif available < self.floor:
                self._kill(pids, f"machine low on memory: MemAvailable {available / GIB:.2f} GiB "
                                 f"< floor {self.floor / GIB:.2f} GiB")
            most_ranks = max(most_ranks, alive_ranks)
            if 0 < alive_ranks < most_ranks:
                fewer_since = fewer_since or now
                if now - fewer_since > self.straggler_s:
                    self._kill(pids, f"a rank exited; the others were still running "
                                     f"{self.straggler_s:.0f} s later")
            else:
                fewer_since = None
            self._stop.wait(self.poll_s)


# ---------------------------------------------------------------- attempts

def largest_contenders() -> list[be.Contender]:
    ds = {"DS_ACCELERATOR": "cpu"}
    return [be.Contender("ddp", ["ddp"]),
            be.Contender("fsdp2", ["fsdp2"]),
            be.Contender("deepspeed-3", ["deepspeed"], env=ds, needs="deepspeed"),
            be.Contender("zero-core-3", ["zero_core", "--comm", "gloo"]),
            be.Contender("zero-core-3-mpi", ["zero_core", "--comm", "mpi"], launcher="mpirun")]


def wait_for_memory(need: int, max_wait_s: float) -> bool:
    """Wait (polling every 15 s) until MemAvailable >= *need* bytes; False on giving up."""
    deadline = time.monotonic() + max_wait_s
    while mem_available_bytes() < need:
        if time.monotonic() >= deadline:
            return False
        print(f"[largest]   MemAvailable {mem_available_bytes() / GIB:.1f} GiB < "
              f"{need / GIB:.1f} GiB needed: waiting", file=sys.stderr, flush=True)
        time.sleep(15)
    return True


def run_attempt(c: be.Contender, rung: Rung, a) -> dict:
    """One job: rung *rung* under contender *c*; status ok / over-budget / oom / timeout /
    failed / aborted (the machine, not the contender, ran short)."""
    from zero_core.testing.ranks import run_ranks
    budget, floor = int(a.budget_gib * GIB), int(a.floor_gib * GIB)
    args = [*c.worker_args, "--layers", rung.layers, "--width", rung.width,
            "--steps", a.steps, "--micro", a.micro, "--seq", a.seq]
    out = {"contender": c.name, **asdict(rung), "params": rung.params}
    if not wait_for_memory(budget + floor, a.memory_wait_s):
        return {**out, "status": "aborted", "note": "MemAvailable never reached budget + floor"}
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    with MemoryGuard(budget, floor) as guard:
        env = dict(c.env)
        if a.mmap_threshold:
            # the same allocator setting for every contender: freed large blocks go back to
            # the system at once (glibc otherwise raises its mmap threshold on each free and
            # keeps up to 32 MiB blocks in the heap, where a freed gathered weight stays
            # resident)
            env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
        results = run_ranks(WORKER, RANKS, launcher=c.launcher, args=args, env=env,
                            timeout=a.attempt_timeout, check=False)
    out.update(wall_s=time.perf_counter() - t0, loadavg_1min_before=load,
               loadavg_1min_after=os.getloadavg()[0], peak_total_rss_bytes=guard.peak_total,
               peak_all_processes_rss_bytes=guard.peak_everything,
               peak_rank_rss_sampled_bytes=sorted(guard.peak_rank.values(), reverse=True),
               min_mem_available_bytes=guard.min_available)
    reports = [r.report for r in results]
    codes = [r.returncode for r in results]
    if guard.reason and guard.reason.startswith("machine"):
        return {**out, "status": "aborted", "note": guard.reason}
    if guard.reason and guard.reason.startswith("over budget"):
        return {**out, "status": "over-budget", "note": guard.reason}
    ooms = [rep for rep in reports if rep and rep.get("status") == "oom"]
    if ooms:
        return {**out, "status": "oom", "note": f"rank {ooms[0]['rank']}: {ooms[0]['error'][:200]}"}
    if all(code == 0 for code in codes) and all(rep and rep.get("status") == "ok" for rep in reports):
        return {**out, "status": "ok", "reports": reports,
                "num_parameters": reports[0]["num_parameters"],
                "peak_rss_per_rank_bytes": [rep["peak_rss_bytes"] for rep in reports],
                # a step is as slow as its slowest rank
                "step_s": [max(rep["step_s"][i] for rep in reports) for i in range(a.steps)],
                "cpu_step_s": [statistics.fmean(rep["cpu_step_s"][i] for rep in reports)
                               for i in range(a.steps)],
                "build_s": max(rep["build_s"] for rep in reports),
                "losses": reports[0]["losses"]}
    if any(code is None for code in codes):
        return {**out, "status": "timeout", "note": f"not done after {a.attempt_timeout:.0f} s"}
    # the log of a rank that failed on its own, rather than one the guard killed
    failed = ([r for r in results if r.returncode not in (0, None, -signal.SIGKILL)]
              or [r for r in results if r.returncode] or results)
    log = failed[0].log
    note = guard.reason or f"exit statuses {codes}"
    return {**out, "status": "failed", "note": note, "log_tail": log[-3000:]}


def attempt_with_retries(c, rung, a, log: list) -> dict:
    """run_attempt, repeated (up to 3 times) when the machine rather than the model ran out."""
    for tries in range(3):
        print(f"[largest] {c.name}: rung {rung.index} ({rung.label()}, "
              f"{rung.params / 1e6:,.0f}M parameters) ...", file=sys.stderr, flush=True)
        res = run_attempt(c, rung, a)
        log.append(res)
        print(f"[largest]   {res['status']}" + (f" in {res['wall_s']:.0f} s" if "wall_s" in res else "")
              + (f", peak {res.get('peak_total_rss_bytes', 0) / GIB:.2f} GiB in total" if "wall_s" in res else "")
              + (f" — {res['note']}" if res.get("note") else ""), file=sys.stderr, flush=True)
        if res["status"] == "failed":
            print(res.get("log_tail", "")[-1500:], file=sys.stderr, flush=True)
        if res["status"] != "aborted":
            return res
        time.sleep(30)
    return res


def search(c, ladder: list[Rung], lo: int, a, log: list) -> dict:
    """Largest rung that trains for *c*: bisection between *lo* (a rung expected to train,
    or -1) and the first rung over the model-state bound; *lo* is checked, not assumed. An
    attempt the machine aborted (others needed the memory) ends the search unfinished."""
    budget = a.budget_gib * GIB
    hi = next((r.index for r in ladder if bytes_bound(c.name, r.params) > budget), len(ladder))
    lo = min(lo, hi - 1)
    outcome: dict[int, dict] = {}
    unfinished = None

    def attempt(k: int) -> bool | None:
        nonlocal unfinished
        outcome[k] = attempt_with_retries(c, ladder[k], a, log)
        if outcome[k]["status"] == "aborted":
            unfinished = f"search unfinished: rung {k} aborted ({outcome[k]['note']})"
            return None
        return outcome[k]["status"] == "ok"

    while unfinished is None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            fits = attempt(mid)
            if fits is None:
                break
            lo, hi = (mid, hi) if fits else (lo, mid)
        if unfinished or lo < 0 or lo in outcome:
            break
        fits = attempt(lo)
        if fits is None or fits:
            break
        lo, hi = -1, lo   # the starting point did not train after all: search below it
    best = outcome.get(lo) if lo in outcome and outcome[lo]["status"] == "ok" else None
    nxt = outcome.get(hi)
    if unfinished:
        next_outcome = unfinished
    elif nxt:
        next_outcome = nxt.get("note") or nxt["status"]
    else:
        next_outcome = "over the model-state bound (not run)" if hi < len(ladder) else "top of the ladder"
    return {"name": c.name, "best": best, "best_rung": lo if best else -1,
            "next_rung": hi if hi < len(ladder) else None, "next_outcome": next_outcome,
            "unfinished": bool(unfinished),
            "attempts": len([x for x in log if x["contender"] == c.name])}


# ---------------------------------------------------------------- tables

def results_table(rows: list[dict], ladder: list[Rung]) -> str:
    ddp = next((r for r in rows if r["name"] == "ddp" and r.get("best")), None)
    lines = ["| contender | largest trained (layers × width) | parameters | vs DDP | peak RSS all ranks (GiB) "
             "| peak RSS/rank (GiB) | median s/step | CPU s/step/rank | next rung (parameters): outcome | attempts |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if r.get("status") == "skipped":
            lines.append(f"| {r['name']} | skipped | | | | | | | {r['reason'][:90]} | 0 |")
            continue
        nxt = ladder[r["next_rung"]] if r["next_rung"] is not None else None
        nxt_text = (f"{nxt.label()} ({nxt.params / 1e6:,.0f}M): " if nxt else "") + r["next_outcome"][:110]
        b = r["best"]
        if b is None:
            lines.append(f"| {r['name']} | none | | | | | | | {nxt_text} | {r['attempts']} |")
            continue
        ratio = f"{b['params'] / ddp['best']['params']:.2f}×" if ddp else "—"
        lines.append(f"| {r['name']} | {ladder[r['best_rung']].label()} | {b['params'] / 1e6:,.1f}M | {ratio} | "
                     f"{b['peak_total_rss_bytes'] / GIB:.2f} | {max(b['peak_rss_per_rank_bytes']) / GIB:.2f} | "
                     f"{statistics.median(b['step_s']):.2f} | {statistics.median(b['cpu_step_s']):.2f} | "
                     f"{nxt_text} | {r['attempts']} |")
    return "\n".join(lines)


def attempts_table(log: list[dict]) -> str:
    lines = ["| contender | rung | layers × width | parameters | status | peak RSS all ranks (GiB) | wall (s) | load | note |",
             "|---|---:|---|---:|---|---:|---:|---:|---|"]
    for x in log:
        peak = f"{x['peak_total_rss_bytes'] / GIB:.2f}" if "peak_total_rss_bytes" in x else ""
        wall = f"{x['wall_s']:.0f}" if "wall_s" in x else ""
        load = f"{x['loadavg_1min_before']:.1f}" if "loadavg_1min_before" in x else ""
        lines.append(f"| {x['contender']} | {x['index']} | {x['layers']}×{x['width']} | {x['params'] / 1e6:,.1f}M | "
                     f"{x['status']} | {peak} | {wall} | {load} | {(x.get('note') or '')[:100]} |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    best = {r["name"]: r["best"]["params"] for r in rows if r.get("best")}
    out = []
    for name in ("zero-core-3", "zero-core-3-mpi"):
        if name not in best:
            continue
        if "ddp" in best:
            ratio = best[name] / best["ddp"]
            out.append(f"{name}: {ratio:.2f}× DDP's parameters (target ≥ {TARGET_VS_DDP}×) "
                       f"{'meets' if ratio >= TARGET_VS_DDP else 'MISSES'} the target")
        if "fsdp2" in best:
            ratio = best[name] / best["fsdp2"]
            out.append(f"{name}: {ratio:.2f}× FSDP2's parameters (target ≥ 1×) "
                       f"{'meets' if ratio >= 1 else 'MISSES'} the target")
        if "deepspeed-3" in best:
            out.append(f"{name}: {best[name] / best['deepspeed-3']:.2f}× DeepSpeed ZeRO-3's parameters")
    return out


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--budget-gib", type=float, default=None,
                   help="resident memory of all 4 ranks together (GiB; default 12, 4 with --quick)")
    p.add_argument("--floor-gib", type=float, default=3.0,
                   help="stop an attempt when the machine's MemAvailable drops below this (GiB)")
    p.add_argument("--steps", type=int, default=3, help="training steps per attempt")
    p.add_argument("--mmap-threshold", type=int, default=1 << 20,
                   help="MALLOC_MMAP_THRESHOLD_ in bytes for the ranks of every contender "
                        "(0: glibc's default, a dynamic threshold)")
    p.add_argument("--micro", type=int, default=1, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (<= 128)")
    p.add_argument("--quick", action="store_true", help="smoke run: two tiny rungs")
    p.add_argument("--only", default=DEFAULT_SELECTION,
                   help=f"comma-separated contender names or globs (default {DEFAULT_SELECTION}; "
                        f"zero-core-3-mpi is also available)")
    p.add_argument("--attempt-timeout", type=float, default=1800, help="seconds per attempt")
    p.add_argument("--memory-wait-s", type=float, default=600,
                   help="how long an attempt waits for budget + floor to be available")
    p.add_argument("--wait-for-load", type=float, default=0, metavar="LOAD",
                   help="first wait until the 1-minute load average is below LOAD")
    p.add_argument("--wait-max-min", type=float, default=60)
    plots.add_arguments(p, "largest")
    a = p.parse_args(argv)
    meta = plots.start(a, "largest", __file__, argv)
    if a.budget_gib is None:
        a.budget_gib = 4.0 if a.quick else 12.0
    if a.steps < 1 or not 1 <= a.seq <= 128 or a.micro < 1 or a.budget_gib <= 0:
        p.error("--steps and --micro must be >= 1, --seq in 1..128, --budget-gib > 0")
    ladder = quick_ladder() if a.quick else full_ladder()
    chosen = be.select(largest_contenders(), a.only)
    skip_reason = None
    if any(c.needs == "deepspeed" for c in chosen):
        skip_reason = be.deepspeed_or_reexec(__file__, argv)
    if a.wait_for_load > 0:
        s3.wait_for_quiet(a.wait_for_load, a.wait_max_min)

    import torch
    print(f"# largest model that trains {a.steps} steps: {RANKS} ranks, fp32 AdamW, "
          f"{a.micro}x{a.seq} tokens per rank, budget {a.budget_gib:g} GiB resident for all "
          f"ranks (machine {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GIB:.1f} GiB, "
          f"MemAvailable now {mem_available_bytes() / GIB:.1f} GiB)", flush=True)
    print(f"# python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, "
          f"{os.cpu_count()} cores; load average now {os.getloadavg()[0]:.2f}", flush=True)
    print("# ladder: " + ", ".join(f"{r.index}:{r.label()}={r.params / 1e6:,.1f}M" for r in ladder
                                   if bytes_bound('zero-core-3', r.params) <= a.budget_gib * GIB * 1.2),
          flush=True)
    log: list[dict] = []
    rows = []
    ddp_best = -1
    for c in chosen:
        if c.needs == "deepspeed" and skip_reason:
            print(f"[largest] {c.name}: skipped ({skip_reason})", file=sys.stderr, flush=True)
            rows.append({"name": c.name, "status": "skipped", "reason": skip_reason})
            continue
        row = search(c, ladder, ddp_best if c.name != "ddp" else -1, a, log)
        if c.name == "ddp":
            ddp_best = row["best_rung"]
        rows.append(row)
    ddp = next((r for r in rows if r["name"] == "ddp" and r.get("best")), None)
    for r in rows:
        if ddp and r.get("best"):
            r["vs_ddp"] = r["best"]["params"] / ddp["best"]["params"]
    found = verdicts(rows)
    print()
    print(results_table(rows, ladder))
    print()
    print(attempts_table(log))
    print()
    for v in found:
        print(f"- {v}")
    loads = [x[k] for x in log for k in ("loadavg_1min_before", "loadavg_1min_after") if k in x]
    if loads:
        print(f"\n1-minute load average during the attempts: {min(loads):.2f}–{max(loads):.2f}; "
              f"total attempt time {sum(x.get('wall_s', 0) for x in log) / 60:.1f} min")
    print()
    result = {"benchmark": "largest", "ranks": RANKS, "budget_gib": a.budget_gib,
              "floor_gib": a.floor_gib, "steps": a.steps, "micro": a.micro, "seq": a.seq,
              "ladder": [{**asdict(r), "params": r.params} for r in ladder],
              "python": sys.executable, "torch": torch.__version__,
              "verdicts": found, "results": rows, "attempts": log}
    plots.finish(a, "largest", result, meta)
    return 0 if all(r.get("status") == "skipped" or r.get("best") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
