"""The Lightning and Transformers integrations stay optional extras.

The core install (``pip install zero-core``) must not grow: its dependencies name none of
the frameworks, and importing zero-core and training with it loads none of them (a user
without lightning/transformers installed must not notice they exist). The extras declare
the ranges the integrations are tested with, and every package folder is listed for
setuptools, so a non-editable install carries all of them.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def _names(requirements) -> set[str]:
    import re
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def test_the_core_dependencies_name_no_framework():
    core = _names(PYPROJECT["project"]["dependencies"])
    assert core.isdisjoint(FRAMEWORKS), core


def test_each_integration_has_its_extra_with_a_bounded_range():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert _names(extras["lightning"]) == {"lightning"}
    assert _names(extras["transformers"]) == {"transformers", "accelerate"}
    for req in extras["lightning"] + extras["transformers"]:
        assert ">=" in req and "<" in req.replace("<=", ""), f"{req}: give the tested range"


def test_training_with_zero_core_loads_no_framework():
    code = r"""
import json, sys, torch, zero_core
model = torch.nn.Linear(4, 2)
engine, *_ = zero_core.initialize(model=model, config={
    "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
engine.backward(engine(torch.randn(2, 4)).sum())
engine.step()
import zero_core.integrations, zero_core.integrations.transformers  # the package docs only
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in %r)))
""" % (FRAMEWORKS,)
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_package_folder_is_installed():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    mapped = PYPROJECT["tool"]["setuptools"]["package-dir"]
    missing = []
    for name, folder in mapped.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            package = ".".join([name, *rel.parts])
            if package not in listed:
                missing.append(package)
    assert missing == [], f"add {missing} to [tool.setuptools] packages in pyproject.toml"
