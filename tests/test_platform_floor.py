"""The agent's floor, checked on every run: Python 3.8 and torch 2.0 on aarch64.

What is *executed* on those platforms is ``bench/platforms.py`` (emulated arm64 with Debian 11's
Python 3.9 and torch 2.0.1; a host Python 3.8 with torch 2.0.1; results in
bench/results/platforms.json). What these tests check, cheaply, on every CI run:

- ``vermin --target=3.8`` finds nothing newer than 3.8 in the code the agent imports;
- no runtime use of 3.9/3.10 typing syntax (``dict[...]`` or ``X | None`` outside annotations,
  which ``from __future__ import annotations`` keeps as strings), which vermin does not see;
- ``pip install --dry-run`` of the agent's dependencies for CPython 3.8 on manylinux2014_aarch64
  (JetPack 5) resolves to wheels, torch among them.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
AGENT_PACKAGES = ["sfl_core", "edge_agent", "cli/agent", "cli/broker_options.py", "cli/__init__.py"]
"""What ``sfl-agent`` imports (coordinator/, simulation/ and cli/coord are kept at 3.8 too, below)."""
ALL_PACKAGES = AGENT_PACKAGES + ["coordinator", "simulation", "cli"]


def test_vermin_finds_nothing_newer_than_python_3_8():
    vermin = shutil.which("vermin") or str(Path(sys.executable).parent / "vermin")
    if not Path(vermin).exists():
        pytest.fail("vermin is missing: pip install -e '.[test]'")
    p = subprocess.run([vermin, "--target=3.8-", "--violations", "--no-tips", "--no-parse-comments",
                        "--backport", "typing_extensions", *ALL_PACKAGES], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


_GENERICS = {"dict", "list", "tuple", "set", "frozenset", "type"}


def _runtime_typing_syntax(tree: ast.AST) -> list[tuple[int, str]]:
    """``dict[...]``-style subscripts and ``X | None`` unions evaluated at run time (outside
    annotations): Python 3.8 raises TypeError on the first, 3.8 and 3.9 on the second."""
    in_annotation = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.arg) and n.annotation is not None:
            in_annotation.add(id(n.annotation))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            in_annotation.add(id(n.returns))
        elif isinstance(n, ast.AnnAssign):
            in_annotation.add(id(n.annotation))
    found: list[tuple[int, str]] = []

    def visit(n: ast.AST, skipped: bool) -> None:
        skipped = skipped or id(n) in in_annotation
        if not skipped:
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in _GENERICS:
                found.append((n.lineno, f"{n.value.id}[...] (use typing.{n.value.id.capitalize()})"))
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.BitOr) and any(
                    (isinstance(s, ast.Constant) and s.value is None) or isinstance(s, ast.Subscript)
                    for s in (n.left, n.right)):
                found.append((n.lineno, "X | Y of types (use typing.Optional / typing.Union)"))
        for child in ast.iter_child_nodes(n):
            visit(child, skipped)

    visit(tree, False)
    return found


def _sources() -> list[Path]:
    files: list[Path] = []
    for entry in ALL_PACKAGES:
        path = REPO / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return sorted(set(files))


def test_no_runtime_typing_syntax_newer_than_python_3_8():
    bad = [f"{p.relative_to(REPO)}:{line}: {what}" for p in _sources()
           for line, what in _runtime_typing_syntax(ast.parse(p.read_text(encoding="utf-8")))]
    assert not bad, "\n".join(bad)


def test_the_check_sees_what_python_3_8_would_fail_on():
    tree = ast.parse("from __future__ import annotations\nA = dict[str, int]\nB = int | None\n"
                     "def f(x: dict[str, int] | None) -> list[int]: ...\nC: tuple[int, ...] = ()\n")
    assert [line for line, _ in _runtime_typing_syntax(tree)] == [2, 3]


def _agent_requirements() -> list[str]:
    """pyproject's core dependencies, markers dropped (pip checks them against this interpreter,
    not the target's, so a marker for Python < 3.10 would hide its package)."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M).group(1)
    return [d.split(";")[0].strip() for d in re.findall(r'"([^"]+)"', block)]


def test_the_agent_dependencies_resolve_to_wheels_for_jetpack_5(tmp_path):
    """CPython 3.8 on manylinux2014_aarch64 (JetPack 5's Ubuntu 20.04): every dependency of a
    lean agent has a release with such a wheel. Resolved against PyPI itself (a local mirror
    may lack the Requires-Python data that steers the choice)."""
    index = os.environ.get("SFL_PYPI_INDEX", "https://pypi.org/simple")
    try:
        urllib.request.urlopen(f"{index}/msgpack/", timeout=10).close()
    except OSError as exc:
        pytest.skip(f"{index} cannot be reached ({exc}); the resolution needs the package index")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(tmp_path / "r.json"),
                        "--ignore-installed", "--index-url", index, "--python-version", "3.8", "--implementation", "cp",
                        "--platform", "manylinux2014_aarch64", "--only-binary=:all:", "--target", str(tmp_path / "t"),
                        *_agent_requirements()], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    import json
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"]
              for i in json.loads((tmp_path / "r.json").read_text())["install"]}
    assert {"torch", "numpy", "pydantic", "paho-mqtt", "eval-type-backport"} <= {k.replace("_", "-") for k in chosen}, chosen
    assert chosen["torch"].split(".")[0] == "2"
