"""MergeSFL and FedFC in the virtual-clock simulation (docs/methods/mergesfl.md and fedfc.md; MergeSFL and FedFC papers).

    python bench/mergesfl.py --jobs 2                  # full (~20 min on 2 cores)
    python bench/mergesfl.py --quick                   # smoke test (numbers not meaningful)

MergeSFL part: 20 agents of 9 device profiles whose compute differs 56x and links 8x
(Jetson Nano/TX2/Xavier NX/AGX Xavier, Raspberry Pi 4, S2FL classes), 10 per round,
``small_cnn`` at split 2 on Fashion-MNIST (``--data``), IID and Dirichlet a = 0.1 (the
paper's non-IID level p = 10). Methods:

- ``FedAvg``: whole model on the agents;
- ``SFL``: vanilla split learning, one server copy per agent (SplitFed v1), fixed batch;
- ``SFL+FM``: feature merging only (one merged server batch per step);
- ``SFL+BR``: batch regulation only (Eq. 9, lr scaled, batch-weighted aggregation);
- ``MergeSFL``: merging + regulation + KL worker selection under the ingress budget.

FedFC part: ``vgg_mini`` (the deepest zoo model that fits this bench on 2 CPU cores; four
cut layers), class-imbalance shards (docs/methods/data-heterogeneity.md), one merged server pass; a single split (3)
against mixed cut layers by device (the slowest cut after conv1, then conv2, the default
conv3, the fastest after conv4).

Reported: final accuracy (mean of the last 3 evaluated rounds, mean ± std over seeds),
virtual time to a target every method reaches, average waiting time per round, total
traffic; accuracy-against-virtual-time plots; GA run time for 100 and 1,000 agents.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import common  # noqa: E402  (puts the repo root on sys.path)

import numpy as np  # noqa: E402
import torch  # noqa: E402

FLEET = [("jetson-nano", 3), ("jetson-tx2", 2), ("jetson-xavier-nx", 2), ("jetson-agx-xavier", 2), ("rpi4", 3),
         ("s2fl-low-low", 2), ("s2fl-mid-mid", 2), ("s2fl-high-high", 2), ("s2fl-low-high", 2)]
SETTINGS = {"IID": ("iid", 0.5), "a=0.1": ("dirichlet", 0.1)}
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"strategy": "fedavg"},
    "SFL": {"server_mode": "per_agent"},
    "SFL+FM": {"server_mode": "merged"},
    "SFL+BR": {"server_mode": "per_agent", "mergesfl": {"regulate": True}},
    "MergeSFL": {"server_mode": "merged", "mergesfl": {"regulate": True, "select": True}},
}
FEDFC = {   # vgg_mini: five blocks, so four cut layers (after conv1 .. conv4), like FedFC's 2/4/7/10 on VGG-16
    "single split": {"split": 3},
    "mixed cuts": {"split": 3, "profile_splits": {"rpi4": 1, "s2fl-low-low": 1, "jetson-nano": 2, "s2fl-low-high": 2,
                                                  "jetson-xavier-nx": 4, "jetson-agx-xavier": 4}},
}


def config(part: str, method: str, setting: str, seed: int, args: Any) -> dict[str, Any]:
    scheme, alpha = ("class-imbalance", 0.5) if part == "fedfc" else SETTINGS[setting]
    over = dict(FEDFC[method] if part == "fedfc" else METHODS[method])
    merge = over.pop("mergesfl", None)
    cfg = {
        "run": "bench-mergesfl", "model": "vgg_mini" if part == "fedfc" else "small_cnn", "split": 2,
        "strategy": "sfl", "server_mode": "merged",
        "data": {"dataset": args.dataset, "root": args.root, "partition": scheme, "alpha": alpha, "seed": seed},
        "fleet": [{"profile": p, "count": c} for p, c in FLEET], "rounds": args.rounds, "per_round": args.per_round,
        "batch_size": args.batch, "lr": args.lr, "momentum": args.momentum, "local_iters": args.tau, "seed": seed,
        "eval_samples": args.eval_samples, "zstd_level": 1,
        "output_dir": str(args.work / f"{part}-{setting}-{method.replace(' ', '_').replace('+', 'p')}-s{seed}"),
        **over,
    }
    if merge:
        cfg["mergesfl"] = {**merge, "max_batch": 2 * args.batch}
    if cfg["strategy"] == "fedavg":
        cfg.pop("split")
    return cfg


def run_one(job: tuple[str, str, str, int, Any]) -> dict[str, Any]:
    part, method, setting, seed, args = job
    torch.set_num_threads(args.threads or 1)
    from simulation import run_simulation
    from sfl_core.config.run import run_config_from_dict
    t0 = time.time()
    history, _ = run_simulation(run_config_from_dict(config(part, method, setting, seed, args)), device="cpu", quiet=True)
    curve = [{k: r[k] for k in ("round", "accuracy", "elapsed_s", "waiting_s", "bytes_up", "bytes_down")}
             for r in history]
    print(f"{part:>8} {setting:>6} {method:>12} seed {seed}: acc {history[-1]['accuracy']:.4f} "
          f"virtual {history[-1]['elapsed_s']:.0f} s  ({time.time() - t0:.0f} s wall)", flush=True)
    return {"part": part, "method": method, "setting": setting, "seed": seed, "curve": curve}


def summarise(by_method: dict[str, list[list[dict[str, Any]]]], reference: str) -> dict[str, Any]:
    finals = {m: [statistics.mean(r["accuracy"] for r in run[-3:]) for run in runs] for m, runs in by_method.items()}
    best = {m: max(statistics.mean(run[i]["accuracy"] for run in runs) for i in range(min(map(len, runs))))
            for m, runs in by_method.items()}
    target = 0.95 * min(best.values())

    def time_to(run: list[dict[str, Any]]) -> float | None:
        return next((r["elapsed_s"] for r in run if r["accuracy"] >= target), None)
    out: dict[str, Any] = {"target_accuracy": target, "methods": {}}
    for m, runs in by_method.items():
        tta = [time_to(run) for run in runs]
        out["methods"][m] = {
            "final_accuracy_mean": statistics.mean(finals[m]),
            "final_accuracy_std": statistics.pstdev(finals[m]) if len(finals[m]) > 1 else 0.0,
            "time_to_target_mean_s": statistics.mean(tta) if all(t is not None for t in tta) else None,
            "waiting_s_per_round": statistics.mean(r["waiting_s"] for run in runs for r in run[1:]),
            "traffic_bytes": statistics.mean(sum(r["bytes_up"] + r["bytes_down"] for r in run) for run in runs),
        }
    ref = out["methods"].get(reference, {}).get("time_to_target_mean_s")
    for v in out["methods"].values():
        t = v["time_to_target_mean_s"]
        v[f"speedup_vs_{reference}"] = ref / t if ref and t else None
    return out


def ga_timing(seed: int = 0) -> list[dict[str, Any]]:
    """Wall time of the GA worker selection (default settings) for 100 and 1,000 agents."""
    from sfl_core.methods.mergesfl import control as mergesfl
    rng = np.random.default_rng(seed)
    rows = []
    for n in (100, 1000):
        dists = {f"a{i}": rng.dirichlet([0.1] * 10) * 600 for i in range(n)}
        batches = {a: int(rng.integers(4, 33)) for a in dists}
        budget = 0.1 * sum(batches.values()) * 25_088
        t0 = time.perf_counter()
        sel = mergesfl.select_workers(dists, batches, 25_088, budget, {a: 0 for a in dists}, seed=seed)
        rows.append({"agents": n, "seconds": time.perf_counter() - t0, "selected": len(sel.agents),
                     "kl": sel.kl, "generations": sel.generations})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--tau", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--eval-samples", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--work", type=Path, default=Path("/tmp/sfl-bench-mergesfl"))
    p.add_argument("--parts", nargs="*", default=["mergesfl", "fedfc"], choices=["mergesfl", "fedfc"])
    p.add_argument("--tag", default="", help="suffix of the result file (for parts run separately)")
    args = p.parse_args(argv)
    settings, methods, fedfc = list(SETTINGS), list(METHODS), list(FEDFC)
    if args.quick:
        args.rounds, args.tau, args.batch, args.seeds, args.eval_samples = 2, 2, 8, 1, 200
        settings = ["a=0.1"]
    args.dataset, args.root = ("fashion-mnist", args.data) if Path(args.data).is_dir() else (args.data, None)
    jobs = [("mergesfl", m, s, seed, args) for s in settings for m in methods for seed in range(args.seeds)
            if "mergesfl" in args.parts]
    jobs += [("fedfc", m, "class-imbalance", seed, args) for m in fedfc for seed in range(args.seeds)
             if "fedfc" in args.parts]
    t_start = time.time()
    results = common.run_jobs(run_one, jobs, args)
    curves: dict[str, dict[str, list[list[dict[str, Any]]]]] = {}
    for res in results:
        key = res["setting"] if res["part"] == "mergesfl" else "FedFC class-imbalance"
        curves.setdefault(key, {}).setdefault(res["method"], []).append(res["curve"])
    summary = {k: summarise(v, "FedAvg" if "FedAvg" in v else "single split") for k, v in curves.items()}
    rows = []
    for k, s in summary.items():
        for m, v in s["methods"].items():
            speed = v.get("speedup_vs_FedAvg", v.get("speedup_vs_single split"))
            rows.append([k, m, f"{100 * v['final_accuracy_mean']:.2f} ± {100 * v['final_accuracy_std']:.2f}",
                         f"{100 * s['target_accuracy']:.1f}", common.fmt(v["time_to_target_mean_s"]), common.fmt(speed),
                         f"{v['waiting_s_per_round']:.1f}", f"{v['traffic_bytes'] / 1e6:.0f}"])
    common.print_table("MergeSFL / FedFC (virtual clock)",
                       ["setting", "method", "acc %", "target %", "t@target s", "speed-up", "wait s/round", "MB"],
                       rows, caption=f"20 agents, {args.per_round}/round, small_cnn (FedFC: vgg_mini), {args.rounds} rounds, tau {args.tau}, "
                                     f"batch {args.batch} (MergeSFL max {2 * args.batch}), {args.seeds} seed(s); "
                                     f"wall {time.time() - t_start:.0f} s")
    ga = ga_timing()
    common.print_table("GA worker selection", ["agents", "seconds", "selected", "KL", "generations"],
                       [[r["agents"], f"{r['seconds']:.3f}", r["selected"], f"{r['kl']:.4f}", r["generations"]] for r in ga])

    payload = {"benchmark": "mergesfl", "config": common.config_record(args),
               "fleet": FLEET, "summary": summary, "ga_timing": ga, "curves": curves}
    name = ("mergesfl-quick" if args.quick else "mergesfl") + (f"-{args.tag}" if args.tag else "")
    path = common.write_result(args.out, name, payload, torch.device("cpu"))
    common.plot_accuracy_vs_time(curves, args.out / f"{name}.png")
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
