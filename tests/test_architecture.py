"""The shape of the code, checked: no import loops, no layer importing one above it, each
method's name and config section used only in its own folder, and a new method with config
keys of its own added as one folder plus its registration.

The imports are read from the source (``ast``), every ``import`` statement counted wherever it
stands (a late import inside a function is a dependency too); only those under
``if TYPE_CHECKING:`` are left out, since they never run.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "simulation", "coordinator", "edge_agent", "sfl_core")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(REPO).with_suffix("").parts)
            out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


MODULES = _modules()


def _imports(name: str, typing_too: bool = False) -> set[str]:
    """The package modules ``name`` imports (resolved to the module, not the names in it);
    ``typing_too``: those under ``if TYPE_CHECKING:`` as well."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not typing_too and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            skip |= {id(x) for stmt in node.body for x in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_there_are_no_import_loops():
    assert _cycles(GRAPH) == []


def test_there_are_no_import_loops_even_through_type_checking_imports():
    """What a type checker reads is a dependency too: a loop there is a design loop."""
    assert _cycles({m: _imports(m, typing_too=True) for m in MODULES}) == []


def test_the_round_engine_stays_a_readable_size():
    """select, plan, assign, steps, aggregate, record: what a method or an option adds lives
    in its own module, not in the engine."""
    tree = ast.parse((REPO / "coordinator" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RoundEngine")
    assert engine.end_lineno - engine.lineno + 1 <= 400


# Lowest first. A module may import its own layer and the ones below, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("sfl_core base", ("sfl_core.version", "sfl_core.console", "sfl_core.plugins", "sfl_core.extras", "sfl_core.privacy",
                       "sfl_core.aggregation", "sfl_core.step_terms", "sfl_core.losses", "sfl_core.estimates",
                       "sfl_core.label_mix", "sfl_core.liveness", "sfl_core.rate_limit", "sfl_core.evidence",
                       "sfl_core.transport", "sfl_core.wire", "sfl_core.method_registry", "sfl_core.option_registry")),
    ("sfl_core model and data", ("sfl_core.model", "sfl_core.data.builtin", "sfl_core.data.partition",
                                 "sfl_core.data.preprocessing")),
    ("sfl_core config", ("sfl_core.config",)),
    ("sfl_core fleet and time", ("sfl_core.fleet", "sfl_core.timing", "sfl_core.data.local")),
    ("sfl_core training options", ("sfl_core.options",)),
    ("sfl_core methods", ("sfl_core.methods",)),
    ("coordinator", ("coordinator",)),
    ("edge_agent", ("edge_agent",)),
    ("simulation", ("simulation",)),
    ("cli", ("cli",)),
]
PEERS = {"coordinator": "edge_agent", "edge_agent": "coordinator"}
"""The daemon and the agent are peers: neither imports the other (the simulation joins them)."""


def _layer(module: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank >= 0, f"{module} is in no layer of tests/test_architecture.py"
    return rank


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for m, targets in GRAPH.items():
        for t in targets:
            lm, lt = _layer(m), _layer(t)
            peer = PEERS.get(LAYERS[lm][0]) == LAYERS[lt][0]
            if lt > lm or peer:
                wrong.append(f"{m} ({LAYERS[lm][0]}) imports {t} ({LAYERS[lt][0]})")
    assert wrong == []


def test_nothing_imports_the_command_line_package():
    assert [m for m, ts in GRAPH.items() if not m.startswith("cli") and any(t.startswith("cli") for t in ts)] == []


# --------------------------------------------------------------- each method in its own place

METHOD_HOMES = {   # a method's names and config section -> where they may be used
    "s2fl": "sfl_core/methods/s2fl/",
    "heterosfl": "sfl_core/methods/heterosfl/", "hetero": "sfl_core/methods/heterosfl/",
    "bdks": "sfl_core/methods/heterosfl/",
    "mergesfl": "sfl_core/methods/mergesfl/",
    "auto": "sfl_core/methods/auto/",
    "fedfc": "sfl_core/methods/fedfc/", "profile_splits": "sfl_core/methods/fedfc/",
    "server_weight": "sfl_core/methods/fedfc/",
}
REGISTRATION = "sfl_core/method_registry.py"
"""Where the built-in methods are registered by name (the one place that lists them all)."""


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _method_mentions(path: Path, rel: str = "") -> list[str]:
    """Code in ``path`` that names a method or reads its config section: an import of its
    folder, ``<x>.hetero`` (a section), a string ``"s2fl"``, or ``.strategy == "auto"``.
    Docstrings and comments may cite the papers."""
    rel = rel or str(path.relative_to(REPO))
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)

    def foreign(name: str) -> bool:
        home = METHOD_HOMES.get(name.lower())
        return home is not None and not rel.startswith(home) and rel != REGISTRATION

    hits = []
    for n in ast.walk(tree):
        where = f"{rel}:{getattr(n, 'lineno', '?')}"
        if isinstance(n, ast.Attribute) and n.attr in METHOD_HOMES and n.attr != "auto" and foreign(n.attr):
            hits.append(f"{where}: .{n.attr}")
        elif isinstance(n, ast.Attribute) and n.attr == "auto" and foreign("auto") and not (
                isinstance(n.value, ast.Name) and n.value.id in ("torch", "typer")):
            hits.append(f"{where}: .auto")
        elif (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
              and n.value.lower() in METHOD_HOMES and n.value.lower() != "auto" and foreign(n.value)):
            hits.append(f"{where}: {n.value!r}")
        elif isinstance(n, ast.Compare) and any(isinstance(x, ast.Attribute) and x.attr == "strategy"
                                               for x in [n.left, *n.comparators]):
            for c in [n.left, *n.comparators]:
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and foreign(c.value):
                    hits.append(f"{where}: strategy compared with {c.value!r}")
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            for m in mods:
                parts = m.split(".")
                if m.startswith("sfl_core.methods.") and len(parts) > 2 and foreign(parts[2]):
                    hits.append(f"{where}: imports {m}")
    return hits


def test_nothing_outside_a_methods_folder_names_it_or_reads_its_config_section():
    hits = [h for p in sorted(MODULES.values()) for h in _method_mentions(p)]
    assert hits == []


def test_the_mention_check_would_see_a_leak(tmp_path):
    """The check above is not vacuous: an engine asking for HeteroSFL's section is caught, and the
    same code in HeteroSFL's own folder is not."""
    leak = tmp_path / "probe.py"
    leak.write_text('def f(cfg):\n    return cfg.hetero.width if cfg.strategy == "auto" else "s2fl"\n')
    hits = sorted(h.split(": ", 1)[1] for h in _method_mentions(leak, "coordinator/engine.py"))
    assert hits == sorted([".hetero", "strategy compared with 'auto'", "'s2fl'"])
    assert [h for h in _method_mentions(leak, "sfl_core/methods/heterosfl/x.py") if ".hetero" in h] == []


# --------------------------------------------------------------- each training option in its own place

OPTION_HOMES = {   # an option's section key, wire names and kinds -> where they may be used
    **{name: "sfl_core/options/drift/" for name in ("drift", "scaffold", "fedprox", "prox_mu", "variates")},
    **{name: "sfl_core/options/server_opt/" for name in ("server_opt", "fedavgm", "fedadam", "fedyogi")},
    **{name: "sfl_core/options/norm_stats/" for name in ("norm_stats", "norm_pass", "norm_sums", "freeze_norm",
                                                          "local_norm", "fedbn", "fixbn")},
    **{name: "sfl_core/options/model_ema/" for name in ("model_ema", "ema")},
    **{name: "sfl_core/options/lr_anneal/" for name in ("lr_anneal",)},
    **{name: "sfl_core/options/calibrated_loss/" for name in ("calibration_tau",)},
}
OPTION_REGISTRATION = "sfl_core/option_registry.py"


def _option_mentions(path: Path, rel: str = "") -> list[str]:
    """Code in ``path`` that names a training option: an import of its folder, an attribute or
    a string that is one of its names (its section key, its assignment fields and messages,
    its kinds). Docstrings and comments may cite the papers."""
    rel = rel or str(path.relative_to(REPO))
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)

    def foreign(name: str) -> bool:
        home = OPTION_HOMES.get(name.lower())
        return home is not None and not rel.startswith(home) and rel != OPTION_REGISTRATION

    hits = []
    for n in ast.walk(tree):
        where = f"{rel}:{getattr(n, 'lineno', '?')}"
        if isinstance(n, ast.Attribute) and foreign(n.attr):
            hits.append(f"{where}: .{n.attr}")
        elif isinstance(n, ast.Name) and foreign(n.id):
            hits.append(f"{where}: {n.id}")
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and foreign(n.value):
            hits.append(f"{where}: {n.value!r}")
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            for m in mods:
                parts = m.split(".")
                if m.startswith("sfl_core.options.") and len(parts) > 2 and foreign(parts[2]):
                    hits.append(f"{where}: imports {m}")
    return hits


def test_nothing_outside_an_options_folder_names_it():
    """The engine, the wire core, the agent core, the config core and the time model run every
    option through its hooks and never name one."""
    hits = [h for p in sorted(MODULES.values()) for h in _option_mentions(p)]
    assert hits == []


def test_the_option_check_would_see_a_leak(tmp_path):
    """Not vacuous: an engine that reads drift's section, sends a FedBN field or imports the
    statistics pass is caught; the same code in the option's own folder is not."""
    leak = tmp_path / "probe.py"
    leak.write_text('from sfl_core.options.norm_stats import exchange\n'
                    'def f(cfg, body):\n    body["local_norm"] = True\n    return cfg.drift.kind\n')
    hits = sorted(h.split(": ", 1)[1] for h in _option_mentions(leak, "coordinator/engine.py"))
    assert hits == sorted([".drift", "'local_norm'", "imports sfl_core.options.norm_stats"])
    assert [h for h in _option_mentions(leak, "sfl_core/options/drift/x.py") if ".drift" in h] == []


# --------------------------------------------------------------- a new method is one folder

def _own_method_snippet() -> str:
    text = (REPO / "docs" / "how-to" / "own-method.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return next(b for b in blocks if "register_section" in b)


def test_a_method_with_its_own_config_keys_is_one_module_and_its_registration(tmp_path):
    """The how-to's example, run as written: its section is validated like any core key, its
    defaults are filled in, the reference documents it, and a simulation trains with it."""
    from sfl_core.config.fields import ConfigError
    from sfl_core.config.reference import documented
    from sfl_core.config.run import run_config_from_dict
    from sfl_core.methods import unregister_method, unregister_section
    from simulation import run_simulation

    (tmp_path / "own_method_example.py").write_text(_own_method_snippet())   # as a user's module would be
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("own_method_example")
        base = {"fleet": [{"profile": "s2fl-low-low", "count": 2}], "model": "small_cnn", "strategy": "alternate",
                "rounds": 4, "local_iters": 2, "batch_size": 8, "eval_samples": 64,
                "output_dir": str(tmp_path / "out")}
        cfg = run_config_from_dict({**base, "alternate": {"period": 2}})
        assert cfg.sections["alternate"].period == 2
        assert run_config_from_dict(base).sections["alternate"].period == 1          # its default
        with pytest.raises(ConfigError, match=r"field 'alternate\.period': expected a positive integer"):
            run_config_from_dict({**base, "alternate": {"period": 0}})
        with pytest.raises(ConfigError, match=r"field 'alternate\.perid': unknown key; did you mean 'period'"):
            run_config_from_dict({**base, "alternate": {"perid": 2}})
        assert ("alternate.period", "rounds at each cut before switching to the other") in documented()
        history, _ = run_simulation(cfg, device="cpu")
        trained = [r for r in history if r["round"] >= 1]
        splits = [sorted({a["split"] for a in r["agents"].values()}) for r in trained]
        assert splits == [[1], [1], [2], [2]]
        assert len(trained) == 4 and all(0.0 <= r["accuracy"] <= 1.0 for r in trained)
    finally:
        unregister_method("alternate")
        unregister_section("alternate")
        sys.modules.pop("own_method_example", None)
        sys.path.remove(str(tmp_path))


# --------------------------------------------------------------- a new training option is one module

def _own_option_snippet() -> str:
    text = (REPO / "docs" / "how-to" / "own-option.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return next(b for b in blocks if "register_option" in b)


def test_a_training_option_is_one_module_and_its_registration(tmp_path):
    """The how-to's example, run as written: its section is validated and documented like any
    core key, and through a simulation it changes nothing at eta 1 and the training at eta 0.5."""
    from sfl_core.config.fields import ConfigError
    from sfl_core.config.reference import documented
    from sfl_core.config.run import run_config_from_dict
    from sfl_core.option_registry import unregister_option
    from simulation import run_simulation

    (tmp_path / "own_option_example.py").write_text(_own_option_snippet())   # as a user's module would be
    sys.path.insert(0, str(tmp_path))
    try:
        example = importlib.import_module("own_option_example")
        base = {"fleet": [{"profile": "s2fl-low-low", "count": 2}], "model": "small_cnn", "strategy": "sfl",
                "rounds": 2, "local_iters": 2, "batch_size": 8, "eval_samples": 64}
        assert run_config_from_dict({**base, "server_step": 0.5}).sections["server_step"].eta == 0.5
        assert run_config_from_dict(base).sections["server_step"].eta == 1.0          # its default
        with pytest.raises(ConfigError, match=r"field 'server_step\.eta': expected a positive number"):
            run_config_from_dict({**base, "server_step": -1})
        with pytest.raises(ConfigError, match=r"field 'server_step\.et': unknown key; did you mean 'eta'"):
            run_config_from_dict({**base, "server_step": {"et": 2}})
        assert ("server_step.eta", "the step size (1 = plain averaging)") in documented()

        def run(name: str, eta: float):
            cfg = run_config_from_dict({**base, "server_step": eta, "output_dir": str(tmp_path / name)})
            history, engine = run_simulation(cfg, device="cpu")
            return [(r["accuracy"], r["train_loss"]) for r in history], engine
        plain, _ = run("plain", 1.0)
        same, engine = run("same", 1.0)
        half, halved = run("half", 0.5)
        assert same == plain and engine.option(example.ServerStep) is None
        assert halved.option(example.ServerStep) is not None and half[2] != plain[2]
    finally:
        unregister_option("server_step")
        sys.modules.pop("own_option_example", None)
        sys.path.remove(str(tmp_path))


def test_every_package_folder_is_a_package_the_wheel_ships():
    """A folder of product modules without ``__init__.py``, or missing from pyproject's
    ``packages``, would work from the checkout and be left out of the wheel."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(REPO).parts) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    assert sorted(f for f in folders if not (REPO / f.replace(".", "/") / "__init__.py").is_file()) == []
    assert sorted(folders - listed) == []
