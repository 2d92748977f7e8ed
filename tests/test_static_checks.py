"""The product packages pass the linter and the type checker, as configured in pyproject.toml
(``[tool.ruff]``, ``[tool.mypy]``): ``ruff check`` and ``mypy`` from the repository root."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean():
    if shutil.which("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    out = _run("ruff", "check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_is_clean():
    out = _run(sys.executable, "-m", "mypy")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
