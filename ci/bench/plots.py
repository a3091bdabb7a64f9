"""Results files and charts shared by the benchmark scripts in ci/bench/.

Every benchmark script prints its markdown table as before and, through this module, also
writes its results as JSON and draws them as a PNG:

  --plot PATH    the chart (default docs/images/<name>.png, or next to --json when only
                 --json is given, so that a run into a scratch JSON never overwrites the
                 charts committed under docs/images/)
  --json PATH    every number of the run (default next to the PNG, same name, .json)
  --replot JSON  draw the PNG again from a saved JSON, without running anything

The JSON holds what the script always wrote, plus ``meta``: the command, the date, the
checkout's commit, the machine's cores and ``uptime`` before and after the run. A JSON
written by hand from a table recorded elsewhere (a run too long to repeat) says so in
``meta.source``, and its chart's caption says it was transcribed.

matplotlib (Agg backend, PNG) is a benchmark-only dependency: ``pip install -e .[bench]``
(setup_bench_venv in ci/bench/engine.py installs it too). Without it the table and the
JSON are still written and one line says the plot was skipped and why. The charts
themselves, one per benchmark, live in ci/bench/figures.py; this module has the plumbing
and the few chart types they share (bars with whiskers, grouped bars, lines).

    python ci/bench/plots.py docs/images/engine.json    # same as engine.py --replot ...
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
IMAGES = os.path.join(REPO, "docs", "images")
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
          "#8C8C8C", "#CCB974", "#64B5CD"]


# ---------------------------------------------------------------- command line and files

def add_arguments(parser, name: str) -> None:
    """--json, --plot and --replot for benchmark *name* (its PNG: docs/images/<name>.png)."""
    g = parser.add_argument_group("results (JSON and chart)")
    g.add_argument("--json", metavar="PATH", default=None,
                   help=f"write every number here (default: next to the PNG, "
                        f"docs/images/{name}.json)")
    g.add_argument("--plot", metavar="PATH", default=None,
                   help=f"draw the chart here (default docs/images/{name}.png; next to "
                        f"--json when only --json is given)")
    g.add_argument("--replot", metavar="JSON", default=None,
                   help="only redraw the chart from this saved JSON (into --plot, default "
                        "next to it), run nothing")


def resolve_paths(args, name: str) -> tuple[str, str]:
    """(json path, png path) from --json / --plot: each defaults to sit next to the other;
    with neither given, docs/images/<name>.json and .png."""
    js, png = args.json, args.plot
    if png is None:
        png = os.path.splitext(js)[0] + ".png" if js else os.path.join(IMAGES, f"{name}.png")
    if js is None:
        js = os.path.splitext(png)[0] + ".json"
    args.json, args.plot = js, png
    return js, png


def uptime() -> str:
    """``uptime``'s line (the load averages), or the load averages alone."""
    try:
        out = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def tree() -> str:
    """The checkout's commit, with '+ uncommitted changes' when there are any (read-only)."""
    git = ["git", "-C", REPO]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=20).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" + uncommitted changes" if dirty else "")


def start(args, name: str, script: str, argv: list, launcher: str = "") -> dict:
    """The run's ``meta`` as it starts: the command as typed, the date, uptime before.
    With ``--replot`` nothing runs: the chart is redrawn and the process exits here."""
    if args.replot:
        raise SystemExit(replot(args, name))
    rel = os.path.relpath(os.path.abspath(script), REPO)
    command = " ".join([*([launcher] if launcher else []), "python", rel,
                        *(shlex.quote(str(a)) for a in argv)])
    return {"benchmark": name, "command": command, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "tree": tree(), "cpus": os.cpu_count(), "python": sys.executable,
            "uptime_before": uptime(), "started": time.time()}


def finish(args, name: str, result, meta: dict) -> None:
    """Write *result* (with ``meta``, completed here) as JSON to --json and draw --plot."""
    js, png = resolve_paths(args, name)
    meta = dict(meta)
    meta["uptime_after"] = uptime()
    meta["wall_s"] = round(time.time() - meta.pop("started", time.time()), 1)
    data = dict(result) if isinstance(result, dict) else {"results": result}
    data["meta"] = meta
    os.makedirs(os.path.dirname(os.path.abspath(js)), exist_ok=True)
    with open(js, "w") as fh:
        json.dump(data, fh, indent=1, default=str)
    print(f"results: {js}")
    draw(name, data, png)


def replot(args, name: str) -> int:
    """--replot: draw the chart from a saved JSON (nothing is run); exit status."""
    with open(args.replot) as fh:
        data = json.load(fh)
    if args.plot is None:
        args.plot = os.path.splitext(args.replot)[0] + ".png"
    return 0 if draw(name, data, args.plot) else 1


def draw(name: str, data: dict, png: str) -> bool:
    """Draw benchmark *name*'s chart of *data* into *png*; one line says what happened."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401  (fails here, not halfway through a chart)
    except ImportError as exc:
        print(f"plot skipped: matplotlib is not importable in {sys.executable} ({exc}); "
              f"pip install -e '.[bench]' adds it", flush=True)
        return False
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import figures
    fig = figures.DRAW[name](data)
    caption(fig, data.get("meta") or {})
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=110)
    matplotlib.pyplot.close(fig)
    print(f"plot: {png}", flush=True)
    return True


# ---------------------------------------------------------------- chart types

def figure(title: str, ncols: int = 1, nrows: int = 1, width: float = 6.0,
           height: float = 4.2, **kw):
    """A figure of ncols x nrows panels (width/height per panel), a title, room for the
    caption; returns (fig, flat list of axes)."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows + 0.6),
                             squeeze=False, **kw)
    fig.suptitle(textwrap.fill(title, int(14 * width * ncols)), fontsize=10)
    return fig, [ax for row in axes for ax in row]


def caption(fig, meta: dict) -> None:
    """The bottom line: the command, the date, the load; 'TRANSCRIBED' when it was."""
    load = ""
    for key in ("uptime_before", "uptime_after"):
        text = meta.get(key) or ""
        if "load average" in text:
            load += ("" if not load else " → ") + text.split("load average:")[1].split(",")[0].strip()
    parts = [meta.get("command", "?"), meta.get("date", "")]
    if load:
        parts.append(f"1-min load {load} ({meta.get('cpus', '?')} cores)")
    elif meta.get("load"):
        parts.append(f"load {meta['load']}")
    if meta.get("tree"):
        parts.append(f"tree {meta['tree']}")
    text = " · ".join(p for p in parts if p)
    if meta.get("source"):
        text = f"TRANSCRIBED, not rerun: {meta['source']}\n{text}"
    fig.text(0.005, 0.005, text, fontsize=6.5, color="#444444", ha="left", va="bottom",
             wrap=True)
    fig.tight_layout(rect=(0, 0.07 if meta.get("source") else 0.045, 1, 1))


def hbars(ax, labels: list, values: list, *, xlabel: str, lo=None, hi=None, ref=None,
          notes=None, color=None) -> None:
    """Horizontal bars, first label on top; *lo*/*hi*: whiskers (e.g. p10-p90); *ref*:
    (value, label) drawn as a dashed line; *notes*: text at each bar's end; a None value
    draws no bar and its note (e.g. 'skipped') at 0."""
    ys = list(range(len(labels)))[::-1]
    for i, (y, v) in enumerate(zip(ys, values)):
        c = color[i] if isinstance(color, list) else (color or COLORS[0])
        if v is None:
            ax.text(0, y, "  " + (notes[i] if notes else "no result"), va="center", fontsize=7,
                    color="#888888")
            continue
        err = None
        if lo is not None and hi is not None and lo[i] is not None:
            err = [[max(0.0, v - lo[i])], [max(0.0, hi[i] - v)]]
        ax.barh(y, v, color=c, xerr=err, capsize=2, error_kw={"elinewidth": 0.8})
        if notes and notes[i]:
            end = hi[i] if hi is not None and hi[i] is not None else v
            ax.text(end, y, "  " + notes[i], va="center", fontsize=7)
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(-0.7, len(labels) - 0.3)
    ax.set_xlabel(xlabel)
    if ref is not None:
        ax.axvline(ref[0], color="#555555", ls="--", lw=0.9, label=ref[1])
        ax.legend(fontsize=7, loc="best")
    ax.margins(x=0.25)
    ax.grid(axis="x", alpha=0.3)


def grouped_bars(ax, groups: list, series: dict, *, ylabel: str, notes: dict | None = None,
                 logy: bool = False, colors: list | None = None,
                 hatches: list | None = None) -> None:
    """Bars per group (x) for every series (legend); None values leave a gap; *notes*:
    {series: [text per group]} above the bars; *colors*/*hatches*: one per series."""
    n = max(1, len(series))
    width = 0.8 / n
    for k, (name, vals) in enumerate(series.items()):
        xs = [g + (k - (n - 1) / 2) * width for g in range(len(groups))]
        pts = [(x, v) for x, v in zip(xs, vals) if v is not None]
        if pts:
            ax.bar([x for x, _ in pts], [v for _, v in pts], width, label=name,
                   color=colors[k] if colors else COLORS[k % len(COLORS)],
                   hatch=hatches[k] if hatches else None, edgecolor="white")
        for x, text, v in zip(xs, (notes or {}).get(name, []), vals):
            if text and v is not None:
                ax.text(x, v, text, ha="center", va="bottom", fontsize=6.5)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    else:  # room for the legend above the bars
        ax.set_ylim(top=ax.get_ylim()[1] * (1.1 + 0.07 * n))
    ax.legend(fontsize=7, ncol=1 if n < 4 else 2)
    ax.grid(axis="y", alpha=0.3)


def plt_null():
    from matplotlib.ticker import NullFormatter
    return NullFormatter()


def lines(ax, xs: list, series: dict, *, xlabel: str, ylabel: str, logx: bool = False,
          logy: bool = False, xticklabels: list | None = None) -> None:
    """One line with markers per series over *xs*; None values are left out."""
    for k, (name, vals) in enumerate(series.items()):
        pts = [(x, v) for x, v in zip(xs, vals) if v is not None]
        if pts:
            ax.plot([x for x, _ in pts], [v for _, v in pts], marker="o", ms=4, lw=1.4,
                    label=name, color=COLORS[k % len(COLORS)])
    if logx:
        ax.set_xscale("log", base=2 if xticklabels else 10)
    if logy:
        from matplotlib.ticker import LogLocator, ScalarFormatter
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(plt_null())
    if xticklabels:
        ax.set_xticks(xs)
        ax.set_xticklabels(xticklabels, fontsize=7, rotation=30)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def main(argv=None) -> int:
    """python ci/bench/plots.py JSON [PNG]: redraw a benchmark's chart from its JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    with open(argv[0]) as fh:
        data = json.load(fh)
    name = (data.get("meta") or {}).get("benchmark") or os.path.splitext(os.path.basename(argv[0]))[0]
    png = argv[1] if len(argv) > 1 else os.path.splitext(argv[0])[0] + ".png"
    return 0 if draw(name, data, png) else 1


if __name__ == "__main__":
    sys.exit(main())
