"""Third-party plugins, installed for real and discovered through package metadata.

The example plugin (examples/plugin_template) is built and installed with pip into a
temporary directory; every check runs in a child process with that directory on
PYTHONPATH, so the main environment is never changed. A broken plugin and a plugin that
reuses a name are written as minimal installed distributions (a ``.dist-info`` folder
with METADATA and entry_points.txt: what pip would leave), in their own directories.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zero_core.testing.ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "examples" / "plugin_template"
EXAMPLE_DIST = "zero-core-example-plugin"
SELECTION_VARS = ("ZERO_CORE_ACCELERATOR", "ZERO_CORE_COMM")


def _setuptools_builds_wheels() -> bool:
    """setuptools >= 70.1 builds wheels without the separate `wheel` package."""
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(p) for p in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    """The example plugin, pip-installed into its own directory (built from a copy, so the
    checkout gets no build/ or egg-info folders)."""
    work = tmp_path_factory.mktemp("plugin")
    source = work / "src"
    shutil.copytree(TEMPLATE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
           str(target), str(source)]
    # Offline and fast when this environment's setuptools can build the wheel itself;
    # otherwise pip fetches a build backend into an isolated environment.
    if _setuptools_builds_wheels():
        cmd.insert(4, "--no-build-isolation")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip could not install the example plugin:\n{proc.stderr}"
    return target


def _fake_distribution(root: Path, dist: str, entry_name: str, module: str, source: str) -> Path:
    """An installed distribution as pip leaves it: the module plus a .dist-info folder."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[zero_core]\n{entry_name} = {module}\n")
    return root


@pytest.fixture(scope="module")
def broken_dir(tmp_path_factory) -> Path:
    return _fake_distribution(
        tmp_path_factory.mktemp("broken"), "zero-core-broken-plugin", "broken",
        "zero_core_broken_plugin",
        'raise ImportError("libexample.so.3: cannot open shared object file")\n')


@pytest.fixture(scope="module")
def duplicate_dir(tmp_path_factory) -> Path:
    return _fake_distribution(
        tmp_path_factory.mktemp("duplicate"), "zero-core-copycat-plugin", "copycat",
        "zero_core_copycat_plugin", """
        from zero_core.interfaces.hookspecs import hookimpl
        from zero_core.backends.accelerators.cpu import CpuAccelerator

        class Copycat(CpuAccelerator):
            name = "example-cpu"   # the example plugin's name, on purpose

        @hookimpl
        def zero_core_accelerators():
            return [Copycat]
        """)


def _run(code: str, *paths: Path, env=None, args=()) -> subprocess.CompletedProcess:
    """Run Python *code* in a child with *paths* on PYTHONPATH and selection vars cleared."""
    child_env = {k: v for k, v in os.environ.items() if k not in SELECTION_VARS}
    child_env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), child_env.get("PYTHONPATH", "")])
    child_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=child_env,
                          capture_output=True, text=True, timeout=120)


def _json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


DESCRIBE_REGISTRY = """
    import json
    from zero_core.runtime import registry
    reg = registry.load()
    print(json.dumps({
        "accelerators": {n: [c.package, c.plugin, c.obj.__module__] for n, c in reg.accelerators.items()},
        "communicators": {n: [c.package, c.plugin, c.obj.__module__] for n, c in reg.communicators.items()},
        "plugins": reg.plugins, "broken": reg.broken}))
"""


def test_example_plugin_is_discovered_through_its_entry_point(plugin_dir):
    found = _json(_run(DESCRIBE_REGISTRY, plugin_dir))
    assert found["accelerators"]["example-cpu"] == [
        EXAMPLE_DIST, "example", "zero_core_example_plugin.accelerator"]
    assert found["communicators"]["example-gloo"] == [
        EXAMPLE_DIST, "example", "zero_core_example_plugin.communicator"]
    # the built-in backends come through the same kind of entry point, side by side
    assert found["accelerators"]["cpu"][0] == "zero-core"
    assert {"name": "example", "package": EXAMPLE_DIST,
            "module": "zero_core_example_plugin.plugin"} in found["plugins"]
    # and without the directory on the path, the plugin is not there at all
    bare = _json(_run(DESCRIBE_REGISTRY))
    assert "example-cpu" not in bare["accelerators"]


def test_report_lists_the_plugin_with_its_package(plugin_dir):
    proc = _run("from zero_core.cli import main; raise SystemExit(main())", plugin_dir,
                args=["report", "--json"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    accel = {a["name"]: a for a in report["accelerators"]}
    assert accel["example-cpu"]["package"] == EXAMPLE_DIST and accel["example-cpu"]["available"]
    comms = {c["name"]: c for c in report["communicators"]}
    assert comms["example-gloo"]["package"] == EXAMPLE_DIST
    assert any(p["package"] == EXAMPLE_DIST for p in report["plugins"])
    text = _run("from zero_core.cli import main; raise SystemExit(main())", plugin_dir,
                args=["report"]).stdout
    assert "example-cpu" in text and f"from {EXAMPLE_DIST}" in text


SELECT = """
    import json, sys
    from zero_core.runtime import registry
    from zero_core.runtime.launch import discover
    reg = registry.load()
    explicit = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None
    acc = reg.accelerator_class(explicit)
    comm_explicit = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None
    comm = reg.communicator_class(comm_explicit, default=acc().default_comm_for(discover()))
    print(json.dumps([acc.name, acc.__module__, comm.name, comm.__module__]))
"""


def test_plugin_selected_by_environment_variables(plugin_dir):
    got = _json(_run(SELECT, plugin_dir, env={"ZERO_CORE_ACCELERATOR": "example-cpu",
                                             "ZERO_CORE_COMM": "example-gloo"}))
    assert got == ["example-cpu", "zero_core_example_plugin.accelerator",
                   "example-gloo", "zero_core_example_plugin.communicator"]


def test_plugin_selected_by_explicit_arguments_over_environment(plugin_dir):
    # the environment says "cpu", the explicit argument (config) wins
    got = _json(_run(SELECT, plugin_dir, env={"ZERO_CORE_ACCELERATOR": "cpu"},
                     args=["example-cpu", "example-gloo"]))
    assert got[0] == "example-cpu" and got[2] == "example-gloo"


def test_plugin_accelerator_brings_its_default_communicator(plugin_dir):
    got = _json(_run(SELECT, plugin_dir, args=["example-cpu"]))
    assert got[2:] == ["example-gloo", "zero_core_example_plugin.communicator"]


def test_plugin_never_wins_auto_detection_over_builtin_cpu(plugin_dir):
    # priority -10 < cpu's 0: auto-detection keeps the built-in CPU accelerator
    code = ("import json; from zero_core.runtime import registry; "
            "print(json.dumps(registry.load().accelerator_class().name))")
    assert _json(_run(code, plugin_dir)) == "cpu"


COLLECTIVES_WORKER = """
import torch
import zero_core
from zero_core.testing.ranks import report

rt = zero_core.init_distributed()   # selection from ZERO_CORE_ACCELERATOR / ZERO_CORE_COMM
comm, r, n = rt.comm, rt.rank, rt.world_size

def data(rank, numel, seed):
    # every rank can regenerate every other rank's input: the reference needs no comm
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64)

def err(got, want):
    return float((got.double() - want).abs().max())

out = {"accelerator": type(rt.accelerator).__module__, "comm": type(comm).__module__,
       "kernels": rt.kernels.name, "errors": {}}
e = out["errors"]
k = 1000 + 17 * 3 + 1   # not a round number

x = data(r, n * k, 1).float()
comm.all_reduce(x, op="sum")
e["all_reduce_sum"] = err(x, sum(data(i, n * k, 1) for i in range(n)))

x = data(r, n * k, 2).float()
comm.all_reduce(x, op="max")
e["all_reduce_max"] = err(x, torch.stack([data(i, n * k, 2) for i in range(n)]).amax(0))

x = data(r, k, 3).float()
gathered = torch.empty(n * k)
comm.all_gather_into(gathered, x)
e["all_gather_into"] = err(gathered, torch.cat([data(i, k, 3) for i in range(n)]))

x = data(r, n * k, 4).float()
part = torch.empty(k)
handle = comm.reduce_scatter(part, x, op="avg", async_op=True)
handle.wait()
mean = sum(data(i, n * k, 4) for i in range(n)) / n
e["reduce_scatter_avg_async"] = err(part, mean[r * k:(r + 1) * k])

x = data(r, k, 5).float() if r == 1 else torch.zeros(k)
comm.broadcast(x, src=1)
e["broadcast_from_1"] = err(x, data(1, k, 5))

x = data(r, n * k, 6).float()
y = torch.empty(n * k)
comm.all_to_all_single(y, x)
e["all_to_all_single"] = err(y, torch.cat([data(i, n * k, 6)[r * k:(r + 1) * k] for i in range(n)]))

comm.barrier()
out["ledger_calls"] = {op: d["calls"] for op, d in comm.ledger.snapshot()["ops"].items()}
report(out)
zero_core.runtime.context.shutdown()
"""


@pytest.mark.multirank
def test_two_rank_job_runs_collectives_through_the_plugin(plugin_dir, tmp_path):
    worker = tmp_path / "plugin_collectives.py"
    worker.write_text(COLLECTIVES_WORKER)
    env = {"PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")]),
           "ZERO_CORE_ACCELERATOR": "example-cpu", "ZERO_CORE_COMM": "example-gloo"}
    results = run_ranks(str(worker), 2, launcher="torchrun", env=env, timeout=180)
    for res in results:
        rep = res.report
        assert rep is not None, res.log
        assert rep["accelerator"] == "zero_core_example_plugin.accelerator"
        assert rep["comm"] == "zero_core_example_plugin.communicator"
        assert rep["kernels"] == "reference"
        for op, error in rep["errors"].items():
            # float32 transport of float64 data: sums of 2 values round at ~1e-7 relative
            assert error < 1e-5, (res.rank, op, error)
        assert rep["ledger_calls"] == {"all_reduce": 2, "all_gather_into": 1, "reduce_scatter": 1,
                                       "broadcast": 1, "all_to_all_single": 1, "barrier": 1}


def test_broken_plugin_is_named_and_does_not_hide_the_others(plugin_dir, broken_dir):
    found = _json(_run(DESCRIBE_REGISTRY, plugin_dir, broken_dir))
    assert "example-cpu" in found["accelerators"] and "cpu" in found["accelerators"]
    broken = [b for b in found["broken"] if b["package"] == "zero-core-broken-plugin"]
    assert len(broken) == 1, found["broken"]
    assert broken[0]["name"] == "broken"
    assert broken[0]["module"] == "zero_core_broken_plugin"
    assert "ImportError" in broken[0]["error"] and "libexample.so.3" in broken[0]["error"]
    # the report says the same to a person, and --check turns it into a failure
    proc = _run("from zero_core.cli import main; raise SystemExit(main())", plugin_dir,
                broken_dir, args=["report", "--check"])
    assert "broken from package zero-core-broken-plugin" in proc.stdout
    assert "libexample.so.3" in proc.stdout
    assert proc.returncode == 1 and "zero-core-broken-plugin" in proc.stderr


def test_asking_for_a_name_lists_broken_plugins(plugin_dir, broken_dir):
    proc = _run(SELECT, plugin_dir, broken_dir, args=["no-such-accelerator"])
    assert proc.returncode != 0
    assert "unknown accelerator 'no-such-accelerator'" in proc.stderr
    assert "example-cpu [zero-core-example-plugin]: available" in proc.stderr
    assert "broken from package 'zero-core-broken-plugin'" in proc.stderr


def test_duplicate_names_are_refused_naming_both_packages(plugin_dir, duplicate_dir):
    proc = _run(DESCRIBE_REGISTRY, plugin_dir, duplicate_dir)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "PluginError" in last and "'example-cpu' is contributed twice" in last
    assert EXAMPLE_DIST in last and "zero-core-copycat-plugin" in last
    report = _run("from zero_core.cli import main; raise SystemExit(main())", plugin_dir,
                  duplicate_dir, args=["report", "--check"])
    assert "contributed twice" in report.stdout and report.returncode == 1
