"""One chart per benchmark of ci/bench/: what each script's JSON looks like as a PNG.

``DRAW[name](data)`` returns a matplotlib figure of the JSON *data* that ci/bench/<name>.py
wrote (ci/bench/plots.py draws it, captions it with the command, date and load, and saves
it). The charts show the numbers of the tables, nothing derived that the table does not
have: medians with their p10-p90 spread where the table has it, ratios as the table states
them, a missing or skipped row as a labelled gap rather than a zero.
"""
from __future__ import annotations

import statistics

import plots

MiB, GiB, MB, GB = 2**20, 2**30, 1e6, 1e9


def _med(xs):
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------- engine, stage3

def _contenders(data: dict, title: str):
    """Median step (p10-p90), CPU s/step/rank and peak RSS/rank per contender."""
    rows = data.get("results", [])
    ok = {r["name"]: r for r in rows if r.get("status") == "ok"}
    ddp = ok.get("ddp")
    labels = [r["name"] + (f" ({r['launcher']})" if r.get("launcher") == "mpirun" else "")
              for r in rows]
    gap = [r.get("status", "?") if r["name"] not in ok else "" for r in rows]

    def col(key, scale=1.0):
        return [ok[r["name"]][key] / scale if r["name"] in ok else None for r in rows]

    fig, (a, b, c) = plots.figure(title, ncols=3, width=4.6, height=0.32 * len(rows) + 1.8)
    notes = [f"{ok[r['name']]['median_step_s'] / ddp['median_step_s']:.2f}× DDP"
             if r["name"] in ok and ddp else gap[i] for i, r in enumerate(rows)]
    plots.hbars(a, labels, col("median_step_s"), lo=col("p10_step_s"), hi=col("p90_step_s"),
                xlabel="median step time (s), slowest rank; whiskers p10–p90", notes=notes,
                ref=(ddp["median_step_s"], "DDP") if ddp else None)
    plots.hbars(b, labels, col("median_cpu_step_s"), xlabel="CPU seconds per step and rank",
                notes=[f"{v:.2f}" if v is not None else gap[i]
                       for i, v in enumerate(col("median_cpu_step_s"))], color=plots.COLORS[2])
    plots.hbars(c, labels, col("peak_rss_bytes", MiB), xlabel="peak RSS per rank (MiB)",
                notes=[f"{v:,.0f}" if v is not None else gap[i]
                       for i, v in enumerate(col("peak_rss_bytes", MiB))], color=plots.COLORS[1])
    for ax in (b, c):
        ax.set_yticklabels([])
    return fig


def draw_engine(data: dict):
    return _contenders(data, f"ZeRO stages 0–2 vs peers: GPT 'bench', {data.get('ranks', 2)} "
                             f"ranks, fp32 AdamW, {data.get('warmup')} warm-up + "
                             f"{data.get('steps')} timed steps × {data.get('rounds', 1)} round(s)")


def draw_stage3(data: dict):
    return _contenders(data, f"ZeRO stage 3 vs peers: GPT '{data.get('model', 'bench')}', "
                             f"{data.get('ranks', 2)} ranks, fp32 AdamW, {data.get('warmup')} "
                             f"warm-up + {data.get('steps')} timed steps × "
                             f"{data.get('rounds', 1)} round(s)")


# ---------------------------------------------------------------- largest

def draw_largest(data: dict):
    rows = data.get("results", [])
    ladder = {r["index"]: r for r in data.get("ladder", [])}
    ddp = next((r for r in rows if r["name"] == "ddp" and r.get("best")), None)
    labels = [r["name"] for r in rows]
    params, rss, notes, rnotes = [], [], [], []
    for r in rows:
        b = r.get("best")
        if not b:
            params.append(None)
            rss.append(None)
            why = r.get("status") if r.get("status") == "skipped" else "nothing trained"
            notes.append(why)
            rnotes.append(why)
            continue
        rung = ladder.get(r.get("best_rung"), {})
        shape = f"{rung.get('layers', '?')}×{rung.get('width', '?')}"
        params.append(b["params"] / 1e6)
        notes.append(f"{shape}" + (f", {b['params'] / ddp['best']['params']:.2f}× DDP" if ddp else ""))
        rss.append(b["peak_total_rss_bytes"] / GiB if b.get("peak_total_rss_bytes") else None)
        rnotes.append(f"{rss[-1]:.2f}" if rss[-1] is not None else "")
    fig, (a, b) = plots.figure(f"Largest GPT that trains {data.get('steps', 3)} steps on "
                               f"{data.get('ranks', 4)} ranks, fp32 AdamW, "
                               f"{data.get('budget_gib', '?'):g} GiB resident budget for all ranks",
                               ncols=2, width=5.5, height=0.4 * len(rows) + 1.8)
    plots.hbars(a, labels, params, xlabel="parameters of the largest model trained (millions)",
                notes=notes)
    plots.hbars(b, labels, rss, xlabel="peak RSS of all ranks together (GiB)", notes=rnotes,
                ref=(data["budget_gib"], "budget") if data.get("budget_gib") else None,
                color=plots.COLORS[1])
    b.set_yticklabels([])
    return fig


# ---------------------------------------------------------------- comm

def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def draw_comm(data: dict):
    impls = data.get("impls") or []
    ops = list(dict.fromkeys(r["op"] for r in data.get("results", [])))
    fig, axes = plots.figure(f"Collectives on {data.get('world_size')} ranks, "
                             f"{data.get('dtype', 'float32')}: bus bandwidth (median of the "
                             f"slowest rank)", ncols=2, nrows=(len(ops) + 1) // 2,
                             width=5.2, height=3.4)
    for ax, op in zip(axes, ops):
        rows = sorted((r for r in data["results"] if r["op"] == op), key=lambda r: r["bytes"])
        xs = [r["bytes"] for r in rows]
        series = {k: [r["measurements"][k]["busbw_GBps"] for r in rows] for k in impls}
        plots.lines(ax, xs, series, xlabel="message size (full buffer)",
                    ylabel="bus bandwidth (GB/s)", logx=True, xticklabels=[_human(x) for x in xs])
        ax.set_title(op, fontsize=9)
    for ax in axes[len(ops):]:
        ax.set_visible(False)
    for name, why in (data.get("skipped") or {}).items():
        axes[0].text(0.01, 0.98, f"{name}: not measured ({str(why)[:70]})",
                     transform=axes[0].transAxes, fontsize=6, va="top", color="#888888")
    return fig


# ---------------------------------------------------------------- device

def draw_device(data: dict):
    rows = data.get("results", [])
    keys = list(dict.fromkeys((r["stage"], r["comm"]) for r in rows))
    by = {(r["stage"], r["comm"], r["accelerator"]): r for r in rows}
    groups = [f"stage {s}, {c}" for s, c in keys]
    step = {acc: [by[(s, c, acc)]["step_s"] if (s, c, acc) in by else None for s, c in keys]
            for acc in ("cpu", "vdev")}
    notes = {"vdev": [f"{v / cpu:.2f}×" if v and cpu else "" for v, cpu in zip(step["vdev"], step["cpu"])]}
    params = rows[0]["params"] if rows else 0
    n = data.get("ranks", 2)
    formula = 2 * (1 + 1 / n) * params * 4 / MB
    fig, (a, b) = plots.figure(f"zero-core on the vdev device vs the CPU: {n} ranks, GPT "
                               f"{params / 1e6:.1f}M parameters, fp32", ncols=2, width=5.2)
    plots.grouped_bars(a, groups, step, ylabel="median step time (s), slowest rank", notes=notes)
    staged = [by[(s, c, "vdev")]["staged"] / MB if (s, c, "vdev") in by else None for s, c in keys]
    h2d = [by[(s, c, "vdev")]["h2d"] / MB if (s, c, "vdev") in by else None for s, c in keys]
    plots.grouped_bars(b, groups, {"staged (ledger)": staged, "host→device (vdev allocator)": h2d,
                                   "formula 2(1+1/N)·4Ψ": [formula] * len(keys)},
                       ylabel="MB per step and rank (vdev rows)")
    return fig


# ---------------------------------------------------------------- kernels

def _kernel_color(name: str) -> str:
    for key, k in (("cpu native", 0), ("optim_cpu", 2), ("cpu torch path", 1)):
        if key in name:
            return plots.COLORS[k]
    return plots.COLORS[7]  # the pure-torch references


def draw_kernels(data: dict):
    kernels = [r for r in data.get("quantization", []) + data.get("optimizer_kernels", [])]
    peers = data.get("adam_step_peers", [])
    copy = data.get("copy") or {}
    host = data.get("host") or {}
    args = data.get("args") or {}
    ratios = [len(kernels) + 1] + ([len(peers) + 1] if peers else [])
    fig, axes = plots.figure(f"CPU kernels: {args.get('quant_numel', 0):,} elements quantized, "
                             f"{args.get('numel', 0):,}-element optimizer, "
                             f"{host.get('threads', '?')} threads, best of {args.get('reps', '?')} "
                             f"(blue: native C, orange: torch path, green: optim_cpu, "
                             f"grey: reference)", nrows=len(ratios), width=10,
                             height=0.2 * sum(ratios) / len(ratios) + 0.6,
                             gridspec_kw={"height_ratios": ratios})
    plots.hbars(axes[0], [r["kernel"] for r in kernels], [r["GB_per_s"] for r in kernels],
                xlabel="GB/s (bytes read + written over the best time)",
                notes=[f"{r['pct_of_copy']:.0f}% of copy" if r.get("pct_of_copy") is not None
                       else "" for r in kernels], color=[_kernel_color(r["kernel"]) for r in kernels],
                ref=(copy["GB_per_s"], "torch fp32 copy (this run)") if copy.get("GB_per_s") else None)
    if peers:
        plots.hbars(axes[1], [p["optimizer"] for p in peers], [p["best_ms"] for p in peers],
                    lo=[p["best_ms"] for p in peers], hi=[p["median_ms"] for p in peers],
                    xlabel=f"AdamW step, {args.get('numel', 0):,} elements (ms; bar: best, "
                           f"whisker: median)",
                    notes=[f"{p['best_ms']:.1f} / {p['median_ms']:.1f}" for p in peers],
                    color=plots.COLORS[2])
    return fig


# ---------------------------------------------------------------- offload

def _why(row: dict) -> str:
    why = str(row.get("why", ""))
    return "over budget" if "budget" in why else ("no disk" if "disk" in why else why[:24])


def draw_offload(data: dict):
    rows = data.get("results", [])
    top = max([r.get("num_parameters") or r["approx_params"] for r in rows] or [1])
    unit, scale = ("billions", 1e9) if top >= 1e9 else ("millions", 1e6)
    best = {m: max((r["num_parameters"] for r in rows if r["mode"] == m and r.get("ok")), default=None)
            for m in ("stage3", "nvme")}
    ratio = (f": {best['stage3'] / 1e6:,.0f}M vs {best['nvme'] / 1e6:,.0f}M parameters, "
             f"{best['nvme'] / best['stage3']:.2f}×" if best["stage3"] and best["nvme"] else "")
    fig, (a, b) = plots.figure(f"Largest GPT trained on {data.get('ranks', '?')} ranks under a "
                               f"{data.get('budget_gb', '?')} GiB resident budget (all ranks), "
                               f"ZeRO stage 3 alone vs stage 3 + NVMe offload of optimizer "
                               f"states and parameters{ratio}", ncols=2, width=5.4)
    slowest = max([_med(r["step_s"]) for r in rows if r.get("ok")] or [1.0])
    for k, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
        mine = [r for r in rows if r["mode"] == mode]
        ok = [r for r in mine if r.get("ok")]
        color = plots.COLORS[k]
        if ok:
            a.plot([r["num_parameters"] / scale for r in ok], [_med(r["step_s"]) for r in ok],
                   marker="o", color=color, label=f"{mode}: trained")
            for r in ok:
                a.annotate(f"{r['layers']}×{r['width']}", (r["num_parameters"] / scale, _med(r["step_s"])),
                           fontsize=6.5, textcoords="offset points", xytext=(4, -9))
        for r in (r for r in mine if not r.get("ok")):
            y = 1.08 * slowest
            a.scatter([r["approx_params"] / scale], [y], marker="x", color=color, s=40,
                      label=f"{mode}: did not train")
            a.annotate(f"{r['layers']}×{r['width']}: {_why(r)}", (r["approx_params"] / scale, y),
                       fontsize=6.5, textcoords="offset points", xytext=(-30, 6))
    a.set_xlabel(f"parameters ({unit})")
    a.set_ylabel("median step time (s), slowest rank")
    a.set_ylim(0, 1.25 * slowest)
    a.legend(fontsize=7, loc="center right")
    a.grid(alpha=0.3)
    nvme = [r for r in rows if r.get("ok") and r.get("io_per_rank")]
    if nvme:
        r = max(nvme, key=lambda x: x["num_parameters"])
        io = r["io_per_rank"]
        groups = ["optimizer read", "optimizer written", "params read", "params written"]
        plots.grouped_bars(b, groups, {
            "measured": [io[k] / GB for k in ("optimizer_read", "optimizer_written",
                                               "params_read", "params_written")],
            "theory (12Ψ/N, 12Ψ/N, 12Ψ/N, 4Ψ/N)": [io[k] / GB for k in (
                "theory_optimizer", "theory_optimizer", "theory_params_read",
                "theory_params_written")]},
            ylabel=f"GB per rank, last step ({r['layers']}×{r['width']}, NVMe)")
    else:
        b.text(0.5, 0.5, "no offloaded run trained", ha="center", transform=b.transAxes)
    return fig


# ---------------------------------------------------------------- generation

def draw_generation(data: dict):
    if data.get("cluster") is not None:
        rows = data["cluster"]
        keys = list(dict.fromkeys((r["rate"], r["ranks_per_node"], r["precision"]) for r in rows))
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        by = {(r["rate"], r["ranks_per_node"], r["precision"], r["variant"]): r for r in rows}
        val = {v: [by.get((*k, v), {}).get("tokens_per_s") for k in keys] for v in variants}
        base = val[variants[0]]
        notes = {v: [f"{x / b0:.2f}×" if x and b0 else "" for x, b0 in zip(val[v], base)]
                 for v in variants[1:]}
        fig, (a,) = plots.figure("Generation at budget 0 on the emulated two-node cluster: "
                                 "plain ZeRO-3 vs ZeRO++", width=7.5)
        plots.grouped_bars(a, [f"{k[0]}, 2×{k[1]} ranks, {k[2]}" for k in keys], val,
                           ylabel="tokens/s (all ranks)", notes=notes)
        return fig
    local = data.get("local") or {}
    args = data.get("args") or {}
    fig, axes = plots.figure(f"Generation and RL iteration on 2 ranks: GPT-2 {args.get('layers')}×"
                             f"{args.get('width')}, {args.get('new_tokens')} new tokens greedy",
                             ncols=2, nrows=max(1, len(local)), width=5.6,
                             height=0.3 * max((len(v["rows"]) for v in local.values()), default=4) + 1.6)
    for i, (precision, res) in enumerate(local.items()):
        rows = res["rows"]
        ok = {r["variant"]: r for r in rows if r.get("status") == "ok"}
        bound = ok.get("single")
        labels = [r["variant"] for r in rows]
        gap = [f"{'n/a' if r.get('status') == 'unavailable' else r.get('status', '')}: "
               f"{' '.join(str(r.get('reason', '')).split())[:60]}" for r in rows]
        tps = [ok[v]["tokens_per_s"] if v in ok else None for v in labels]
        plots.hbars(axes[2 * i], labels, tps, xlabel=f"{precision}: tokens/s (2 ranks)",
                    notes=[f"{ok[v]['call_s_median'] / bound['call_s_median']:.2f}× bound's time"
                           if v in ok and bound else gap[j] for j, v in enumerate(labels)],
                    ref=(bound["tokens_per_s"], "single process (bound)") if bound else None)
        it = [ok[v].get("rl_iter_s_median") if v in ok else None for v in labels]
        plots.hbars(axes[2 * i + 1], labels, it, xlabel=f"{precision}: RL iteration (s, median)",
                    notes=[f"{x:.2f}" if x is not None else gap[j] for j, x in enumerate(it)],
                    ref=(bound["rl_iter_s_median"], "bound") if bound and bound.get("rl_iter_s_median") else None,
                    color=plots.COLORS[1])
        axes[2 * i + 1].set_yticklabels([])
    return fig


# ---------------------------------------------------------------- cluster

def _rate_bps(text: str) -> float:
    units = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float("inf")


def draw_cluster(data: dict):
    rows = [r for r in data.get("rows", []) if "error" not in r]
    rates = sorted(dict.fromkeys(r["rate"] for r in rows), key=_rate_bps)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["rate"], r["variant"]): r for r in rows}
    fig, (a, b) = plots.figure(f"Emulated two-node cluster: {data.get('nodes', 2)} nodes × "
                               f"{data.get('ranks_per_node')} ranks, worker "
                               f"{data.get('worker', '?')} {data.get('worker_args', '')}".strip(),
                               ncols=2, width=5.4)
    xs = [_rate_bps(r) for r in rates]
    plots.lines(a, xs, {v: [by[(r, v)]["step_s_median"] * 1e3 if (r, v) in by else None
                            for r in rates] for v in variants},
                xlabel="link rate per direction", ylabel="median step time (ms), slowest rank",
                logy=True)
    a.set_xscale("log")
    a.set_xticks(xs)
    a.set_xticklabels(rates)
    a.minorticks_off()
    series, colors, hatches = {}, [], []
    for k, v in enumerate(variants):
        for key, what, hatch in (("ledger_inter_node_bytes_per_rank_step", "ledger", "//"),
                                 ("link_bytes_per_rank_step", "on the veth", None)):
            vals = [by[(r, v)].get(key) if (r, v) in by else None for r in rates]
            if any(x is not None for x in vals):
                series[f"{v}: {what}"] = [x / MB if x is not None else None for x in vals]
                colors.append(plots.COLORS[k % len(plots.COLORS)])
                hatches.append(hatch)
    plots.grouped_bars(b, rates, series, ylabel="inter-node MB per rank and step",
                       colors=colors, hatches=hatches)
    return fig


# ---------------------------------------------------------------- infinity

def draw_infinity(data: dict):
    rows = [r for r in data.get("rows", []) if r.get("ok")]
    names = [r["contender"] for r in rows]
    nsteps = max((len(r["summary"]["steps"]) for r in rows), default=0)
    psi = data.get("params") or (rows[0]["summary"]["num_parameters"] if rows else 0)
    fig, (a, b, c) = plots.figure(f"ZeRO-Infinity, {psi / 1e9:.2f} B parameters on 2 ranks: "
                                  "parameters, fp32 master and Adam states in swap files",
                                  ncols=3, width=4.6)
    plots.grouped_bars(a, [f"step {i + 1}" for i in range(nsteps)],
                       {n: [st.get("wall_s") for st in r["summary"]["steps"]]
                        for n, r in zip(names, rows)}, ylabel="step wall time (s)")
    phases = [("forward_s", "forward"), ("backward_s", "backward"), ("step_s", "optimizer")]
    plots.grouped_bars(b, [p for _, p in phases],
                       {n: [r["summary"]["steps"][-1].get(k) for k, _ in phases]
                        for n, r in zip(names, rows)}, ylabel="seconds in the last step")
    io, colors, hatches = {}, [], []
    for k, (n, r) in enumerate(zip(names, rows)):
        last = r["summary"]["steps"][-1]
        if last.get("read_bytes") is not None:
            io[f"{n}: offload traffic (its counters)"] = [last["read_bytes"] / GB,
                                                          last["written_bytes"] / GB]
            colors.append(plots.COLORS[k])
            hatches.append("//")
        io[f"{n}: block device (/proc/self/io)"] = [
            last[k] / GB if last.get(k) is not None else None for k in ("proc_read", "proc_written")]
        colors.append(plots.COLORS[k])
        hatches.append(None)
    if rows and rows[0]["summary"].get("formula_all_ranks"):
        f = rows[0]["summary"]["formula_all_ranks"]
        io["formula (12Ψ + 4Ψ read, 12Ψ + 2Ψ written)"] = [(f["opt_each_way"] + f["param_read"]) / GB,
                                                          (f["opt_each_way"] + f["param_written"]) / GB]
        colors.append(plots.COLORS[7])
        hatches.append(None)
    plots.grouped_bars(c, ["read", "written"], io, ylabel="GB per step, both ranks (last step)",
                       colors=colors, hatches=hatches)
    return fig


DRAW = {"engine": draw_engine, "stage3": draw_stage3, "largest": draw_largest,
        "comm": draw_comm, "device": draw_device, "kernels": draw_kernels,
        "offload": draw_offload, "generation": draw_generation, "cluster": draw_cluster,
        "infinity": draw_infinity}
