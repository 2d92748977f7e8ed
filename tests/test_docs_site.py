"""The documentation site builds with no warning (a dead link or anchor fails it), and the
generated pages are current."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: every page in the navigation, every link and anchor resolves."""
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=REPO, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "site" / "cli" / "index.html").is_file()
    assert (tmp_path / "site" / "how-to" / "own-method" / "index.html").is_file()


def test_every_page_is_in_the_navigation():
    import yaml

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]

    def pages(items):
        for item in items:
            value = item if isinstance(item, str) else next(iter(item.values()))
            if isinstance(value, list):
                yield from pages(value)
            else:
                yield value
    listed = set(pages(nav))
    on_disk = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert on_disk == listed


def test_the_cli_reference_is_current():
    """``docs/cli.md`` is what ``python -m cli.reference --write`` generates from the commands."""
    from cli.reference import render

    assert (REPO / "docs" / "cli.md").read_text() == render(), "run: python -m cli.reference --write"


def test_the_readme_is_a_short_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for page in ("tutorial-demo.md", "tutorial-own-data.md", "deploy.md", "cli.md", "config.md", "methods/index.md",
                 "results.md", "how-to/own-method.md"):
        assert f"docs/{page}" in text, page


def test_the_results_page_names_each_results_command_and_commit():
    """docs/results.md ends with a table generated from bench/results/*.json: each file's command
    and commit. A result committed without refreshing it fails here."""
    r = subprocess.run([sys.executable, "bench/provenance.py", "--check"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    page = (REPO / "docs" / "results.md").read_text()
    for path in sorted((REPO / "bench" / "results").glob("*.json")):
        assert f"`{path.name}`" in page
