"""Does a refactoring change what the product computes? Same runs, same numbers, to the bit.

A re-layout (moving modules, splitting packages, renaming) must not change a single metric.
This script runs the shipped run configs (``profiles/runs/*.yaml``, ``--rounds`` each, in
simulation), each training option on the demo's fleet (:data:`OPTION_RUNS`) and two
paper-bench settings (``bench/paper.py <paper> --quick``), and keeps each
run's metrics history (the paper settings: six methods of ``mixed`` and the two recipes of
``noniid`` that use every training option) with
the fields that measure *this host* removed (``wall_s``, and each
agent's ``compute_s`` and ``server_s``: host seconds, different on every run). Everything
else — accuracies, losses, virtual times, bytes, plans, assignments — must be identical:

    python bench/identical.py --write bench/results/identical-reference.json   # before a step
    python bench/identical.py --check bench/results/identical-reference.json   # after it

``--check`` prints, per run, ``identical`` or the first differing field, and exits 1 if any
run differs. The reference records the commit it was taken at.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import common  # noqa: E402  (puts the repo root on sys.path)

from sfl_core.config.run import default_profiles_dir, load_run_config  # noqa: E402

HOST_TIME_KEYS = frozenset({"wall_s", "eval_s", "compute_s", "server_s"})
"""Fields that measure the host running the simulation, not the simulated fleet."""


def canonical(value: Any) -> Any:
    """``value`` without :data:`HOST_TIME_KEYS`, at any depth."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items() if k not in HOST_TIME_KEYS}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def without_keys(value: Any, keys: set[str]) -> Any:
    """``value`` without the record keys ``keys``, at any depth."""
    if isinstance(value, dict):
        return {k: without_keys(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without_keys(v, keys) for v in value]
    return value


def first_difference(a: Any, b: Any, path: str = "", rel: float = 0.0) -> str:
    """Where two canonical histories first differ ('' when they are equal); with ``rel``, numbers
    within that relative difference count as equal (for a reference written on another CPU,
    whose float kernels change the weights' last bits and so the compressed sizes)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: only in the {'reference' if k in a else 'new run'}"
            d = first_difference(a[k], b[k], f"{path}.{k}", rel)
            if d:
                return d
        return ""
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} entries in the reference, {len(b)} now"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]", rel)
            if d:
                return d
        return ""
    if rel and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
        return "" if abs(a - b) <= rel * max(abs(a), abs(b)) else f"{path}: {a!r} in the reference, {b!r} now"
    return "" if a == b else f"{path}: {a!r} in the reference, {b!r} now"


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    return [canonical(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def shipped_runs(work: Path, rounds: int, only: str | None = None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    from simulation import run_simulation

    for path in sorted((default_profiles_dir() / "runs").glob("*.yaml")):
        if only is not None and path.stem != only:
            continue
        cfg = load_run_config(path)
        cfg = dataclasses.replace(cfg, rounds=rounds, output_dir=str(work / path.stem))
        if cfg.data.root is None and (common.DATASETS_DIR / cfg.data.dataset).is_dir():   # the real files here
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data,
                                                                     root=str(common.DATASETS_DIR / cfg.data.dataset)))
        run_simulation(cfg, quiet=True)
        print(f"ran {path.name}", flush=True)
        yield f"runs/{path.name}", read_history(work / path.stem)


OPTION_RUNS: dict[str, dict[str, Any]] = {
    "scaffold": {"drift": "scaffold"},
    "fedprox": {"drift": {"kind": "fedprox", "mu": 0.1}},
    "scaffold-per-agent": {"drift": "scaffold", "strategy": "sfl", "server_mode": "per_agent"},
    "fedprox-per-agent": {"drift": {"kind": "fedprox", "mu": 0.1}, "strategy": "sfl", "server_mode": "per_agent"},
    "server-momentum": {"server_opt": {"kind": "momentum", "lr": 1.0, "beta1": 0.5}},
    "server-adam": {"server_opt": {"kind": "adam", "lr": 0.01}},
    "model-ema": {"model_ema": 0.8},
    "norm-federated": {"norm_stats": {"mode": "federated", "every": 2, "agents": 2}},
    "norm-frozen-local": {"norm_stats": {"freeze_after": 1, "local": True}},
    "calibrated-loss": {"loss": "calibrated", "calibration_tau": 0.5},
    "all-options": {"drift": "scaffold", "server_opt": {"kind": "momentum", "beta1": 0.5}, "model_ema": 0.8,
                    "norm_stats": "federated", "eval": {"federated_every": 2}},
}
"""The training options beside the methods, each on the demo's fleet with a BatchNorm model (so
the statistics options act): a refactoring of the option seam must leave every one unchanged."""


def option_runs(work: Path, rounds: int) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    import yaml

    from simulation import run_simulation
    from sfl_core.config.run import run_config_from_dict

    path = default_profiles_dir() / "runs" / "demo.yaml"
    base = yaml.safe_load(path.read_text())
    base.update(model="vgg_mini:width=0.5", rounds=rounds)
    if (common.DATASETS_DIR / base["data"]["dataset"]).is_dir():
        base["data"] = {**base["data"], "root": str(common.DATASETS_DIR / base["data"]["dataset"])}
    for name, extra in OPTION_RUNS.items():
        cfg = run_config_from_dict({**base, **extra, "run": f"opt-{name}", "output_dir": str(work / f"opt-{name}")},
                                   f"option run {name}", base_dir=path.parent)
        run_simulation(cfg, quiet=True)
        print(f"ran option {name}", flush=True)
        yield f"options/{name}", read_history(work / f"opt-{name}")


PAPER_METHODS = {
    "mixed": ("FedAvg", "SFL fastest", "S2FL+MB", "FM+BR", "FedFC mixed", "auto"),
    "noniid": ("MergeSFL+stats+scaffold+adam, per agent, EMA", "SFL-v2+all, split 1, EMA"),
}
"""Of each paper setting (bench/configs/<paper>.yaml): the mixed fleet's every method family once,
and the label-skewed fleet's recipes that switch every training option on."""


def paper_runs(work: Path, paper: str, data: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    import paper as paper_bench

    paper_bench.main([paper, "--quick", "--work", str(work / paper), "--out", str(work / "paper-out"),
                      "--data", data, "--methods", *PAPER_METHODS[paper]])
    for run_dir in sorted(p.parent for p in (work / paper).glob("*/metrics.jsonl")):
        yield f"paper/{paper}/{run_dir.name}", read_history(run_dir)


def main() -> int:
    p = common.base_parser(__doc__)
    p.add_argument("--write", type=Path, help="record the histories here (the reference)")
    p.add_argument("--check", type=Path, help="compare with this reference")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--ignore", nargs="*", default=[], metavar="KEY",
                   help="with --check: record keys left out of the comparison (a key the code under test "
                        "adds to every round, e.g. learning: the options auto decided)")
    p.add_argument("--paper", nargs="*", default=list(PAPER_METHODS), choices=list(PAPER_METHODS),
                   help="the paper-bench settings to include (bench/configs/)")
    args = p.parse_args()
    if (args.write is None) == (args.check is None):
        raise SystemExit("give exactly one of --write REF.json or --check REF.json")
    common.apply_threads(args)
    with tempfile.TemporaryDirectory(prefix="sfl-identical-") as tmp:
        work = Path(tmp)
        if args.quick:   # the smoke test: one shipped config, one round, no paper setting
            runs = dict(shipped_runs(work, 1, only="demo"))
        else:
            runs = dict(shipped_runs(work, args.rounds))
            runs.update(option_runs(work, args.rounds))
            for paper in args.paper:
                runs.update(paper_runs(work, paper, args.data))
    digests = {name: hashlib.sha256(json.dumps(h, sort_keys=True).encode()).hexdigest()[:16]
               for name, h in runs.items()}
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps({"machine": common.machine_info(), "config": common.config_record(args),
                                          "digests": digests, "histories": runs}, indent=1) + "\n")
        print(f"wrote {args.write}: {len(runs)} runs")
        return 0
    ref = json.loads(args.check.read_text())
    differ = 0
    for name in sorted(set(ref["histories"]) | set(runs)):
        if name not in runs or name not in ref["histories"]:
            print(f"{name}: {'missing now' if name not in runs else 'not in the reference'}")
            differ += 1
            continue
        d = first_difference(without_keys(ref["histories"][name], set(args.ignore)),
                             without_keys(runs[name], set(args.ignore)))
        print(f"{name}: {'identical' if not d else d}")
        differ += bool(d)
    print(f"{len(runs) - differ} of {len(runs)} runs identical to {args.check} "
          f"(taken at {ref['machine'].get('git_commit')})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
