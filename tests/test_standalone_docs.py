"""The product stands alone: nothing a user reads points at documents they do not have.

Every file the package ships or a user reads (README, docs, shipped profiles and run configs,
the sources of the three packages, the install scripts) must not refer to the project's
internal brief ("SPEC"), to the development workspace (``../shared``, ``seeds/``, paper
"seed" numbers) or to tracker items ("issue 3"). The mechanisms are explained in
``docs/methods/``, one page per method or topic, which must cite the four papers by title
(each method's own page its paper), and every reference to a page there must resolve.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
METHODS = REPO / "docs" / "methods"
PAGE_OF = {"S2FL": "s2fl.md", "HeteroSFL": "heterosfl.md", "MergeSFL": "mergesfl.md", "FedFC": "fedfc.md"}


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
    assert {"README.md", "docs/methods/index.md", "docs/methods/auto.md", "docs/protocol.md", "profiles/runs/sim-100.yaml",
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
    assert not hits, "point at docs/methods/ or cite the paper instead:\n" + "\n".join(hits)


def test_patterns_flag_the_old_references_and_spare_legitimate_words():
    bad = ["(SPEC §3 times)", "see ../shared/SPEC.md", "root: ../shared/datasets/x",
           "papers in seeds/", "S2FL (seeds 000/002)", "seed 003 Alg. 1", "the closing note of issue 3",
           "Issue #12"]
    good = ["_RUN_SPEC: dict", "_PROFILE_SPEC", "SPECS = {", "NVIDIA Jetson Nano spec (472 GFLOPS)",
            "seed: 0", "same seeds, same code", "Python issues several numbers", "--seeds 2",
            "shared by the profiler", "docs/methods/time-model.md"]
    for s in bad:
        assert any(p.search(s) for _, p in FORBIDDEN), s
    for s in good:
        assert not any(p.search(s) for _, p in FORBIDDEN), s


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _page(name: str) -> str:
    path = METHODS / name
    assert path.is_file(), f"docs/methods/{name} must explain the mechanisms the product implements"
    return path.read_text(encoding="utf-8")


def _flat(text: str) -> str:
    return " ".join(text.split()).lower()   # titles may wrap across lines


def test_methods_cite_the_four_papers_by_title():
    refs = _flat(_page("index.md")).split("## references", 1)
    assert len(refs) == 2, "docs/methods/index.md needs a References section"
    for name, title in TITLES.items():
        assert title.lower() in refs[1], f"docs/methods/index.md: {name} is missing from the References"
        assert title.lower() in _flat(_page(PAGE_OF[name])), f"docs/methods/{PAGE_OF[name]} must cite {name} by title"
    for year in ("2023", "2022", "2017"):
        assert year in refs[1]


def test_references_to_the_methods_pages_resolve():
    pages = {p.name: {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", p.read_text(encoding="utf-8"),
                                                             re.MULTILINE)}
             for p in METHODS.glob("*.md")}
    bad = []
    for path in FILES:
        body = path.read_text(encoding="utf-8", errors="replace")
        if re.search(r"\bmethods\.md\b", body):
            bad.append(f"{_rel(path)}: refers to docs/methods.md, which is now the folder docs/methods/")
        targets = [m.groups() for m in re.finditer(r"\bmethods/([\w\-]+\.md)(?:#([\w\-]+))?", body)]
        if path.parent == METHODS:   # links between the pages themselves
            targets += [m.groups() for m in re.finditer(r"\]\(([\w\-]+\.md)(?:#([\w\-]+))?\)", body)]
            targets += [(path.name, m.group(1)) for m in re.finditer(r"\]\(#([\w\-]+)\)", body)]
        for page, anchor in targets:
            if page not in pages:
                bad.append(f"{_rel(path)}: no page docs/methods/{page}")
            elif anchor and anchor not in pages[page]:
                bad.append(f"{_rel(path)}: no section #{anchor} in docs/methods/{page}")
    assert not bad, "\n".join(bad)
