"""The installed distribution's version, for ``sfl-coord --version`` and ``sfl-agent --version``.

Standard library only (no torch): ``sfl-agent`` imports it on boards that run ``predict`` without torch.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DISTRIBUTION = "sfl-edge"


def package_version() -> str:
    """``sfl-edge``'s version from its installed metadata; from pyproject.toml in an uninstalled checkout."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"), re.MULTILINE)
    except OSError:
        m = None
    return m.group(1) if m else "unknown"


def version_option(prog: str):
    """The ``--version`` option of a typer app's callback, printing ``<prog> <version>``.
    One definition for ``sfl-coord`` and ``sfl-agent``."""
    import typer

    def show(value: bool) -> None:
        if value:
            print(f"{prog} {package_version()}")
            raise typer.Exit()
    return typer.Option(None, "--version", is_eager=True, callback=show, help="Print the version and exit.")
