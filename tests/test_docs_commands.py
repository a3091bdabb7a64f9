"""The documentation cannot drift from the tree: every command it shows still runs.

Reads README.md and docs/*.md; the marking convention is in docs/design.md, "Writing docs":

- fenced ```bash / ```sh blocks: each command whose program is ``python <path>``,
  ``python -m <module>``, ``torchrun <path>``, ``bash <path>``, ``source <path>`` or
  ``zero-core <subcommand>`` (after ``VAR=value`` prefixes and launchers such as
  ``mpirun -np 2``) names a path, module or subcommand that exists, and each Python script
  (one that parses arguments), module and subcommand answers ``--help`` with exit 0;
- ```bash runnable blocks are also run, line by line, and must exit 0;
- ```bash notest blocks are skipped;
- ```python blocks compile, ```json blocks parse;
- relative links and their #anchors resolve, "ARCHITECTURE §N" names a section that exists,
  and repository paths written as inline code exist.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT)
                            for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SHELL = {"bash", "sh", "shell", "console"}
HELP_TIMEOUT = 60    # seconds for one `--help`
RUN_TIMEOUT = 60     # seconds for one line of a runnable block
# the top-level folders whose paths, written as inline code, must exist
REPO_DIRS = ("ci/", "zero_core/", "backends/", "accel_kernels/", "tests/", "examples/", "docs/",
             ".ci/")
LAUNCHERS = {"mpirun", "mpiexec", "srun", "timeout", "env", "nohup", "time", "exec"}


@dataclass(frozen=True)
class Block:
    doc: str
    line: int        # 1-based line of the opening fence
    lang: str
    flags: frozenset
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def read(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def fenced_blocks(doc: str) -> list[Block]:
    blocks, lines, i = [], read(doc).splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).split()
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence)}\s*$", lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        blocks.append(Block(doc, i + 1, info[0].lower() if info else "",
                            frozenset(w.lower() for w in info[1:]), "\n".join(body)))
        i = j + 1
    return blocks


def prose(doc: str) -> str:
    """The document with its fenced blocks blanked out (line numbers kept)."""
    out, in_fence, fence = [], False, ""
    for line in read(doc).splitlines():
        m = re.match(r"^\s*(`{3,}|~{3,})", line)
        if not in_fence and m:
            in_fence, fence = True, m.group(1)
            out.append("")
        elif in_fence and re.match(rf"^\s*{re.escape(fence)}\s*$", line):
            in_fence = False
            out.append("")
        else:
            out.append("" if in_fence else line)
    return "\n".join(out)


BLOCKS = [b for doc in DOCS for b in fenced_blocks(doc)]
SHELL_BLOCKS = [b for b in BLOCKS if b.lang in SHELL and "notest" not in b.flags]


def command_lines(text: str) -> list[str]:
    """Shell lines with continuations joined; blank and comment-only lines dropped."""
    lines, cur = [], ""
    for raw in text.splitlines():
        cur += raw
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur.strip() and not cur.strip().startswith("#"):
            lines.append(cur.strip())
        cur = ""
    if cur.strip():
        lines.append(cur.strip())
    return lines


def segments(line: str) -> list[list[str]]:
    """The simple commands of a line, split at ;, &&, || and |, comments removed."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    out, cur = [], []
    for tok in lex:
        if tok and set(tok) <= set(";&|"):
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    out.append(cur)
    return [s for s in out if s]


def is_python(tok: str) -> bool:
    return re.fullmatch(r"python(3(\.\d+)?)?", os.path.basename(tok)) is not None


def targets(tokens: list[str]) -> list[tuple[str, str]]:
    """What one simple command runs: ("script"|"module"|"shell"|"zero-core", name)."""
    i = 0
    while i < len(tokens) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[i]):
        i += 1
    # skip launchers and their options up to the program they start
    while i < len(tokens) and os.path.basename(tokens[i]) in LAUNCHERS:
        i += 1
        while i < len(tokens) and not (is_python(tokens[i]) or tokens[i] in
                                       ("bash", "sh", "torchrun", "zero-core")):
            i += 1
    if i >= len(tokens):
        return []
    prog, rest = tokens[i], tokens[i + 1:]
    if is_python(prog):
        if rest[:1] == ["-m"] and len(rest) > 1:
            return [("module", rest[1])]
        if rest and not rest[0].startswith("-"):
            return [("script", rest[0])]
        return []
    if prog == "torchrun":
        for j, tok in enumerate(rest):
            if tok == "-m" and j + 1 < len(rest):
                return [("module", rest[j + 1])]
            if tok.endswith(".py"):
                return [("script", tok)]
        return []
    if prog in ("bash", "sh", "source", "."):
        return [("shell", rest[0])] if rest and not rest[0].startswith("-") else []
    if os.path.basename(prog) == "zero-core":
        return [("zero-core", rest[0])] if rest and not rest[0].startswith("-") else []
    return []


def block_targets(blocks) -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for b in blocks:
        for line in command_lines(b.text):
            for seg in segments(line):
                for t in targets(seg):
                    found.setdefault(t, []).append(b.where)
    return found


TARGETS = block_targets(SHELL_BLOCKS)


def zero_core_subcommands() -> set[str]:
    import argparse

    from zero_core.cli import build_parser
    parser = build_parser()
    return {name for a in parser._actions if isinstance(a, argparse._SubParsersAction)
            for name in a.choices}


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def env() -> dict:
    bindir = os.path.dirname(sys.executable)
    return dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
                ZERO_CORE_QUIET="1", ZERO_CORE_BENCH_REEXEC="1", PYTHONUNBUFFERED="1")


# ---------------------------------------------------------------- the tests


def test_the_parser_reads_commands_as_a_shell_would():
    def run(line):
        return [t for seg in segments(line) for t in targets(seg)]
    assert run("ZERO_CORE_COMM=gloo mpirun -np 2 python examples/train_gpt.py  # a comment") == \
        [("script", "examples/train_gpt.py")]
    assert run("torchrun --nproc_per_node 2 examples/x.py --stage 3") == [("script", "examples/x.py")]
    assert run("mpirun -np 4 --oversubscribe python -m zero_core.conformance --comm gloo") == \
        [("module", "zero_core.conformance")]
    assert run("source ci/setup_env.sh && zero-core report --json | head") == \
        [("shell", "ci/setup_env.sh"), ("zero-core", "report")]
    assert run("pip install --no-deps oneccl==2022.2.0") == []
    assert [line.split() for line in command_lines("a \\\n  b\n# only a comment\n\nc")] == \
        [["a", "b"], ["c"]]
    assert slug("Stages 1–2 vs peers") == "stages-12-vs-peers"
    assert slug("ZeRO-Infinity at this machine's limit") == "zero-infinity-at-this-machines-limit"
    assert slug("5. Configuration") == "5-configuration"


def test_the_docs_show_commands():
    # the parser finds what the README promises (guards against a parser that finds nothing)
    assert ("shell", "ci/demo.sh") in TARGETS and ("shell", "ci/test.sh") in TARGETS
    assert any(kind == "zero-core" for kind, _ in TARGETS)
    assert any("runnable" in b.flags for b in SHELL_BLOCKS)


def test_every_documented_path_module_and_subcommand_exists():
    subcommands = zero_core_subcommands()
    missing = []
    for (kind, name), where in sorted(TARGETS.items()):
        if kind in ("script", "shell"):
            ok = os.path.isfile(os.path.join(ROOT, name))
        elif kind == "module":
            ok = module_exists(name)
        else:
            ok = name in subcommands
        if not ok:
            missing.append(f"{kind} {name} (shown at {', '.join(sorted(set(where)))})")
    assert missing == []


def _help_command(kind: str, name: str) -> list[str] | None:
    if kind == "script":
        path = os.path.join(ROOT, name)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8", errors="replace") as f:
            if "argparse" not in f.read():  # a script without options would simply run
                return None
        return [sys.executable, path, "--help"]
    if kind == "module":
        return [sys.executable, "-m", name, "--help"]
    if kind == "zero-core":
        return [sys.executable, "-m", "zero_core.cli", name, "--help"]
    return None


HELP = sorted((k, n) for k, n in TARGETS if k in ("script", "module", "zero-core"))


@pytest.mark.parametrize("kind,name", HELP, ids=[f"{k}:{n}" for k, n in HELP])
def test_documented_program_answers_help(kind, name):
    cmd = _help_command(kind, name)
    if cmd is None:
        pytest.skip("missing (reported by the existence test) or takes no options")
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=HELP_TIMEOUT)
    assert r.returncode == 0, (f"{' '.join(cmd[1:])} exited {r.returncode} "
                               f"(shown at {TARGETS[(kind, name)]}):\n{r.stderr[-2000:]}")
    assert "usage" in (r.stdout + r.stderr).lower()


RUNNABLE = [(b, line) for b in SHELL_BLOCKS if "runnable" in b.flags
            for line in command_lines(b.text)]


@pytest.mark.parametrize("block,line", RUNNABLE, ids=[f"{b.where}:{line}" for b, line in RUNNABLE])
def test_runnable_blocks_run(block, line):
    r = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=RUN_TIMEOUT)
    assert r.returncode == 0, (f"{block.where}: `{line}` exited {r.returncode}:\n"
                               f"{r.stdout[-1500:]}\n{r.stderr[-1500:]}")


def test_python_blocks_compile():
    bad = []
    for b in BLOCKS:
        if b.lang in ("python", "py") and "notest" not in b.flags:
            try:
                compile(b.text, b.where, "exec")
            except SyntaxError as e:
                bad.append(f"{b.where}: {e}")
    assert bad == []


def test_json_blocks_parse():
    bad = []
    for b in BLOCKS:
        if b.lang == "json" and "notest" not in b.flags:
            try:
                json.loads(b.text)
            except ValueError:
                try:  # a fragment such as "safety": {...}
                    json.loads("{" + b.text + "}")
                except ValueError as e:
                    bad.append(f"{b.where}: {e}")
    assert bad == []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # links keep their text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(doc).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_relative_links_and_anchors_resolve():
    bad = []
    for doc in DOCS:
        base = os.path.dirname(os.path.join(ROOT, doc))
        for target in LINK.findall(prose(doc)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(base, path)) if path else \
                os.path.join(ROOT, doc)
            if not os.path.exists(full):
                bad.append(f"{doc}: link to missing {target}")
            elif anchor and full.endswith(".md") and anchor not in anchors(
                    os.path.relpath(full, ROOT)):
                bad.append(f"{doc}: no heading for #{anchor} in {os.path.relpath(full, ROOT)}")
    assert bad == []


def test_architecture_section_references_exist():
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", read("docs/ARCHITECTURE.md"), re.M)}
    bad = [f"{doc}: ARCHITECTURE §{n}" for doc in DOCS
           for n in re.findall(r"ARCHITECTURE(?:\.md)? §(\d+)", read(doc))
           if int(n) not in sections]
    assert bad == []


def _inline_paths(text: str) -> list[str]:
    paths = []
    for span in re.findall(r"`([^`]+)`", text):
        span = " ".join(span.split())
        if " " not in span:
            if span.startswith(REPO_DIRS):
                paths.append(span)
            continue
        try:
            tokens = shlex.split(span, comments=True)
        except ValueError:
            continue
        for seg in [tokens]:
            for kind, name in targets(seg):
                if kind in ("script", "shell") and name.startswith(REPO_DIRS):
                    paths.append(name)
    return paths


def test_inline_repository_paths_exist():
    bad = []
    for doc in DOCS:
        for path in _inline_paths(prose(doc)):
            clean = path.rstrip("/.,;:")
            if not glob.glob(os.path.join(ROOT, clean)):
                bad.append(f"{doc}: {path}")
    assert sorted(set(bad)) == []
