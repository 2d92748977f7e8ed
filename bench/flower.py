"""Simulation speed against Flower: the same FedAvg job in ``sfl-coord simulate`` and in Flower's
simulation (Ray backend), whole-process wall time and accuracy per round.

    python bench/flower.py --flower-python ~/flwr-venv/bin/python      # 2 seeds, ~6 minutes on 2 cores
    python bench/flower.py --flower-python ... --quick                # smoke size, numbers not meaningful

Flower is a peer to measure against, never a dependency of this project: install it in a
virtual environment of its own (``pip install 'flwr[simulation]==1.42.0' torch msgpack zstandard
pydantic paho-mqtt pyyaml``; the last five let its client import this repository's model zoo
and data loader, so both sides train the same network on the same shards) and name that
environment's interpreter with ``--flower-python``.

The user's question: my method comparisons are simulations of many rounds; is this product's
simulator as fast as the framework I would otherwise use, at the same accuracy per round?

The job, identical on both sides: Fashion-MNIST over 20 clients (IID shards of this project's
partitioner), 5 clients drawn per round, 10 rounds; each drawn client runs ``--steps`` SGD steps
of batch 32 (lr 0.05) on the whole ``small_cnn`` from the global weights, and the server averages
the client models weighted by shard size and scores the global model on the 10,000 test images
after every round. Modes:

- ``flower``: ``flwr.simulation.run_simulation`` with the message-API ``FedAvg``
  (``fraction_train`` 0.25, no federated evaluation, a centralised ``evaluate_fn``), one Ray
  actor per core;
- ``sfl-coord simulate``: the same job as a run config (``strategy: fedavg``), in one process;
- ``sfl-coord simulate, eval_every 5``: the same, scoring every 5th round and the last.

Each mode runs as its own process; its wall time is the whole process (imports, Ray's start,
data loading, every round). The product's per-round metrics also split a round into its
evaluation (``eval_s``) and the rest (``wall_s`` includes both).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import common  # noqa: F401  (puts the repository on sys.path)

CLIENTS, PER_ROUND, ROUNDS, BATCH, LR = 20, 5, 10, 32, 0.05


# =========================================================================== the Flower side
# Runs in the Flower environment (--flower-worker), importing only this repository's model zoo,
# data loader and partitioner, so both sides train the same network on the same shards.


def flower_worker(spec_file: str) -> int:
    import torch
    import torch.nn.functional as F
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from sfl_core.data.builtin import load_dataset
    from sfl_core.data.partition import partition_indices
    from sfl_core.model.zoo import build_model

    spec = json.loads(Path(spec_file).read_text())
    data = load_dataset(spec["dataset"], spec["root"])
    shards = partition_indices(data.y_train.numpy(), spec["clients"], "iid", seed=spec["seed"])
    curve: list[dict[str, float]] = []
    t_start = spec["t_start"]

    def model() -> torch.nn.Module:
        torch.manual_seed(spec["seed"])
        return build_model("small_cnn", data.input_shape, data.num_classes)

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        cid = int(context.node_config["partition-id"])
        net = model()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(net.parameters(), lr=spec["lr"])
        idx = torch.as_tensor(shards[cid])
        gen = torch.Generator().manual_seed(spec["seed"] * 1000 + cid + 100 * int(msg.content["config"]["round"]))
        net.train()
        for _ in range(spec["steps"]):
            b = idx[torch.randint(len(idx), (spec["batch"],), generator=gen)]
            opt.zero_grad()
            loss = F.cross_entropy(net(data.x_train[b]), data.y_train[b])
            loss.backward()
            opt.step()
        content = RecordDict({"arrays": ArrayRecord(net.state_dict()),
                              "metrics": MetricRecord({"num-examples": len(idx), "loss": float(loss)})})
        return Message(content=content, reply_to=msg)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        net = model()

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            net.load_state_dict(arrays.to_torch_state_dict())
            net.eval()
            correct = 0
            with torch.no_grad():
                for i in range(0, len(data.y_test), 1024):
                    correct += int((net(data.x_test[i:i + 1024]).argmax(1) == data.y_test[i:i + 1024]).sum())
            acc = correct / len(data.y_test)
            curve.append({"round": server_round, "accuracy": acc, "t": time.time() - t_start})
            return MetricRecord({"accuracy": acc})

        from flwr.app import ConfigRecord

        strategy = FedAvg(fraction_train=spec["per_round"] / spec["clients"], fraction_evaluate=0.0,
                          min_train_nodes=spec["per_round"], min_available_nodes=spec["clients"],
                          min_evaluate_nodes=0)
        strategy.configure_train = _with_round(strategy.configure_train, ConfigRecord)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=spec["rounds"],
                       evaluate_fn=evaluate)

    run_simulation(server_app=server, client_app=client, num_supernodes=spec["clients"],
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"logging_level": "ERROR", "log_to_driver": False}})
    Path(spec["out"]).write_text(json.dumps({"curve": curve}))
    return 0


def _with_round(configure_train, config_record):
    """``FedAvg.configure_train`` whose messages carry ``config["round"]``."""
    def configure(server_round, arrays, config, grid):
        config = config_record({**dict(config), "round": server_round})
        return configure_train(server_round, arrays, config, grid)
    return configure


# =========================================================================== the product side


def product_config(args: Any, seed: int, out: Path, eval_every: int) -> dict[str, Any]:
    return {
        "run": f"flower-cmp-{seed}-{eval_every}", "model": "small_cnn", "strategy": "fedavg",
        "data": {"dataset": args.dataset_name, "root": args.dataset_root, "partition": "iid", "seed": seed},
        "fleet": [{"profile": "s2fl-high-high", "count": args.clients}], "per_round": args.per_round,
        "rounds": args.rounds, "batch_size": BATCH, "lr": LR, "local_iters": args.steps, "seed": seed,
        "eval_every": eval_every, "output_dir": str(out),
    }


def run_product(args: Any, seed: int, eval_every: int, tmp: Path) -> dict[str, Any]:
    import yaml

    out = tmp / f"product-{seed}-{eval_every}"
    config = tmp / f"product-{seed}-{eval_every}.yaml"
    config.write_text(yaml.safe_dump(product_config(args, seed, out, eval_every)))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "cli.coord", "simulate", "--config", str(config), "--quiet",
                           "--device", "cpu"], cwd=common.REPO_ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"sfl-coord simulate exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rounds = [m for m in metrics if m["round"] >= 1]
    return {"wall_s": wall, "curve": [{"round": m["round"], "accuracy": m["accuracy"]} for m in rounds],
            "eval_s": sum(m["eval_s"] for m in metrics), "rounds_wall_s": sum(m["wall_s"] for m in rounds),
            "final_accuracy": rounds[-1]["accuracy"]}


def run_flower(args: Any, seed: int, tmp: Path) -> dict[str, Any]:
    spec = {"dataset": args.dataset_name, "root": args.dataset_root, "clients": args.clients,
            "per_round": args.per_round, "rounds": args.rounds, "steps": args.steps, "batch": BATCH, "lr": LR,
            "seed": seed, "out": str(tmp / f"flower-{seed}.json"), "t_start": time.time()}
    spec_file = tmp / f"flower-{seed}.spec.json"
    spec_file.write_text(json.dumps(spec))
    t0 = time.monotonic()
    proc = subprocess.run([args.flower_python, __file__, "--flower-worker", str(spec_file)], cwd=common.REPO_ROOT,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(common.REPO_ROOT), "RAY_DEDUP_LOGS": "0"})
    wall = time.monotonic() - t0
    if proc.returncode != 0 or not Path(spec["out"]).exists():
        raise RuntimeError(f"the Flower run exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    curve = [c for c in json.loads(Path(spec["out"]).read_text())["curve"] if c["round"] >= 1]
    return {"wall_s": wall, "curve": [{"round": c["round"], "accuracy": c["accuracy"]} for c in curve],
            "final_accuracy": curve[-1]["accuracy"]}


def flower_version(python: str) -> Optional[str]:
    proc = subprocess.run([python, "-c", "import flwr, ray; print(flwr.__version__, ray.__version__)"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


# =========================================================================== main


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--flower-python", required=True,
                   help="the interpreter of a virtual environment with flwr[simulation] (see above)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per mode (default 2)")
    p.add_argument("--steps", type=int, default=20, help="local SGD steps per drawn client and round (default 20)")
    args = p.parse_args(argv)
    args.clients, args.per_round, args.rounds = CLIENTS, PER_ROUND, ROUNDS
    if args.quick:
        args.clients, args.per_round, args.rounds, args.steps, args.seeds = 4, 2, 2, 2, 1
    versions = flower_version(args.flower_python)
    if versions is None:
        raise SystemExit(f"--flower-python {args.flower_python}: cannot import flwr and ray there "
                         f"(pip install 'flwr[simulation]' in that environment)")
    ds = common.load_data(args.data)
    args.dataset_name = ds.name
    given = Path(args.data).expanduser()
    args.dataset_root = str(given.resolve()) if given.exists() else None

    modes: dict[str, list[dict[str, Any]]] = {"flower": [], "sfl-coord simulate": [],
                                              "sfl-coord simulate, eval_every 5": []}
    with tempfile.TemporaryDirectory(prefix="sfl-bench-flower-") as tmp_s:
        tmp = Path(tmp_s)
        for seed in range(args.seed, args.seed + args.seeds):
            for mode in modes:
                print(f"seed {seed}: {mode} ...", flush=True)
                if mode == "flower":
                    res = run_flower(args, seed, tmp)
                else:
                    res = run_product(args, seed, 5 if "eval_every" in mode else 1, tmp)
                res["seed"] = seed
                modes[mode].append(res)
                print(f"  {res['wall_s']:.1f} s, final accuracy {res['final_accuracy']:.4f}", flush=True)
    flower_wall = statistics.mean(r["wall_s"] for r in modes["flower"])
    summary = []
    for mode, runs in modes.items():
        wall = statistics.mean(r["wall_s"] for r in runs)
        summary.append({
            "mode": mode, "wall_s": wall, "wall_s_sd": statistics.stdev([r["wall_s"] for r in runs]) if len(runs) > 1
            else 0.0, "vs_flower": wall / flower_wall,
            "final_accuracy": statistics.mean(r["final_accuracy"] for r in runs),
            "eval_s": statistics.mean(r["eval_s"] for r in runs) if "eval_s" in runs[0] else None,
        })
    common.print_table(
        f"the same FedAvg job ({ds.name}, {args.clients} clients, {args.per_round} per round, {args.rounds} rounds, "
        f"small_cnn, {args.steps} steps of batch {BATCH}) — whole-process wall time, {args.seeds} seed(s)",
        ["mode", "wall s", "± sd", "× Flower's", "final accuracy", "of which evaluation s"],
        [[s["mode"], s["wall_s"], s["wall_s_sd"], s["vs_flower"], s["final_accuracy"],
          "-" if s["eval_s"] is None else s["eval_s"]] for s in summary],
        caption=f"flwr and ray: {versions}; {os.cpu_count()} cores")
    per_round = [[r, *(statistics.mean(run["curve"][r - 1]["accuracy"] for run in modes[m]
                                        if run["curve"][r - 1]["accuracy"] is not None)
                       if any(run["curve"][r - 1]["accuracy"] is not None for run in modes[m]) else "-"
                       for m in ("flower", "sfl-coord simulate"))]
                 for r in range(1, args.rounds + 1)]
    common.print_table("accuracy per round (mean over seeds)", ["round", "flower", "sfl-coord simulate"], per_round)
    doc = {"quick": args.quick, "flower_ray": versions, "config": common.config_record(args),
           "summary": summary, "runs": modes,
           "reference": "Flower's simulation of the same job on this machine, same data shards and model"}
    path = common.write_result(args.out, "flower", doc)
    print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--flower-worker":
        sys.exit(flower_worker(sys.argv[2]))
    main()
