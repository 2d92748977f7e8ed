"""Is ``sfl-coord simulate`` at least as fast as the deployment it imitates, on one machine?

The user's question: "before I install anything on my boards I simulate the fleet; is that
quicker than just running the real thing on this machine?" A simulation that takes longer
than the deployment it imitates is not worth running first.

The bench writes a fleet of its own-data devices from real Fashion-MNIST images (the same
writer as ``bench/own_data.py``: label-skewed PNG folders of unequal sizes and a server
validation folder), then, for each seed, runs one run config two ways on this host:

- **deployed**: ``sfl-coord serve`` (embedded MQTT broker on loopback) and one
  ``sfl-agent start`` process per device reading its folder, as a user would run them
  (no emulation: the agents compute as fast as this host lets them);
- **simulated**: ``sfl-coord simulate`` of the same config (in-process agents, virtual clock).

Reported: each one's wall seconds from the command's start to its exit (process start-up
included), their ratio, the final accuracy of each (the same training, so alike), and where
the simulation's time goes (``--profile``: cProfile of the simulation in this process, by
phase: the agents' steps, the server's steps, evaluation, reading the devices' data).

    python bench/simulate_speed.py                 # 3 devices, 10 rounds, 2 seeds
    python bench/simulate_speed.py --quick         # smoke test
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

import common  # noqa: E402  (puts the repo root on sys.path)
from brokers import free_port  # noqa: E402
from own_data import CLASSES, write_fleet  # noqa: E402

from sfl_core.data.builtin import _read_mnist_dir  # noqa: E402

PHASES = {
    "agents' steps": ("edge_agent/agent.py", "handle"),
    "server steps": ("coordinator/server_trainer.py", "step"),
    "evaluation": ("coordinator/scoring.py", "evaluate"),
    "federated evaluation": ("coordinator/scoring.py", "_federated_evaluation"),
    "reading the devices' data": ("simulation/inprocess.py", "build_fleet"),
}
"""Functions whose cumulative time is a phase of a simulation (file suffix, function name)."""


def run_config(root: Path, fleet: list[dict[str, Any]], args: Any, seed: int, name: str) -> Path:
    cfg = {"run": f"speed-{name}", "model": args.model, "strategy": args.strategy, "rounds": args.rounds,
           "local_iters": args.local_iters, "batch_size": args.batch_size, "lr": args.lr, "momentum": 0.5,
           "seed": seed, "task": {"classes": CLASSES, "input_shape": [1, 28, 28], "normalize": "federated"},
           "eval": {"data": str(root / "server"), "federated_every": 1},
           "fleet": [{"profile": d["profile"], "data": str(root / d["device"])} for d in fleet],
           "output_dir": str(root / "runs" / f"{name}-{seed}")}
    path = root / f"{name}-{seed}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def final_accuracy(out: Path) -> float:
    import json
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return float(json.loads(lines[-1])["accuracy"])


def deployed(root: Path, fleet: list[dict[str, Any]], args: Any, seed: int) -> dict[str, Any]:
    """``serve`` with an embedded broker and one agent process per device; wall seconds until all exit."""
    config = run_config(root, fleet, args, seed, "deployed")
    out = root / "runs" / f"deployed-{seed}"
    key = common.coordinator_key(out)
    port = free_port()
    t0 = time.perf_counter()
    logs = open(root / f"deployed-{seed}.log", "w")
    coord = subprocess.Popen([sys.executable, "-m", "cli.coord", "serve", "-c", str(config), "--quiet",
                              "--listen", f"127.0.0.1:{port}"], stdout=logs, stderr=subprocess.STDOUT,
                             cwd=common.REPO_ROOT)
    agents = [subprocess.Popen([sys.executable, "-m", "cli.agent", "start", "--profile", d["profile"], "--broker",
                                f"mqtt://127.0.0.1:{port}", "--run", "speed-deployed", "--agent-id", d["device"],
                                "--data", str(root / d["device"]), "--coordinator-key", key],
                               stdout=logs, stderr=subprocess.STDOUT, cwd=common.REPO_ROOT) for d in fleet]
    try:
        codes = [p.wait(timeout=3600) for p in (coord, *agents)]
    finally:
        for p in (coord, *agents):
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.perf_counter() - t0
    if any(codes):
        logs.close()
        raise SystemExit(f"deployed run failed (exit codes {codes}):\n"
                         + (root / f"deployed-{seed}.log").read_text()[-3000:])
    return {"wall_s": wall, "final": final_accuracy(out)}


def simulated(root: Path, fleet: list[dict[str, Any]], args: Any, seed: int) -> dict[str, Any]:
    """``sfl-coord simulate`` as a user runs it; wall seconds to its exit."""
    config = run_config(root, fleet, args, seed, "simulated")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "cli.coord", "simulate", "-c", str(config), "--quiet"],
                       cwd=common.REPO_ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"simulate failed: {p.stderr[-2000:]}")
    return {"wall_s": wall, "final": final_accuracy(root / "runs" / f"simulated-{seed}")}


def profile(root: Path, fleet: list[dict[str, Any]], args: Any, seed: int) -> dict[str, float]:
    """Where a simulation's seconds go: cumulative seconds of each of :data:`PHASES`."""
    from sfl_core.config.run import load_run_config
    from simulation import run_simulation

    cfg = load_run_config(run_config(root, fleet, args, seed, "profiled"))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(run_simulation, cfg, quiet=True)
    total = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats   # type: ignore[attr-defined]
    out = {"total": total}
    for phase, (suffix, func) in PHASES.items():
        out[phase] = sum(v[3] for (file, _, name), v in stats.items() if file.endswith(suffix) and name == func)
    return out


def main() -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--largest", type=int, default=3000, help="images on the largest device (halving per device)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew")
    p.add_argument("--val", type=int, default=1000, help="server validation images")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-iters", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--strategy", default="sfl")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="also break one simulation's time down by phase")
    args = p.parse_args()
    if args.quick:
        args.devices, args.largest, args.val, args.rounds, args.local_iters, args.seeds = 3, 200, 200, 2, 5, 1
    common.apply_threads(args)
    data = Path(args.data)
    if not data.is_dir():
        raise SystemExit(f"--data {args.data}: this bench reads Fashion-MNIST's idx files from a folder "
                         f"(default {common.DEFAULT_FASHION_MNIST})")
    raw = _read_mnist_dir(data)
    results, phases = [], None
    with tempfile.TemporaryDirectory(prefix="sfl-simulate-speed-") as tmp:
        for seed in range(args.seeds):
            root = Path(tmp) / f"seed{seed}"
            fleet = write_fleet(root, raw, args.devices, args.largest, args.val, args.alpha, seed)["devices"]
            sim = simulated(root, fleet, args, seed)
            dep = deployed(root, fleet, args, seed)
            results.append({"seed": seed, "simulated": sim, "deployed": dep, "ratio": sim["wall_s"] / dep["wall_s"]})
            print(f"seed {seed}: simulate {sim['wall_s']:.1f} s ({sim['final']:.4f}), deployed {dep['wall_s']:.1f} s "
                  f"({dep['final']:.4f}): simulate / deployed {sim['wall_s'] / dep['wall_s']:.2f}", flush=True)
            if args.profile and phases is None:
                phases = profile(root, fleet, args, seed)
    rows = [[r["seed"], r["simulated"]["wall_s"], r["deployed"]["wall_s"], r["ratio"], r["simulated"]["final"],
             r["deployed"]["final"]] for r in results]
    rows.append(["mean", statistics.mean(r["simulated"]["wall_s"] for r in results),
                 statistics.mean(r["deployed"]["wall_s"] for r in results), statistics.mean(r["ratio"] for r in results),
                 statistics.mean(r["simulated"]["final"] for r in results),
                 statistics.mean(r["deployed"]["final"] for r in results)])
    rows.append(["worst", "", "", max(r["ratio"] for r in results), "", ""])
    common.print_table(f"simulate vs deployed on this host: {args.devices} devices, {args.rounds} rounds, "
                       f"{args.strategy}, {args.model}",
                       ["seed", "simulate s", "deployed s", "simulate / deployed", "sim. accuracy", "dep. accuracy"],
                       rows, caption="wall seconds from the command's start to its exit, process start-up included")
    if phases:
        common.print_table("where one simulation's seconds go (cProfile, cumulative; phases overlap none)",
                           ["phase", "seconds", "share"],
                           [[k, v, v / phases["total"]] for k, v in phases.items()])
    name = "simulate_speed" + ("-quick" if args.quick else "")
    path = common.write_result(Path(args.out), name, {
        "config": common.config_record(args),
        "reference": "deployed: sfl-coord serve (embedded broker) and one sfl-agent start per device, this host",
        "results": results, "phases": phases})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
