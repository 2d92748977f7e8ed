"""The product stands alone: nothing a user reads points at documents they do not have.

Every file the package ships or a user reads (README, docs, shipped profiles and run configs,
the sources of the three packages, the install scripts) must not refer to the project's
internal brief ("SPEC"), to the development workspace (``../shared``, ``seeds/``, paper
"seed" numbers) or to tracker items ("issue 3"). The mechanisms are explained in
``docs/methods.md``, which must exist, cite the four papers by title, and whose section
links and "docs/methods.md §N" references must resolve.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
METHODS = REPO / "docs" / "methods.md"


def _user_facing_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "pyproject.toml"]
    files += sorted((REPO / "docs").rglob("*.md")) + [REPO / "mkdocs.yml"]
    files += sorted((REPO / "profiles").rglob("*.yaml"))
    for pkg in ("sfl_core", "coordinator", "edge_agent", "simulation", "cli"):
        files += sorted((REPO / pkg).rglob("*.py"))
    files += sorted(p for p in (REPO / "install").rglob("*") if p.is_file())
    return [p for p in files if p.is_file() and "__pycache__" not in p.parts]


FILES = _user_facing_files()

# (what it is, pattern). Word boundaries keep legitimate words out: `_RUN_SPEC` (an identifier),
# "spec" (a vendor data sheet), "seed: 0", "Python issues several numbers" do not match.
FORBIDDEN = [
    ("the internal brief 'SPEC'", re.compile(r"\bSPEC\b")),
    ("the workspace's shared folder", re.compile(r"\.\./shared\b|/work/shared\b")),
    ("the workspace's paper folder", re.compile(r"\bseeds/")),
    ("a workspace paper number ('seed 003')", re.compile(r"\bseeds? 00\d\b")),
    ("a tracker item ('issue 3')", re.compile(r"\bissue\s+#?\d+\b", re.IGNORECASE)),
]

TITLES = {
    "S2FL": "Have Your Cake and Eat It Too: Toward Efficient and Accurate Split Federated Learning",
    "HeteroSFL": "HeteroSFL: Split Federated Learning with Heterogeneous Clients and Non-IID Data",
    "MergeSFL": "MergeSFL: Split Federated Learning with Feature Merging and Batch Size Regulation",
    "FedFC": "Federated Feature Concatenate Method for Heterogeneous Computing in Federated Learning",
}


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def test_the_scan_covers_what_users_read():
    names = {_rel(p) for p in FILES}
    assert {"README.md", "docs/methods.md", "docs/protocol.md", "profiles/runs/sim-100.yaml",
            "cli/coord/plan.py", "sfl_core/timing.py", "cli/agent/run.py", "simulation/run.py", "install/agent.sh"} <= names
    assert any(n.startswith("profiles/devices/") for n in names)


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_no_reference_to_documents_users_do_not_have(path: Path):
    text = path.read_text(encoding="utf-8", errors="replace")
    hits = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN:
            m = pattern.search(line)
            if m:
                hits.append(f"{_rel(path)}:{lineno}: {what}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not hits, "point at docs/methods.md or cite the paper instead:\n" + "\n".join(hits)


def test_patterns_flag_the_old_references_and_spare_legitimate_words():
    bad = ["(SPEC §3 times)", "see ../shared/SPEC.md", "root: ../shared/datasets/x",
           "papers in seeds/", "S2FL (seeds 000/002)", "seed 003 Alg. 1", "the closing note of issue 3",
           "Issue #12"]
    good = ["_RUN_SPEC: dict", "_PROFILE_SPEC", "SPECS = {", "NVIDIA Jetson Nano spec (472 GFLOPS)",
            "seed: 0", "same seeds, same code", "Python issues several numbers", "--seeds 2",
            "shared by the profiler", "docs/methods.md §3"]
    for s in bad:
        assert any(p.search(s) for _, p in FORBIDDEN), s
    for s in good:
        assert not any(p.search(s) for _, p in FORBIDDEN), s


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _methods_text() -> str:
    assert METHODS.is_file(), "docs/methods.md must explain every mechanism the product implements"
    return METHODS.read_text(encoding="utf-8")


def test_methods_cites_the_four_papers_by_title():
    flat = " ".join(_methods_text().split())   # titles may wrap across lines
    missing = [name for name, title in TITLES.items() if title.lower() not in flat.lower()]
    assert not missing, f"docs/methods.md must cite these papers by title: {missing}"
    refs = flat.lower().split("## references", 1)
    assert len(refs) == 2, "docs/methods.md needs a References section"
    for name, title in TITLES.items():
        assert title.lower() in refs[1], f"{name} is cited outside the References section only"
    for year in ("2023", "2022", "2017"):
        assert year in refs[1]


def test_links_and_section_references_into_methods_resolve():
    text = _methods_text()
    headings = [m.group(1) for m in re.finditer(r"^#{1,6} (.+)$", text, re.MULTILINE)]
    anchors = {_slug(h) for h in headings}
    numbers = {m.group(1) for h in headings if (m := re.match(r"(\d+)\.", h))}
    bad = []
    for path in FILES:
        body = path.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r"methods\.md#([\w\-]+)", body):
            if m.group(1) not in anchors:
                bad.append(f"{_rel(path)}: no section #{m.group(1)} in docs/methods.md")
        if path == METHODS:
            for m in re.finditer(r"\]\(#([\w\-]+)\)", body):
                if m.group(1) not in anchors:
                    bad.append(f"docs/methods.md: no section #{m.group(1)}")
        for m in re.finditer(r"methods\.md(?: section | §)(\d+)", body):
            if m.group(1) not in numbers:
                bad.append(f"{_rel(path)}: docs/methods.md has no section {m.group(1)}")
    assert not bad, "\n".join(bad)
