"""Helpers the process-level tests share: writing a run config, starting the coordinator and
agents as a user would (``python -m``), collecting exit codes, metrics and logs. A plain
module (not a test module), so tests import it instead of importing each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DATASETS = Path(os.environ.get("SFL_DATASETS", REPO.parent / "shared" / "datasets"))
"""The real data sets for tests that use them when present: $SFL_DATASETS, else shared/ beside the repository."""
PROFILES = ["s2fl-low-low", "s2fl-mid-mid", "s2fl-high-high"]


def write_config(tmp_path: Path, run: str, **overrides) -> Path:
    cfg = {
        "run": run, "model": "small_cnn",
        "data": {"dataset": "digits", "partition": "iid", "seed": 0},
        "fleet": [{"profile": p, "count": 1} for p in PROFILES],
        "rounds": 2, "strategy": "sfl", "server_mode": "merged", "batch_size": 16, "lr": 0.05,
        "momentum": 0.5, "local_iters": 10, "step_timeout_s": 20, "register_timeout_s": 90,
        "output_dir": str(tmp_path / "out"),
    }
    cfg.update(overrides)
    path = tmp_path / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_coord(config: Path, tmp_path: Path, *args: str, name: str = "coord") -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve", "--config", str(config), "--quiet",
                             "--verbose", *args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def start_agents(broker: str, run: str, tmp_path: Path, n: int = 3, emulate: bool = True,
                 extra: dict[int, list[str]] | None = None) -> list[subprocess.Popen]:
    procs = []
    for i in range(n):
        log = open(tmp_path / f"agent-{i}.log", "w")
        cmd = [sys.executable, "-m", "edge_agent.cli", "start", "--profile", PROFILES[i % len(PROFILES)],
               "--broker", broker, "--run", run, "--index", str(i), "--agent-id", f"a{i}", "--verbose"]
        if emulate:
            cmd.append("--emulate")
        cmd += (extra or {}).get(i, [])
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def metrics(tmp_path: Path) -> list[dict]:
    path = tmp_path / "out" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(tmp_path.glob("*.log")))


def wait_log(path: Path, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.1)
    return False
