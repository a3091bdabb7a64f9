"""The benchmarks' charts (ci/bench/plots.py, ci/bench/figures.py): every benchmark script
writes JSON and a PNG beside its table, the committed JSONs under docs/images/ redraw, a
transcribed one says so, and without matplotlib the script says the plot was skipped."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BENCH = os.path.join(ROOT, "ci", "bench")
IMAGES = os.path.join(ROOT, "docs", "images")
NAMES = ("comm", "device", "engine", "stage3", "largest", "cluster", "generation", "kernels",
         "offload", "infinity")


def _plots():
    sys.path.insert(0, BENCH)
    try:
        spec = importlib.util.spec_from_file_location("plots", os.path.join(BENCH, "plots.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(BENCH)


@pytest.mark.parametrize("name", NAMES)
def test_every_benchmark_writes_json_and_a_chart(name):
    text = open(os.path.join(BENCH, f"{name}.py")).read()
    for call in (f'plots.add_arguments(', f'plots.start(', f'plots.finish('):
        assert call in text, (name, call)
    assert f'"{name}"' in text


def test_paths_default_next_to_each_other():
    plots = _plots()
    ns = types.SimpleNamespace(json=None, plot=None)
    assert plots.resolve_paths(ns, "engine") == (os.path.join(IMAGES, "engine.json"),
                                                 os.path.join(IMAGES, "engine.png"))
    ns = types.SimpleNamespace(json="/tmp/x/out.json", plot=None)
    assert plots.resolve_paths(ns, "engine") == ("/tmp/x/out.json", "/tmp/x/out.png")
    ns = types.SimpleNamespace(json=None, plot="/tmp/y/c.png")
    assert plots.resolve_paths(ns, "engine") == ("/tmp/y/c.json", "/tmp/y/c.png")


@pytest.mark.parametrize("name", NAMES)
def test_committed_json_redraws(name, tmp_path):
    path = os.path.join(IMAGES, f"{name}.json")
    assert os.path.exists(path), f"docs/images/{name}.json is not committed"
    data = json.load(open(path))
    meta = data["meta"]
    assert meta["command"].startswith(("python ci/bench/", "mpirun")) and meta["date"]
    assert os.path.exists(os.path.join(IMAGES, f"{name}.png"))
    if "source" in meta:
        assert "transcribed" in meta["source"] and "rerun with" in meta["source"]
    else:
        assert "load average" in meta["uptime_before"] and "load average" in meta["uptime_after"]
    out = tmp_path / f"{name}.png"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "plots.py"), path, str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.stat().st_size > 10_000


def test_without_matplotlib_the_plot_is_skipped_with_one_line(tmp_path):
    """The JSON is still written; the chart is not, and one line says why."""
    code = ("import sys, types; sys.modules['matplotlib'] = None; "
            f"sys.path.insert(0, {BENCH!r}); import plots; "
            "ns = types.SimpleNamespace(json=sys.argv[1], plot=None, replot=None); "
            "plots.finish(ns, 'device', {'results': []}, "
            "plots.start(ns, 'device', 'ci/bench/device.py', []))")
    out = tmp_path / "device.json"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["meta"]["benchmark"] == "device"
    assert not (tmp_path / "device.png").exists()
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("plot skipped")]
    assert len(skipped) == 1 and "matplotlib" in skipped[0]
