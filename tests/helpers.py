"""Helpers the process-level tests share: writing a run config, starting the coordinator and
agents as a user would (``python -m``), collecting exit codes, metrics and logs. A plain
module (not a test module), so tests import it instead of importing each other."""

from __future__ import annotations

import importlib.util
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


def bench_module(name: str):
    """``bench/<name>.py`` imported by its path, as ``sfl_bench_<name>``: putting bench/ on
    sys.path would let its ``common`` shadow other modules."""
    spec = importlib.util.spec_from_file_location(f"sfl_bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # where its dataclasses look up their annotations
    spec.loader.exec_module(module)
    return module


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
    return subprocess.Popen([sys.executable, "-m", "cli.coord", "serve", "--config", str(config), "--quiet",
                             "--verbose", *args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def coordinator_key(out_dir: Path) -> str:
    """The public key of the coordinator whose output directory is ``out_dir``, its key pair
    made ahead there (as ``sfl-coord broker-config`` does), so agents can be started with it
    (``--coordinator-key``) before or beside the coordinator."""
    from sfl_core.wire.signing import KEY_FILE, Signer, public_text

    return public_text(Signer.load_or_create(out_dir / KEY_FILE).public)


def start_agents(broker: str, run: str, tmp_path: Path, n: int = 3, emulate: bool = True,
                 extra: dict[int, list[str]] | None = None, out_dir: Path | None = None,
                 only: list[int] | None = None) -> list[subprocess.Popen]:
    """``n`` agent processes (or those of ``only`` among them) following the coordinator of
    ``out_dir`` (default: write_config's)."""
    procs = []
    key = coordinator_key(out_dir or tmp_path / "out")
    for i in (range(n) if only is None else only):
        log = open(tmp_path / f"agent-{i}.log", "w")
        cmd = [sys.executable, "-m", "cli.agent", "start", "--profile", PROFILES[i % len(PROFILES)],
               "--broker", broker, "--run", run, "--index", str(i), "--agent-id", f"a{i}", "--verbose",
               "--coordinator-key", key]
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


def wait_rounds(tmp_path: Path, rounds: int, coord: subprocess.Popen, timeout: float) -> None:
    """Until ``rounds`` trained rounds are in the metrics (round 0, the untrained model, aside);
    fails with the logs if the coordinator exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    path = tmp_path / "out" / "metrics.jsonl"
    while not path.exists() or len(metrics(tmp_path)) < rounds + 1:
        assert time.monotonic() < deadline and coord.poll() is None, logs(tmp_path)
        time.sleep(0.1)


def wait_log(path: Path, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------- a fleet's own data

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
MODEL_FILE = '''
from torch import nn

def build_net(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(32 * (h // 2) * (w // 2), num_classes)),
    )
'''


def write_fleet(root: Path) -> dict[str, Path]:
    """Image folders of a fleet's own data, from scikit-learn's digits (real images): three
    devices of unequal sizes (one without 'three', one with a corrupt file and a val/ split)
    and the server's validation folder."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images * 255 / 16).round().astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(x))
    parts = {"pi-1": order[:250], "pi-2": order[250:400], "pi-3": order[400:800], "server": order[800:1100]}
    for dev, ids in parts.items():
        for k, i in enumerate(ids):
            y = int(d.target[i])
            if dev == "pi-2" and y == 3:
                continue
            split = "val" if dev == "server" or (dev == "pi-3" and k % 5 == 0) else "train"
            folder = root / dev / split / NAMES[y]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(x[i], "L").save(folder / f"{k}.png")
    (root / "pi-3" / "train" / "five" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return {k: root / k for k in parts}


# ---------------------------------------------------------------- MergeSFL's withheld labels

def withheld_answers(logits: dict, labels: dict) -> dict:
    """What agents that withheld their labels answer the server's step with: per agent, the
    gradient of its mean loss w.r.t. the logits it was sent, and that loss (on the host)."""
    import torch

    out = {}
    for a, z in logits.items():
        z = z.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(z, labels[a])
        loss.backward()
        out[a] = (z.grad, loss.item())
    return out
