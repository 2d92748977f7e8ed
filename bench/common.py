"""Small helpers shared by the bench scripts: argument conventions, real data, timing,
rich tables and JSON results with machine information.

Why a shared module: every benchmark must be reproducible from its JSON alone, so each
result file records the same machine facts (torch version, device, CPU count, git commit)
and the exact command line, and every script takes the same ``--quick`` / ``--out`` /
``--data`` options so the smoke test can drive them uniformly.

The scripts import this as ``common`` (``python bench/<name>.py`` puts ``bench/`` first
on ``sys.path``); they also put the repository root on the path so a fresh checkout runs
without ``pip install -e .``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
DATASETS_DIR = Path(os.environ.get("SFL_DATASETS", REPO_ROOT.parent / "shared" / "datasets"))
"""Real data sets: $SFL_DATASETS, else shared/datasets beside the repository."""
DEFAULT_FASHION_MNIST = DATASETS_DIR / "fashion-mnist"

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402  (after the path fix on purpose)

from sfl_core.data.builtin import DATASET_NAMES, Dataset, load_dataset  # noqa: E402


# --------------------------------------------------------------------------- arguments


def default_data() -> str:
    """Real Fashion-MNIST when this machine has it, else scikit-learn's bundled digits."""
    return str(DEFAULT_FASHION_MNIST) if DEFAULT_FASHION_MNIST.is_dir() else "digits"


def coordinator_key(out_dir: Path) -> str:
    """The public key of the coordinator whose output directory is ``out_dir``, its key pair made
    there ahead (as ``sfl-coord broker-config`` does): what a bench's agents follow
    (``--coordinator-key``)."""
    from sfl_core.wire.signing import KEY_FILE, Signer, public_text

    return public_text(Signer.load_or_create(Path(out_dir) / KEY_FILE).public)


def base_parser(description: str | None) -> argparse.ArgumentParser:
    """Options every bench script accepts: ``--quick``, ``--out``, ``--data``, ``--seed``."""
    p = argparse.ArgumentParser(description=(description or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny configuration for smoke tests (numbers are not meaningful)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR,
                   help=f"folder for the JSON result (default {RESULTS_DIR})")
    p.add_argument("--data", default=default_data(),
                   help="data set: 'digits', 'mnist', 'fashion-mnist' or a folder with the idx files "
                        f"(default: {default_data()})")
    p.add_argument("--seed", type=int, default=0, help="torch seed for model weights and batch choice")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op CPU threads (default: torch's choice); 1 gives steadier numbers "
                        "on a machine shared with other jobs, where extra threads spin against each other")
    return p


def apply_threads(args: argparse.Namespace) -> None:
    """Honour ``--threads`` (``--quick`` defaults to 1); the value in effect is recorded by :func:`machine_info`."""
    if args.threads is None and getattr(args, "quick", False):
        args.threads = 1
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit("--threads must be >= 1")
        torch.set_num_threads(args.threads)


def load_data(spec: str) -> Dataset:
    """Load ``spec``: a data set name, or a folder whose name says which set it holds."""
    key = spec.strip().lower()
    if key in DATASET_NAMES and not Path(spec).exists():
        return load_dataset(key)
    path = Path(spec).expanduser()
    name = path.name.lower()
    if "fashion" in name:
        return load_dataset("fashion-mnist", path)
    if "mnist" in name:
        return load_dataset("mnist", path)
    if "cifar" in name:
        return load_dataset("cifar10", path)
    raise SystemExit(f"--data {spec!r}: expected one of {', '.join(DATASET_NAMES)} or a folder named "
                     "after its data set (e.g. .../fashion-mnist)")


def parse_shape(text: str) -> tuple[int, ...]:
    """``'3,32,32'`` -> ``(3, 32, 32)``, with a clear message for anything else."""
    try:
        shape = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"input shape {text!r}: expected comma-separated ints like 3,32,32") from None
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"input shape {text!r}: dimensions must be >= 1")
    return shape


# --------------------------------------------------------------------------- timing


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls.

    The median, not the mean, because a 2-core machine shared with other processes has
    occasional long outliers that say nothing about the code being measured.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------- machine info


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device | str = "cpu") -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return cpu_name()


SOURCE_SUFFIXES = (".py", ".yaml", ".yml", ".toml")
"""Untracked files with these suffixes could change what a run does; any other (a log, an
``--out`` folder of results a run left in the tree) cannot."""


def source_changed(porcelain: str) -> bool:
    """Whether ``git status --porcelain --untracked-files=all`` lists a change to the source: a
    tracked file changed, or an untracked file of :data:`SOURCE_SUFFIXES`."""
    return any(not line.startswith("??") or line[3:].strip().strip('"').endswith(SOURCE_SUFFIXES)
               for line in porcelain.splitlines())


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Facts needed to compare two result files: software, hardware, source revision."""
    commit = _git("rev-parse", "HEAD")
    # results written by earlier runs are not source: a run from a tree holding them is at the commit
    status = (_git("status", "--porcelain", "--untracked-files=all", "--", ".", ":(exclude)bench/results")
              if commit else None)
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(torch.device(device)),
        "device_name": device_name(device),
        "cpu_name": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "git_commit": commit,
        "git_dirty": source_changed(status) if status is not None else None,
    }


def write_result(out_dir: Path, name: str, payload: dict[str, Any], device: torch.device | str = "cpu") -> Path:
    """Write ``<out_dir>/<name>.json`` with the command line and machine info added."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),   # quoted: it can be pasted back
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(device),
        **payload,
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------- tables


def at_time(curve: list[dict[str, Any]], budget_s: float) -> float:
    """The accuracy of the last model evaluated within ``budget_s`` seconds of ``curve``'s
    ``elapsed_s`` (a row read at a reference run's time)."""
    return [r for r in curve if r["elapsed_s"] <= budget_s + 1e-9][-1]["accuracy"]


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str | None = None) -> None:
    """Print a right-aligned rich table; floats are shown with 3 significant digits."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption, show_lines=False)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    Console(width=200).print(table)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) < 1e-3:
            return f"{v:.2e}"
        return f"{v:.3g}"
    return str(v)


# --------------------------------------------------------------------------- simulation sweeps


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, mappings merged key by key (lists and scalars replaced)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def config_record(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed arguments as JSON-friendly values (paths as strings), for the result file."""
    def plain(v: Any) -> Any:
        return str(v) if isinstance(v, Path) else [plain(x) for x in v] if isinstance(v, list) else v
    return {k: plain(v) for k, v in vars(args).items()}


def run_jobs(fn: Callable[[Any], Any], jobs: Sequence[Any], args: argparse.Namespace) -> list[Any]:
    """``fn`` over ``jobs``: in ``args.jobs`` worker processes (one core each) or in this one."""
    if getattr(args, "jobs", 1) > 1:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(args.jobs) as pool:
            return list(pool.map(fn, jobs))
    apply_threads(args)
    return [fn(j) for j in jobs]


CURVE_KEYS = ("round", "accuracy", "elapsed_s", "bytes_up", "bytes_down")
"""What a bench keeps of each round's metrics (its curves), besides :func:`flagged`."""


def flagged(round_metrics: dict[str, Any]) -> list[str]:
    """The agents the robust option flagged in a round (its metrics ``robust``): on an honest
    fleet, its false positives."""
    from sfl_core.options.robust.option import flagged_in
    return sorted(flagged_in(round_metrics.get("robust") or {}))


def tally(counts: Iterable[Mapping[Any, int]]) -> dict[str, int]:
    """Counts by an integer key (a window, a cut), added up over runs, in the keys' order."""
    out: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            out[str(k)] = out.get(str(k), 0) + n
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def simulate_seeds(label: str, make_config: Callable[[int], Any], seeds: int, device: str = "auto",
                   first: int = 0) -> list[list[dict[str, Any]]]:
    """One simulated run per seed ``first .. first + seeds - 1`` of the run config
    ``make_config(seed)``, one progress line each; returns each run's curve (:data:`CURVE_KEYS`
    per round)."""
    from simulation import run_simulation
    runs = []
    for seed in range(first, first + seeds):
        t0 = time.time()
        history, _ = run_simulation(make_config(seed), device=device, quiet=True)
        runs.append([{**{k: r[k] for k in CURVE_KEYS}, "flagged": flagged(r)} for r in history])
        print(f"{label} seed {seed}: acc {history[-1]['accuracy']:.4f}  virtual {history[-1]['elapsed_s']:.0f} s  "
              f"({time.time() - t0:.0f} s wall)", flush=True)
    return runs


def plot_accuracy_vs_time(curves: dict[str, dict[str, list[list[dict[str, Any]]]]], path: Path,
                          by_round: bool = False) -> None:
    """One column per setting, one line per method: seed-mean accuracy against virtual time
    (and, with ``by_round``, a second row against rounds, so convergence shows apart from speed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    rows = 2 if by_round else 1
    fig, axes = plt.subplots(rows, len(curves), figsize=(5 * len(curves), 3.75 * rows + 0.25), squeeze=False)
    for col, (setting, by_method) in enumerate(curves.items()):
        for m, runs in by_method.items():
            n = min(len(r) for r in runs)
            acc = [statistics.mean(r[i]["accuracy"] for r in runs) for i in range(n)]
            axes[0][col].plot([statistics.mean(r[i]["elapsed_s"] for r in runs) for i in range(n)], acc, label=m)
            if by_round:
                axes[1][col].plot([runs[0][i]["round"] for i in range(n)], acc, label=m)
        axes[0][col].set_title(setting)
        axes[0][col].set_xlabel("virtual time (s)")
        if by_round:
            axes[1][col].set_xlabel("round")
        for ax in axes[:, col]:
            ax.set_ylabel("test accuracy")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
