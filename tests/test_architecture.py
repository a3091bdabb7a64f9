"""The layering and size rules of docs/ARCHITECTURE.md, checked by walking the source.

Every ``import`` in ``zero_core/``, ``backends/`` and ``accel_kernels/`` is read with
:mod:`ast` — module-level and function-level alike, since a deferred import is still an
arrow — and resolved to a module of the three packages (``backends`` and ``accel_kernels``
are installed as ``zero_core.backends`` / ``zero_core.accel_kernels``). Then:

- no import cycle;
- the engine imports no backend (it finds them through the registry's entry points);
- a backend imports from the engine only the interfaces, the errors and the kernels;
- the kernels import nothing of the engine but errors and interfaces;
- the framework integrations (``zero_core/integrations``) sit on top: nothing else imports
  them, and only they import lightning, transformers or accelerate;
- no file over 600 lines, at most 12 modules directly in ``zero_core/``, a docstring on
  every module;
- the scripts of ``ci/`` (every ``ci/**/*.py``) keep the same 600 lines and docstring;
  ``zero_core/testing/`` (the launcher and the emulated cluster) is library code like the rest,
  imported by the engine only where it launches ranks;
- every "ARCHITECTURE §N" / "ARCHITECTURE §N" reference names a section of docs/ARCHITECTURE.md.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"zero_core": ROOT / "zero_core", "zero_core.backends": ROOT / "backends",
            "zero_core.accel_kernels": ROOT / "accel_kernels"}
MAX_LINES = 600
MAX_TOP_MODULES = 12
# what a backend may import from zero_core besides zero_core.backends itself
BACKEND_MAY_USE = ("zero_core.interfaces", "zero_core.errors", "zero_core.accel_kernels")
KERNELS_MAY_USE = ("zero_core.interfaces", "zero_core.errors", "zero_core.accel_kernels")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([name, *parts])] = path
    # zero_core/ walks into nothing that the other two map (they are separate folders)
    return found


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _resolve(importer: str, node: ast.AST) -> list[str]:
    """The project modules an import statement names (a ``from pkg import sub`` names the
    submodule when there is one, else the package)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer if _is_package(importer) else importer.rsplit(".", 1)[0]
            parts = package.split(".")
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                   for a in node.names]
    out = []
    for target in targets:
        while target and target not in MODULES and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in MODULES and target != importer:
            out.append(target)
    return out


def _type_checking_imports(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found.update(id(n) for stmt in node.body for n in ast.walk(stmt)
                         if isinstance(n, (ast.Import, ast.ImportFrom)))
    return found


def import_graph(runtime_only: bool = False) -> dict[str, set[str]]:
    """module -> the project modules it imports (all imports; *runtime_only*: without the
    ones under ``TYPE_CHECKING``)."""
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_imports(tree) if runtime_only else set()
        graph[module] = {t for node in ast.walk(tree)
                         if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip
                         for t in _resolve(module, node)}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


GRAPH = import_graph()


def test_the_walk_sees_the_known_arrows():
    # the walk itself: a few arrows that must exist, else the rules below check nothing
    assert "zero_core.interfaces.communicator" in GRAPH["zero_core.backends.comm.mpi"]
    assert "zero_core.engine.contract" in GRAPH["zero_core.stage3.parts"]
    assert "zero_core.factory" in GRAPH["zero_core"]
    assert len(MODULES) > 100


def test_find_cycles_finds_a_cycle_and_only_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


def test_no_import_cycle():
    assert find_cycles(GRAPH) == []


def test_the_engine_imports_no_backend():
    bad = {m: sorted(t for t in targets if _within(t, "zero_core.backends"))
           for m, targets in GRAPH.items()
           if not _within(m, "zero_core.backends") and not _within(m, "zero_core.accel_kernels")}
    assert {m: t for m, t in bad.items() if t} == {}


INTEGRATIONS = "zero_core.integrations"
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def test_nothing_below_imports_the_integrations():
    bad = {m: sorted(t for t in targets if _within(t, INTEGRATIONS))
           for m, targets in GRAPH.items() if not _within(m, INTEGRATIONS)}
    assert {m: t for m, t in bad.items() if t} == {}


def _external_roots(path: pathlib.Path) -> set[str]:
    """Top-level names of every absolute import in *path* (module- and function-level)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_the_integrations_import_the_frameworks():
    bad = {m: sorted(_external_roots(p) & set(FRAMEWORKS)) for m, p in MODULES.items()
           if not _within(m, INTEGRATIONS)}
    assert {m: t for m, t in bad.items() if t} == {}


def test_backends_use_only_the_interfaces():
    bad = {}
    for module, targets in GRAPH.items():
        if not _within(module, "zero_core.backends"):
            continue
        wrong = sorted(t for t in targets if not _within(t, "zero_core.backends")
                       and not any(_within(t, ok) for ok in BACKEND_MAY_USE))
        if wrong:
            bad[module] = wrong
    assert bad == {}


def test_kernels_know_nothing_of_zero():
    bad = {}
    for module, targets in GRAPH.items():
        if not _within(module, "zero_core.accel_kernels"):
            continue
        wrong = sorted(t for t in targets if not any(_within(t, ok) for ok in KERNELS_MAY_USE))
        if wrong:
            bad[module] = wrong
    assert bad == {}


def test_interfaces_point_at_nothing_of_the_engine():
    runtime_graph = import_graph(runtime_only=True)
    allowed = ("zero_core.interfaces", "zero_core.errors")
    bad = {m: sorted(t for t in targets if not any(_within(t, ok) for ok in allowed))
           for m, targets in runtime_graph.items() if _within(m, "zero_core.interfaces")}
    assert {m: t for m, t in bad.items() if t} == {}


# ---- the engine room (ARCHITECTURE §4): the step loop every stage shares -----------------------
ENGINE_ROOM = "zero_core.engine"
STAGES = ("zero_core.stage0to2", "zero_core.stage3")
# what stands on the engine and may hold one: the public API, the factory, the user-facing
# features built on the engine, the test tools and the command line
ABOVE_ENGINE = ("zero_core", "zero_core.factory", ENGINE_ROOM, "zero_core.generation",
                "zero_core.integrations", "zero_core.testing", "zero_core.cli",
                "zero_core.conformance", "zero_core.data")


def _below_engine(module: str) -> bool:
    if not _within(module, "zero_core") or _within(module, "zero_core.backends") \
            or _within(module, "zero_core.accel_kernels"):
        return False
    return module != "zero_core" and not any(_within(module, up) for up in ABOVE_ENGINE[1:])


def engine_handles(path: pathlib.Path) -> list[str]:
    """Where *path* takes an engine (a parameter named ``engine``/``*_engine``) or stores
    one (an attribute so named assigned), or reaches into one (``engine._private``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                if arg.arg == "engine" or arg.arg.endswith("_engine"):
                    found.append(f"line {node.lineno}: takes {arg.arg!r}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and (t.attr == "engine" or t.attr.endswith("_engine")):
                    found.append(f"line {node.lineno}: stores .{t.attr}")
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_")
              and isinstance(node.value, ast.Name) and node.value.id == "engine"):
            found.append(f"line {node.lineno}: reads engine.{node.attr}")
    return found


def test_the_engine_handle_check_sees_a_handle(tmp_path):
    # the check itself, on a module written to break the rule three ways
    bad = tmp_path / "bad.py"
    bad.write_text("def f(engine):\n    return engine._buffers\n"
                   "class C:\n    def __init__(self, e):\n        self.engine = e\n")
    assert len(engine_handles(bad)) == 3


def test_no_module_below_the_engine_takes_or_stores_one():
    # lower layers get declared views (BuildContext, CheckpointSubject), never the engine
    bad = {m: h for m, p in MODULES.items() if _below_engine(m) and (h := engine_handles(p))}
    assert bad == {}


def test_the_engine_room_knows_no_stage():
    # stages stand on the engine room; only the factory knows them (STAGE_PARTS)
    bad = {m: sorted(t for t in targets if any(_within(t, s) for s in STAGES))
           for m, targets in GRAPH.items() if _within(m, ENGINE_ROOM)}
    assert {m: t for m, t in bad.items() if t} == {}


def test_stages_contribute_only_through_the_contract():
    # a stage's parts implement StageParts; they subclass nothing else of the engine room,
    # and neither stage imports the other
    from zero_core.engine.contract import StageParts
    from zero_core.factory import STAGE_PARTS
    for stage, parts in STAGE_PARTS.items():
        assert issubclass(parts, StageParts) and not parts.__abstractmethods__, stage
    for a, b in (STAGES, STAGES[::-1]):
        crossing = {m: sorted(t for t in targets if _within(t, b))
                    for m, targets in GRAPH.items() if _within(m, a)}
        assert {m: t for m, t in crossing.items() if t} == {}, (a, b)


def test_kernels_are_reached_only_through_the_registry():
    # the engine asks the registry for the accelerator's KernelSet (ARCHITECTURE §2)
    bad = {m: sorted(t for t in targets if _within(t, "zero_core.accel_kernels"))
           for m, targets in GRAPH.items()
           if not _within(m, "zero_core.backends") and not _within(m, "zero_core.accel_kernels")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_no_file_over_the_size_limit():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_few_modules_at_the_top_of_the_engine():
    top = sorted(p.name for p in (ROOT / "zero_core").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_every_module_says_what_it_owns():
    missing = [m for m, p in MODULES.items()
               if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert missing == []


SECTION_REF = re.compile(r"ARCHITECTURE(?:\.md)? §(\d+)")
OUTSIDE_REF = re.compile(r"DESIGN(?:\.md)? §\d+")


def test_section_references_point_to_sections_that_exist():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", doc, re.M)}
    assert sections, "docs/ARCHITECTURE.md has no numbered sections"
    sources = [*MODULES.values(), ROOT / "README.md", ROOT / "pyproject.toml",
               *(ROOT / "tests").rglob("*.py"), *CI_FILES,
               *(ROOT / "examples").glob("*.py")]
    dangling = {}
    for path in sources:
        if path.is_file():
            text = path.read_text(errors="replace")
            refs = {int(n) for n in SECTION_REF.findall(text)}
            wrong = sorted(refs - sections) + OUTSIDE_REF.findall(text)
            if wrong:
                dangling[str(path.relative_to(ROOT))] = wrong
    assert dangling == {}


@pytest.mark.parametrize("question,path,code", [
    ("the step every stage shares", "zero_core/engine/core.py", "def _optimizer_step"),
    ("what a stage contributes", "zero_core/engine/contract.py", "class StageParts"),
    ("stage-3 prefetch", "zero_core/stage3/prefetch.py", "class ExecutionTrace"),
    ("the qgZ all-to-all", "zero_core/zeropp/qgz.py", "all_to_all"),
    ("the MPI all-gather", "backends/comm/mpi.py", "def _all_gather_into"),
    ("the checkpoint atomic rename", "zero_core/checkpoint/store.py", "os.replace("),
    ("stage 0-2 gradient reduction", "zero_core/stage0to2/grad_reduce.py", "class GradReducer"),
    ("activation checkpointing", "zero_core/activation/checkpointing.py", "def checkpoint("),
])
def test_the_tree_answers_where_things_are(question, path, code):
    # the file the map names holds the thing, and the map names the file
    assert code in (ROOT / path).read_text(), f"{question}: expected {code!r} in {path}"
    assert path in (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_the_public_api_survives_the_layout():
    # what users import by name (ARCHITECTURE §1): moving files must not move these
    import importlib

    import zero_core
    for name in ("initialize", "Init", "GatheredParameters", "register_external_parameter",
                 "unregister_external_parameter", "ParameterNotGatheredError", "ZeroEngine",
                 "get_runtime", "init_distributed", "checkpointing", "__version__"):
        assert hasattr(zero_core, name), name
    assert importlib.import_module("zero_core.checkpointing") is zero_core.checkpointing
    for name in ("checkpoint", "configure", "is_configured", "reset", "deconfigure"):
        assert callable(getattr(zero_core.checkpointing, name)), name
    from zero_core.cli import main
    assert callable(main)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'zero-core = "zero_core.cli:main"' in pyproject
    assert 'builtin = "zero_core.backends.plugin"' in pyproject


# ---- ci/ and zero_core/testing/: the scripts around the library keep its rules -------------
CI_FILES = sorted(p for p in (ROOT / "ci").rglob("*") if "__pycache__" not in p.parts)
CI_MODULES = [p for p in CI_FILES if p.suffix == ".py"]
TESTING = "zero_core.testing"
# the library code that launches ranks with the testing package: the plan's rate measurement
# and the CLI's environment report (which looks for mpirun)
MAY_USE_TESTING = ("zero_core.plan.measure", "zero_core.plan.measure_worker", "zero_core.cli")


def test_the_ci_walk_sees_the_scripts():
    names = {str(p.relative_to(ROOT)) for p in CI_MODULES}
    assert {"ci/gpu/check.py", "ci/tools/count_collectives.py"} <= names, sorted(names)


def test_no_ci_file_over_the_size_limit():
    long = {str(p.relative_to(ROOT)): n for p in CI_MODULES
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_ci_module_says_what_it_owns():
    missing = [str(p.relative_to(ROOT)) for p in CI_MODULES
               if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert missing == []


def test_the_testing_package_is_walked_as_library_code():
    # so the size, docstring, cycle and layering rules above hold for it too
    assert {TESTING, f"{TESTING}.ranks", f"{TESTING}.emulated_cluster", f"{TESTING}.netns",
            f"{TESTING}.device_audit"} <= set(MODULES)
    # its __init__ is a map of the folder, not a second way to import its names
    body = ast.parse(MODULES[TESTING].read_text()).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr), "zero_core/testing/__init__.py"


def test_only_the_rank_launching_code_imports_the_testing_package():
    bad = {m: sorted(t for t in targets if _within(t, TESTING))
           for m, targets in GRAPH.items()
           if not _within(m, TESTING) and m not in MAY_USE_TESTING}
    assert {m: t for m, t in bad.items() if t} == {}
