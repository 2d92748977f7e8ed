"""What an agent costs a board: installed size, and resident memory idle and training.

A user's question: "will the agent fit on my 4 GB Jetson Nano or Raspberry Pi next to what
else runs there?" Three figures answer it:

- **installed size** of ``pip install sfl-edge`` (the lean agent) and of
  ``sfl-edge[coordinator]``: every distribution in each requirement closure, summed from the
  files the installed distributions list (this environment's builds: torch dominates and
  differs per platform, so it is reported on its own line);
- **idle RSS**: an agent that has registered and waits for its round (Python, torch, the
  data shard and the MQTT client);
- **peak RSS while training** (``VmHWM``), for the demo model (``small_cnn`` on digits) and
  ``vgg_mini`` (Fashion-MNIST when ``$SFL_DATASETS`` has it, else digits at 28x28).

Reference in the same run: the planner's own memory estimate of the client portion (what
``auto`` compares with a profile's ``memory_bytes``): weights, gradients, momentum and the
activations of one batch. The difference to the measured peak is the runtime the agent adds.

    python bench/agent_footprint.py
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (bench helper; also puts the repo root on sys.path)
import yaml  # noqa: E402
from brokers import MosquittoBroker  # noqa: E402

from sfl_core.config.run import list_profiles, load_profile, load_run_config  # noqa: E402
from sfl_core.model.accounting import model_costs  # noqa: E402

REPO = common.REPO_ROOT
MB = 1024 * 1024


# ------------------------------------------------------------------ installed size

def closure(dist: str, extras: tuple[str, ...] = ()) -> set[str]:
    """Distribution names ``dist`` (with ``extras``) needs in this environment, itself included;
    environment markers are evaluated for this interpreter."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [(canonicalize_name(dist), extras)]
    while todo:
        name, want = todo.pop()
        if name in seen:
            continue
        try:
            d = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for text in d.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (want or ("",))):
                todo.append((canonicalize_name(req.name), tuple(req.extras)))
    return seen


def dist_bytes(name: str) -> int:
    d = metadata.distribution(name)
    total = 0
    for f in d.files or []:
        p = Path(d.locate_file(f))
        if p.is_file():
            total += p.stat().st_size
    return total


def installed_sizes() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, extras in (("agent", ()), ("coordinator", ("coordinator",))):
        names = sorted(closure("sfl-edge", extras))
        sizes = {n: dist_bytes(n) for n in names}
        out[label] = {"distributions": len(names), "bytes": sum(sizes.values()),
                      "torch_bytes": sizes.get("torch", 0), "largest": sorted(sizes.items(), key=lambda kv: -kv[1])[:6]}
    return out


# ------------------------------------------------------------------ resident memory

def _status(pid: int) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(.+)$", text, re.M)}


def one_model(model: str, data: dict[str, Any], shape: tuple[int, ...], work: Path, broker: MosquittoBroker,
              batch: int) -> dict[str, Any]:
    """Two agents of one run: the first is sampled while it waits for the second (idle), then
    through two rounds of training (peak)."""
    work.mkdir(parents=True, exist_ok=True)
    config = work / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": "footprint", "model": model, "data": data, "fleet": [{"profile": "rpi4", "count": 2}],
        "rounds": 2, "strategy": "sfl", "server_mode": "merged", "batch_size": batch, "lr": 0.05,
        "local_iters": 10, "register_timeout_s": 300, "output_dir": str(work / "out")}))
    coord = subprocess.Popen([sys.executable, "-m", "cli.coord", "serve", "--config", str(config), "--broker",
                              broker.url, "--quiet"], cwd=REPO, stdout=open(work / "coord.log", "w"),
                             stderr=subprocess.STDOUT)

    def agent(i: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "cli.agent", "start", "--profile", "rpi4", "--broker",
                                 broker.url, "--run", "footprint", "--index", str(i), "--agent-id", f"f{i}",
                                 "--verbose", "--coordinator-key", common.coordinator_key(work / "out")]
                                + (["--data", data["root"]] if data.get("root") else []),
                                cwd=REPO, stdout=open(work / f"agent-{i}.log", "w"), stderr=subprocess.STDOUT)
    first = agent(0)
    deadline = time.monotonic() + 300
    while "registered" not in (work / "agent-0.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3.0)   # registered, its shard loaded: waiting for the fleet
    idle = _status(first.pid).get("VmRSS", 0)
    second = agent(1)
    peak = 0
    while first.poll() is None:
        peak = max(peak, _status(first.pid).get("VmHWM", 0))
        time.sleep(0.05)
    for p in (second, coord):
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if first.returncode != 0 or coord.returncode != 0:
        raise SystemExit(f"{model}: agent exited {first.returncode}, coordinator {coord.returncode}; see {work}")
    cfg = load_run_config(config)
    costs = model_costs(model, shape, 10)
    split = cfg.split if cfg.split is not None else max(s for s in costs if costs[s].activation_bytes)
    c = costs[split]
    planned = 2 * c.client_param_bytes + batch * 2 * c.client_activation_bytes
    return {"model": model, "split": split, "batch_size": batch, "idle_rss_bytes": idle, "peak_rss_bytes": peak,
            "planner_estimate_bytes": planned}


def runtime_rss() -> int:
    """Resident memory of an interpreter that imported torch and the agent: the floor of any agent."""
    code = ("import re, torch, edge_agent.runner; "
            "print(int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024)")
    return int(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                              timeout=300).stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/sfl-footprint"))
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    sizes = installed_sizes()
    fashion = common.DEFAULT_FASHION_MNIST
    vgg_data = ({"dataset": "fashion-mnist", "root": str(fashion)} if fashion.is_dir()
                else {"dataset": "digits", "image_size": 28})
    with MosquittoBroker() as broker:
        runs = [one_model("small_cnn", {"dataset": "digits"}, (1, 8, 8), args.work / "small_cnn", broker, 16),
                one_model("vgg_mini", vgg_data, (1, 28, 28), args.work / "vgg_mini", broker, 32)]
    smallest = min(p.memory_bytes for p in map(load_profile, list_profiles()) if p.memory_bytes)
    floor = runtime_rss()
    common.write_result(args.out, "agent_footprint", {"installed": sizes, "rss": runs, "runtime_rss_bytes": floor,
                                                      "smallest_profile_memory_bytes": smallest,
                                                      "vgg_data": vgg_data["dataset"]})
    common.print_table("Installed size", ["install", "distributions", "MB", "of which torch MB"],
                       [[k, v["distributions"], v["bytes"] / MB, v["torch_bytes"] / MB] for k, v in sizes.items()])
    common.print_table("Agent memory", ["model", "split", "batch", "idle RSS MB", "peak RSS MB",
                                        "planner's estimate MB", "peak / smallest profile"],
                       [[r["model"], r["split"], r["batch_size"], r["idle_rss_bytes"] / MB, r["peak_rss_bytes"] / MB,
                         r["planner_estimate_bytes"] / MB, f"{r['peak_rss_bytes'] / smallest:.1%}"] for r in runs],
                       caption=f"runtime alone (python, torch, the agent's modules): {floor / MB:.0f} MB; the "
                               "idle agents add their data (the built-in sets load whole; digits needs scikit-learn)")


if __name__ == "__main__":
    main()
