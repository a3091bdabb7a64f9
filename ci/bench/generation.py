#!/usr/bin/env python
"""Generation in post-training loops: tokens/s and RL iterations, zero-core against its peers.

Every row runs as its own 2-rank job (ci/bench/workers/generation_rank.py) on the same
Hugging Face GPT-2 (built locally from a GPT2Config, random weights from a fixed seed, ~25M
parameters by default; nothing is downloaded), the same fixed-length random prompts per rank,
greedy decoding of a fixed number of new tokens, in fp32 and bf16 (--precision):

  single        one unpartitioned process per rank, plain torch + HF generate: the bound
  zc-s3         zero-core stage 3, engine.module.generate under torch.no_grad (the
                generation cache, default budget = stage3_max_live_parameters)
  zc-s3-b0      the same with {"generation": {"max_live_parameters": 0}}: every fetch unit
                gathered again for every token (the behaviour before issue 27)
  zc-s3-half    a generation budget of half the model's elements
  zc-hybrid     "hybrid_engine": {"enabled": true}, engine.generate
  zc-gathered   zero_core.gathered_for_generation(engine) (TRL's unwrap pattern)
  zc-zpp-b0     ZeRO++ (zero_quantized_weights + zero_hpz_partition_size) at budget 0
  zc-zpp        ZeRO++ at the default budget
  ds-module     DeepSpeed ZeRO-3, engine.module.generate (fetches module by module)
  ds-gathered   DeepSpeed ZeRO-3 under GatheredParameters(model.parameters()) with its hooks
                removed (deepspeed's unwrap_model_for_generation: TRL's pattern)
  ds-hybrid     DeepSpeed's hybrid engine, engine.generate

Two tables per precision. Generation: after a warm-up call, --reps timed generate calls on
the same prompts in eval mode, nothing trained in between (zero-core keeps what the warm-up
gathered); tokens/s counts both ranks' new tokens over the slowest rank's call time
(median). RL iteration: eval(), generate on new prompts, train() (zero-core releases its
kept units), one training step (AdamW, LM loss on the generated tokens) on the sequences. Beside
each: the ratio to the bound, parameter gathers and bytes sent per token (zero-core's
ledger; DeepSpeed's torch.distributed calls counted, input bytes), peak resident set per rank
of that phase (VmHWM, reset at its start), the engine's live-window peak, and whether the
tokens equal the single process's (ZeRO++ rows legitimately differ: qwZ gathers int8
weights). A row whose feature is missing shows "n/a (not available: ...)".

--cluster instead runs stage-3 generation at budget 0, plain (zc-s3-b0) against ZeRO++
(zc-zpp-b0: qwZ + hpZ), on the emulated two-node cluster of ci/bench/cluster.py (network
namespaces, tbf-shaped veth; needs root) at each --rates rate with 1 and 2 ranks per node:
tokens/s, inter-node bytes per decode step (ledger) and on the veth, and the ZeRO++ speed-up
(goal >= 2.25x at 1 Gbit/s, the ZeRO++ paper's figure).

DeepSpeed is a peer, never a dependency: when it is not importable the script re-runs itself
in the benchmark environment (ci/bench/engine.py's deepspeed_or_reexec); create it with
``python ci/bench/generation.py --setup-bench-venv`` (ci/bench/engine.py's, plus transformers).

    python ci/bench/generation.py --quick                # smoke run, a few minutes
    python ci/bench/generation.py                        # both tables, fp32 and bf16
    python ci/bench/generation.py --only 'single,zc-*' --precision bf16 --rounds 2
    python ci/bench/generation.py --cluster              # the emulated cluster (root)
    python ci/bench/generation.py --replot docs/images/generation.json   # the chart only

Tables to stdout, every number to --json, the chart to --plot (default
docs/images/generation.json and .png; ci/bench/plots.py).
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import engine as be  # noqa: E402  (the benchmark environment, shared with the others)
import plots  # noqa: E402  (JSON and PNG beside the tables)

WORKER = os.path.join(HERE, "workers", "generation_rank.py")
RANKS = 2
ROWS = [  # (variant, label) in table order
    ("single", "single process, plain torch + HF generate (bound)"),
    ("zc-s3", "zero-core stage 3, default budget"),
    ("zc-s3-b0", "zero-core stage 3, budget 0 (per-module)"),
    ("zc-s3-half", "zero-core stage 3, budget ½ model"),
    ("zc-hybrid", "zero-core hybrid engine (engine.generate)"),
    ("zc-gathered", "zero-core gathered_for_generation"),
    ("zc-zpp-b0", "zero-core ZeRO++ (qwZ+hpZ), budget 0"),
    ("zc-zpp", "zero-core ZeRO++ (qwZ+hpZ), default budget"),
    ("ds-module", "DeepSpeed ZeRO-3, module by module"),
    ("ds-gathered", "DeepSpeed ZeRO-3, GatheredParameters (TRL)"),
    ("ds-hybrid", "DeepSpeed hybrid engine"),
]
LABELS = dict(ROWS)
# rows whose tokens may legitimately differ from the single process's, and why
MAY_DIFFER = {"zc-zpp-b0": "qwZ: int8 weights", "zc-zpp": "qwZ: int8 weights",
              "ds-hybrid": "inference kernels"}
GEN_GOAL = 1.2          # stage-3 default: call time within 1.2x of the single process
CLUSTER_GOAL = 2.25     # ZeRO++ over plain ZeRO-3 at 1 Gbit/s (ZeRO++ paper)
CLUSTER_VARIANTS = "zc-s3-b0,zc-zpp-b0"
MiB, MB = 2**20, 1e6


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def tree() -> str:
    """The checkout's commit, with '+ uncommitted changes' when there are any (read-only)."""
    git = ["git", "-C", REPO]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def worker_args(a, variant: str, precision: str, rl: bool) -> list:
    return ["--variant", variant, "--precision", precision, "--layers", a.layers,
            "--width", a.width, "--heads", a.heads, "--vocab", a.vocab, "--batch", a.batch,
            "--prompt-len", a.prompt_len, "--new-tokens", a.new_tokens, "--warmup", a.warmup,
            "--reps", a.reps, "--rl-warmup", a.rl_warmup, "--rl-reps", a.rl_reps if rl else 0,
            *(["--release-cache"] if a.release_cache else [])]


def job_outcome(results) -> dict:
    """What one job's ranks reported: ok (with the reports), n/a or failed (with a reason)."""
    reports = [r.report for r in results]
    for status in ("unavailable", "failed"):
        bad = next((rep for rep in reports if rep and rep.get("status") == status), None)
        if bad is not None:
            return {"status": status, "reason": bad["error"], "traceback": bad.get("traceback")}
    if any(rep is None for rep in reports) or any(r.returncode != 0 for r in results):
        worst = next(r for r in results if r.report is None or r.returncode != 0)
        tail = worst.log.strip().splitlines()[-1:] or ["no output"]
        return {"status": "failed", "reason": f"rank {worst.rank} exit {worst.returncode}: "
                f"{tail[0][:300]}", "log": worst.log[-4000:]}
    return {"status": "ok", "reports": reports}


# ---------------------------------------------------------------- the two local tables

def slowest(reports, get) -> list[float]:
    """Per timed call, the slowest rank's seconds."""
    per_rank = [get(rep) for rep in reports]
    return [max(xs[i] for xs in per_rank) for i in range(min(map(len, per_rank)))]


def mean_rank(reports, get) -> list[float]:
    """Per timed call, the ranks' mean (CPU seconds)."""
    per_rank = [get(rep) for rep in reports]
    return [statistics.fmean(xs[i] for xs in per_rank) for i in range(min(map(len, per_rank)))]


def summarize(variant: str, runs: list[dict], a) -> dict:
    """One row (both tables) from one or more runs (rounds) of a variant."""
    bad = next((r for r in runs if r["status"] != "ok"), None)
    if bad is not None:
        return {"variant": variant, "status": bad["status"], "reason": bad["reason"]}
    last = runs[-1]["reports"]
    calls = [t for r in runs for t in slowest(r["reports"], lambda rep: rep["generation"]["call_s"])]
    gen = last[0]["generation"]
    mem = gen.get("memory") or {}
    cpu = [t for r in runs for t in mean_rank(r["reports"], lambda rep: rep["generation"]["cpu_s"])]
    row = {"variant": variant, "status": "ok", "call_s": calls,
           "cpu_s_median": statistics.median(cpu),
           "call_s_median": statistics.median(calls),
           "tokens_per_s": RANKS * a.batch * a.new_tokens / statistics.median(calls),
           "gen_peak_rss_bytes": max(rep["generation"]["peak_rss_bytes"] for rep in last),
           "per_token": gen.get("per_token"),
           "live_window_peak_bytes": (mem.get("stage3") or {}).get("live_window_peak"),
           "model_states_bytes": (mem.get("ledger") or {}).get("model_states"),
           "gen_memory": mem,
           "tokens": [rep["generation"]["tokens"] for rep in last],
           "num_parameters": last[0]["num_parameters"]}
    if last[0].get("rl"):
        it = [t for r in runs for t in slowest(r["reports"], lambda rep: rep["rl"]["iter_s"])]
        g = [t for r in runs for t in slowest(r["reports"], lambda rep: rep["rl"]["gen_s"])]
        tr = [t for r in runs for t in slowest(r["reports"], lambda rep: rep["rl"]["train_s"])]
        rc = [t for r in runs for t in mean_rank(r["reports"], lambda rep: rep["rl"]["cpu_s"])]
        row.update(rl_iter_s=it, rl_iter_s_median=statistics.median(it),
                   rl_cpu_s_median=statistics.median(rc),
                   rl_gen_s_median=statistics.median(g), rl_train_s_median=statistics.median(tr),
                   rl_peak_rss_bytes=max(rep["rl"]["peak_rss_bytes"] for rep in last),
                   rl_per_iteration=last[0]["rl"].get("per_iteration"),
                   rl_losses=[rep["rl"]["losses"] for rep in last])
    return row


def token_check(row: dict, bound: dict | None) -> str:
    """Do the row's new tokens equal the single process's (per rank, every sequence)?"""
    if bound is None or row["variant"] == "single":
        return "—" if row["variant"] != "single" else "reference"
    first, equal, total = None, 0, 0
    for mine, ref in zip(row["tokens"], bound["tokens"]):
        for s, r in zip(mine, ref):
            total += len(r)
            equal += sum(x == y for x, y in zip(s, r))
            diff = next((i for i, (x, y) in enumerate(zip(s, r)) if x != y), None)
            if diff is not None and (first is None or diff < first):
                first = diff
    if first is None:
        return "exact"
    why = MAY_DIFFER.get(row["variant"])
    what = f"differ from token {first} ({100 * equal / total:.0f}% equal)"
    return f"{what}, expected ({why})" if why else f"**{what}**"


def na(row: dict) -> str:
    reason = " ".join(row["reason"].split())[:160].replace("|", "/")
    kind = "not available" if row["status"] == "unavailable" else "failed"
    return f"n/a ({kind}: {reason})"


def fmt(x, scale=1.0, digits=2, none="—") -> str:
    return none if x is None else f"{x / scale:,.{digits}f}"


def generation_table(rows: list[dict]) -> str:
    bound = next((r for r in rows if r["variant"] == "single" and r["status"] == "ok"), None)
    lines = ["| row | tokens/s (2 ranks) | call s (median, min–max) | CPU s/call/rank "
             "| vs bound: wall / CPU | gathers/token | MB sent/rank/token | peak RSS/rank MiB "
             "| live window peak MiB | tokens vs single |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        label = LABELS[r["variant"]]
        if r["status"] != "ok":
            lines.append(f"| {label} | {na(r)} | | | | | | | | |")
            continue
        pt = r["per_token"] or {}
        vs = (f"{r['call_s_median'] / bound['call_s_median']:.2f}× / "
              f"{r['cpu_s_median'] / bound['cpu_s_median']:.2f}×" if bound else "—")
        sent = pt.get("sent_bytes", pt.get("gather_payload_bytes"))
        lines.append(
            f"| {label} | {r['tokens_per_s']:.1f} | {r['call_s_median']:.2f} "
            f"({min(r['call_s']):.2f}–{max(r['call_s']):.2f}) | {r['cpu_s_median']:.2f} | {vs} "
            f"| {fmt(pt.get('gather_calls'), digits=1)} | {fmt(sent, MB)} "
            f"| {fmt(r['gen_peak_rss_bytes'], MiB, 0)} | {fmt(r['live_window_peak_bytes'], MiB, 1)} "
            f"| {token_check(r, bound)} |")
    return "\n".join(lines)


def rl_table(rows: list[dict]) -> str:
    bound = next((r for r in rows if r["variant"] == "single" and r["status"] == "ok"), None)
    lines = ["| row | iteration s (median) | generate / train s | CPU s/iteration/rank "
             "| vs bound: wall / CPU | gathers/iteration | MB sent/rank/iteration "
             "| peak RSS/rank MiB | model states/rank MiB | loss (rank 0) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        label = LABELS[r["variant"]]
        if r["status"] != "ok":
            lines.append(f"| {label} | {na(r)} | | | | | | | | |")
            continue
        if "rl_iter_s_median" not in r:
            continue
        pi = r["rl_per_iteration"] or {}
        vs = (f"{r['rl_iter_s_median'] / bound['rl_iter_s_median']:.2f}× / "
              f"{r['rl_cpu_s_median'] / bound['rl_cpu_s_median']:.2f}×"
              if bound and "rl_iter_s_median" in bound else "—")
        sent = pi.get("sent_bytes", pi.get("gather_payload_bytes"))
        losses = r["rl_losses"][0]
        lines.append(
            f"| {label} | {r['rl_iter_s_median']:.2f} | {r['rl_gen_s_median']:.2f} / "
            f"{r['rl_train_s_median']:.2f} | {r['rl_cpu_s_median']:.2f} | {vs} | {fmt(pi.get('gather_calls'), digits=0)} "
            f"| {fmt(sent, MB)} | {fmt(r['rl_peak_rss_bytes'], MiB, 0)} "
            f"| {fmt(r['model_states_bytes'], MiB, 1)} | {losses[0]:.3f} → {losses[-1]:.3f} |")
    return "\n".join(lines)


def verdicts(rows: list[dict], precision: str) -> list[str]:
    bound = next((r for r in rows if r["variant"] == "single" and r["status"] == "ok"), None)
    row = next((r for r in rows if r["variant"] == "zc-s3"), None)
    if bound is None or row is None:
        return []
    if row["status"] != "ok":
        return [f"{precision}: stage-3 default: {na(row)}"]
    ratio = row["call_s_median"] / bound["call_s_median"]
    cpu = row["cpu_s_median"] / bound["cpu_s_median"]
    out = [f"{precision}: stage-3 default generates in {ratio:.2f}× the single process's wall "
           f"time ({cpu:.2f}× its CPU time; goal ≤ {GEN_GOAL}×): " + (
               "met" if ratio <= GEN_GOAL else f"NOT met, {ratio / GEN_GOAL:.2f}× over the goal")]
    if "rl_iter_s_median" in row and "rl_iter_s_median" in bound:
        out.append(f"{precision}: stage-3 default RL iteration {row['rl_iter_s_median'] / bound['rl_iter_s_median']:.2f}× "
                   "the single process's (no goal)")
    return out


def run_local(a, variants: list[str], skip_ds: str | None) -> dict:
    from zero_core.testing.ranks import run_ranks
    out = {}
    env = {"DS_ACCELERATOR": "cpu", "ZERO_CORE_RANKS_PER_NODE": str(RANKS), "OMP_NUM_THREADS": "1"}
    for precision in a.precisions:
        runs: dict[str, list] = {v: [] for v in variants}
        for rnd in range(a.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for i, v in enumerate(order):
                if v.startswith("ds-") and skip_ds:
                    runs[v] = [{"status": "unavailable", "reason": skip_ds}]
                    continue
                if runs[v] and runs[v][-1]["status"] != "ok":
                    continue
                log(f"{precision} round {rnd + 1}/{a.rounds} [{i + 1}/{len(order)}] {v}: "
                    f"{LABELS[v]} ... (load {os.getloadavg()[0]:.2f})")
                t0, load0 = time.perf_counter(), os.getloadavg()[0]
                results = run_ranks(WORKER, RANKS, launcher="torchrun", env=env, check=False,
                                    args=worker_args(a, v, precision, rl=a.rl_reps > 0),
                                    timeout=a.timeout)
                res = job_outcome(results)
                res.update(wall_s=time.perf_counter() - t0, load=[load0, os.getloadavg()[0]])
                runs[v].append(res)
                if res["status"] == "ok":
                    calls = slowest(res["reports"], lambda rep: rep["generation"]["call_s"])
                    log(f"  {v}: generate {statistics.median(calls):.2f} s/call, job "
                        f"{res['wall_s']:.0f} s (load {load0:.2f} → {res['load'][1]:.2f})")
                else:
                    log(f"  {v}: {res['status']}: {res['reason'][:300]}")
        rows = [summarize(v, runs[v], a) for v in variants]
        loads = [x for v in variants for r in runs[v] for x in r.get("load", [])]
        out[precision] = {"rows": rows, "load_1min": [min(loads), max(loads)] if loads else None,
                          "runs": {v: [{k: x for k, x in r.items() if k != "reports"} for r in rs]
                                   for v, rs in runs.items()}}
    return out


# ---------------------------------------------------------------- the cluster mode

def run_cluster(a) -> list[dict]:
    """Plain ZeRO-3 vs ZeRO++ generation at budget 0 on the emulated two-node cluster,
    through ci/bench/cluster.py's machinery (its worker protocol and summary)."""
    import cluster as bc
    from zero_core.testing.emulated_cluster import ClusterError, EmulatedCluster, format_rate
    from zero_core.testing.ranks import run_ranks
    variants = [v.strip() for v in a.cluster_variants.split(",") if v.strip()]
    rows = []
    try:
        with EmulatedCluster(rate=a.rates[0], prefix="zcgen") as cluster:
            log(f"emulated cluster: {cluster.describe()}")
            for rate in a.rates:
                cluster.set_rate(rate)
                for rpn in a.ranks_per_node:
                    for precision in a.precisions:
                        for v in variants:
                            t0 = time.perf_counter()
                            row = {"rate": format_rate(cluster.rate_bps), "ranks_per_node": rpn,
                                   "precision": precision, "variant": v,
                                   "load": [os.getloadavg()[0]]}
                            log(f"{row['rate']}, 2 nodes × {rpn}, {precision}, {v} ... "
                                f"(load {row['load'][0]:.2f})")
                            try:
                                results = run_ranks(
                                    WORKER, rpn * cluster.num_nodes,
                                    args=worker_args(a, v, precision, rl=False),
                                    env={"DS_ACCELERATOR": "cpu"}, timeout=a.timeout,
                                    check=False, cluster=cluster)
                                res = job_outcome(results)
                                if res["status"] == "ok":
                                    row.update(bc.summarize(res["reports"], cluster.rate_bps))
                                    row["status"] = "ok"
                                else:
                                    row.update(status=res["status"], reason=res["reason"])
                            except Exception as exc:  # noqa: BLE001 - keep the other rows
                                row.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
                            row["load"].append(os.getloadavg()[0])
                            row["wall_s"] = time.perf_counter() - t0
                            if row["status"] == "ok":
                                world = 2 * rpn
                                row["tokens_per_s"] = world * a.batch * a.new_tokens / row["step_s_median"]
                                log(f"  {row['tokens_per_s']:.1f} tokens/s, job {row['wall_s']:.0f} s")
                            else:
                                log(f"  {row['status']}: {row['reason'][:300]}")
                            rows.append(row)
    except ClusterError as exc:
        raise SystemExit(f"bench/generation.py --cluster: {exc}")
    return rows


def cluster_table(rows: list[dict], a) -> tuple[str, list[str]]:
    lines = ["| link | ranks | precision | row | tokens/s | call s (median) | inter-node MB/rank/decode step (ledger) "
             "| veth MB/rank/decode step | link-bound s/call | ZeRO++ speed-up |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    base, notes = {}, []
    for r in rows:
        key = (r["rate"], r["ranks_per_node"], r["precision"])
        head = f"| {r['rate']} | 2 × {r['ranks_per_node']} | {r['precision']} | {LABELS[r['variant']]}"
        if r["status"] != "ok":
            lines.append(f"{head} | {na(r)} | | | | | |")
            continue
        base.setdefault(key, r)
        speed = base[key]["step_s_median"] / r["step_s_median"]
        steps = a.new_tokens
        ledger, link = r["ledger_inter_node_bytes_per_rank_step"], r["link_bytes_per_rank_step"]
        lines.append(f"{head} | {r['tokens_per_s']:.1f} | {r['step_s_median']:.2f} "
                     f"| {fmt(None if ledger is None else ledger / steps, MB)} "
                     f"| {fmt(None if link is None else link / steps, MB)} "
                     f"| {fmt(r['link_bound_s'])} | {speed:.2f}× |")
        if r is not base[key] and r["rate"] == "1gbit" and "zpp" in r["variant"]:
            verdict = ("met" if speed >= CLUSTER_GOAL else
                       f"NOT met: {CLUSTER_GOAL / speed:.2f}× short")
            notes.append(f"1 Gbit/s, 2 × {r['ranks_per_node']} ranks, {r['precision']}: ZeRO++ "
                         f"{speed:.2f}× plain ZeRO-3 (goal ≥ {CLUSTER_GOAL}×): {verdict}")
    return "\n".join(lines), notes


# ---------------------------------------------------------------- main

def setup_venv() -> int:
    python = be.setup_bench_venv()
    import importlib.metadata as md
    try:
        pin = f"transformers=={md.version('transformers')}"  # the one this env runs
    except md.PackageNotFoundError:
        pin = "transformers"
    subprocess.run([python, "-m", "pip", "install", "--quiet", pin], check=True)
    print(python)
    return 0


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    m = p.add_argument_group("model and decoding")
    m.add_argument("--layers", type=int, default=12, help="GPT-2 layers (default 12)")
    m.add_argument("--width", type=int, default=384, help="hidden size n_embd (default 384)")
    m.add_argument("--heads", type=int, default=6, help="attention heads (default 6)")
    m.add_argument("--vocab", type=int, default=12000,
                   help="vocabulary (default 12000: with the defaults above 25.9M parameters, "
                        "the tied embedding 18%% of them)")
    m.add_argument("--batch", type=int, default=None,
                   help="prompts per rank (default 4; --cluster: 2)")
    m.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    m.add_argument("--new-tokens", type=int, default=None,
                   help="tokens generated per prompt, greedy (default 48; --cluster: 16)")
    m.add_argument("--precision", default=None,
                   help="comma-separated fp32,bf16 (default both; --cluster: bf16)")
    r = p.add_argument_group("runs")
    r.add_argument("--only", default="*",
                   help="comma-separated row names or globs, e.g. 'single,zc-*' (names: "
                        + ", ".join(v for v, _ in ROWS) + ")")
    r.add_argument("--warmup", type=int, default=1, help="untimed generate calls first (default 1)")
    r.add_argument("--reps", type=int, default=None, help="timed generate calls (default 3; --cluster: 2)")
    r.add_argument("--rl-warmup", type=int, default=1, help="untimed RL iterations first (default 1)")
    r.add_argument("--rl-reps", type=int, default=3, help="timed RL iterations (default 3; 0: no RL table)")
    r.add_argument("--rounds", type=int, default=1,
                   help="run every row this many times, alternating the order (busy machine)")
    r.add_argument("--release-cache", action="store_true",
                   help="hybrid-engine rows: release_inference_cache true (default false)")
    r.add_argument("--timeout", type=float, default=1200, help="seconds per job (default 1200)")
    r.add_argument("--quick", action="store_true",
                   help="smoke run: 4 layers x 256, vocab 8000 (5.2M parameters), 16 new tokens, fp32 only, 1 timed call and "
                        "1 RL iteration (--cluster: 1 Gbit/s, 1 rank per node, 4 tokens)")
    plots.add_arguments(p, "generation")
    c = p.add_argument_group("cluster mode")
    c.add_argument("--cluster", action="store_true",
                   help="plain ZeRO-3 vs ZeRO++ at budget 0 on the emulated two-node cluster")
    c.add_argument("--rates", default="100mbit,1gbit", help="link rates (default 100mbit,1gbit)")
    c.add_argument("--ranks-per-node", default="1,2", help="comma-separated (default 1,2)")
    c.add_argument("--cluster-variants", default=CLUSTER_VARIANTS,
                   help=f"rows to run there, the first is the speed-up baseline (default {CLUSTER_VARIANTS})")
    p.add_argument("--setup-bench-venv", action="store_true",
                   help="create the DeepSpeed benchmark environment (with transformers), then exit")
    a = p.parse_args(argv)
    cl = a.cluster
    a.batch = a.batch or (2 if cl else 4)
    a.new_tokens = a.new_tokens or (16 if cl else 48)
    a.reps = a.reps or (2 if cl else 3)
    a.precisions = [x.strip() for x in (a.precision or ("bf16" if cl else "fp32,bf16")).split(",")]
    if a.quick:
        a.layers, a.width, a.heads, a.vocab = 4, 256, 4, 8000
        a.new_tokens, a.reps, a.rl_reps, a.rounds = (4 if cl else 16), 1, 1, 1
        if a.precision is None:
            a.precisions = ["bf16" if cl else "fp32"]
        if cl:
            a.rates, a.ranks_per_node = "1gbit", "1"
    a.rates = [x.strip() for x in a.rates.split(",") if x.strip()]
    a.ranks_per_node = [int(x) for x in a.ranks_per_node.split(",") if x.strip()]
    if any(x not in ("fp32", "bf16") for x in a.precisions):
        p.error("--precision: fp32 and/or bf16")
    if a.reps < 1 or a.warmup < 0 or a.rl_reps < 0 or a.rounds < 1:
        p.error("--reps and --rounds must be >= 1, --warmup and --rl-reps >= 0")
    return p, a


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p, a = parse(argv)
    if a.setup_bench_venv:
        return setup_venv()
    meta = plots.start(a, "generation", __file__, argv)
    pats = [x.strip() for x in a.only.split(",") if x.strip()]
    variants = [v for v, _ in ROWS if any(fnmatch.fnmatch(v, pat) for pat in pats)]
    if not a.cluster and not variants:
        p.error(f"--only {a.only!r} matches no row")
    wants_ds = any(v.startswith("ds-") for v in
                   (a.cluster_variants.split(",") if a.cluster else variants))
    skip_ds = be.deepspeed_or_reexec(__file__, argv) if wants_ds else None
    if skip_ds:
        log(f"DeepSpeed rows n/a: {skip_ds}")
    import torch
    try:
        import transformers
    except ImportError:
        raise SystemExit(f"transformers is not importable in {sys.executable}: "
                         "python ci/bench/generation.py --setup-bench-venv adds it")
    started, up0 = time.time(), uptime()
    head = (f"# {time.strftime('%Y-%m-%d %H:%M')}, tree {tree()}; python {platform.python_version()}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}; "
            f"{os.cpu_count()} cores, 1 thread per rank\n# GPT-2 {a.layers} layers × {a.width} "
            f"({a.heads} heads), vocab {a.vocab}; {a.batch} prompts × {a.prompt_len} tokens per "
            f"rank, {a.new_tokens} new tokens greedy; {a.warmup} + {a.reps} generate calls"
            + ("" if a.cluster else f", {a.rl_warmup} + {a.rl_reps} RL iterations")
            + f"\n# uptime before: {up0}")
    print(head, flush=True)
    result = {"args": {k: v for k, v in vars(a).items()}, "tree": tree(), "uptime_before": up0,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "python": sys.executable}
    if a.cluster:
        rows = run_cluster(a)
        table, notes = cluster_table(rows, a)
        print(f"\n## Generation at budget 0 on the emulated two-node cluster\n\n{table}\n")
        for n in notes:
            print(f"- {n}")
        result["cluster"] = rows
    else:
        local = run_local(a, variants, skip_ds)
        nparams = next((r["num_parameters"] for res in local.values() for r in res["rows"]
                        if r["status"] == "ok"), None)
        for precision, res in local.items():
            lo, hi = res["load_1min"] or (0, 0)
            print(f"\n## {precision}: generation ({fmt(nparams, 1e6, 1)}M parameters, load {lo:.2f}–{hi:.2f})\n")
            print(generation_table(res["rows"]))
            if a.rl_reps:
                print(f"\n## {precision}: RL iteration (generate + one training step)\n")
                print(rl_table(res["rows"]))
            print()
            for v in verdicts(res["rows"], precision):
                print(f"- {v}")
        result["local"] = local
    up1 = uptime()
    print(f"\n# uptime after: {up1}; {time.time() - started:.0f} s in all")
    result.update(uptime_after=up1, wall_s=time.time() - started)
    plots.finish(a, "generation", {"benchmark": "generation", **result}, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
