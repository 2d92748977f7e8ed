"""S2FL comparison in the virtual-clock simulation (docs/methods/s2fl.md; S2FL paper, Yan et al. 2023).

    python bench/s2fl.py --device auto                 # full: 3 settings x 5 methods x 2 seeds
    python bench/s2fl.py --quick                       # smoke test (numbers not meaningful)

Setting: 100 agents of the 9 S2FL device classes in equal shares (profiles
``s2fl-{low,mid,high}-{low,mid,high}``), 10 selected per round, ResNet-8 on Fashion-MNIST
(``--data``; CIFAR-10 is not available offline here), label skew Dirichlet a in {0.1, 0.5}
and IID. Methods:

- ``FedAvg``: the whole model on the agents;
- ``SFL``: vanilla split learning as S2FL's baseline = S2FL+R: the largest candidate split
  for every agent, one server copy per agent (SplitFed v1);
- ``S2FL+B``: data-balance groups, fixed (largest) split;
- ``S2FL+M``: sliding split from the client time table, one server copy per agent;
- ``S2FL+MB``: both.

Everything runs through the product's engine (``simulation.run_simulation``): real
training on real data, virtual time from the time model (docs/methods/time-model.md) with each agent's profile and its real
encoded bytes. Reported per method and setting: final accuracy (mean of the last 3
evaluated rounds, mean +- std over seeds), virtual time to a target accuracy that every
method reaches (the smallest over methods of their best seed-mean accuracy, times 0.95),
and a PNG of accuracy against virtual time. Columns: ``acc`` final accuracy %, ``t@target``
virtual seconds to the target (mean over seeds), ``speedup`` SFL's t@target / the method's.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import common  # noqa: E402  (puts the repo root on sys.path)

from sfl_core.config.run import run_config_from_dict  # noqa: E402

CLASSES = [f"s2fl-{c}-{r}" for c in ("low", "mid", "high") for r in ("low", "mid", "high")]
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"strategy": "fedavg"},
    "SFL": {"strategy": "s2fl", "s2fl": {"sliding": False, "balance": False}},
    "S2FL+B": {"strategy": "s2fl", "s2fl": {"sliding": False, "balance": True}},
    "S2FL+M": {"strategy": "s2fl", "s2fl": {"sliding": True, "balance": False}},
    "S2FL+MB": {"strategy": "s2fl", "s2fl": {"sliding": True, "balance": True}},
}
SETTINGS = {"a=0.1": ("dirichlet", 0.1), "a=0.5": ("dirichlet", 0.5), "IID": ("iid", 0.5)}


def fleet(n: int) -> list[dict[str, Any]]:
    base, extra = divmod(n, len(CLASSES))
    return [{"profile": p, "count": base + (1 if i < extra else 0)} for i, p in enumerate(CLASSES)
            if base + (1 if i < extra else 0)]


def config(method: str, setting: str, seed: int, args: Any, out: Path) -> dict[str, Any]:
    scheme, alpha = SETTINGS[setting]
    m = METHODS[method]
    cfg = {
        "run": "bench-s2fl", "model": args.model,
        "data": {"dataset": args.dataset, "root": args.root, "partition": scheme, "alpha": alpha, "seed": seed},
        "fleet": fleet(args.agents), "rounds": args.rounds, "per_round": args.per_round,
        "batch_size": args.batch, "lr": args.lr, "momentum": args.momentum, "local_iters": args.tau,
        "seed": seed, "eval_samples": args.eval_samples, "codec": "fp32", "zstd_level": args.zstd_level,
        "output_dir": str(out / f"{setting}-{method}-s{seed}"), "strategy": m["strategy"],
    }
    if "s2fl" in m:
        cfg["s2fl"] = {**m["s2fl"], "group_size": args.group_size}
    return cfg


def time_to(history: list[dict[str, Any]], target: float) -> float | None:
    for rec in history:
        if rec["accuracy"] >= target:
            return rec["elapsed_s"]
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default="resnet8")
    p.add_argument("--agents", type=int, default=100)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--tau", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--group-size", type=int, default=5)
    p.add_argument("--eval-samples", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--zstd-level", type=int, default=1, help="wire compression of the simulated messages")
    p.add_argument("--work", type=Path, default=Path("/tmp/sfl-bench-s2fl"), help="run directories")
    p.add_argument("--tag", default="", help="suffix of the result file (for runs split over processes)")
    p.add_argument("--merge", nargs="*", type=Path, default=None,
                   help="instead of running, combine the curves of these result files into one report")
    p.add_argument("--from-runs", type=Path, default=None,
                   help="instead of running, rebuild the report from run directories under this folder "
                        "(each <setting>-<method>-s<seed>/metrics.jsonl, as --work leaves them)")
    p.add_argument("--note", default="", help="free text stored in the result (e.g. where the runs ran)")
    args = p.parse_args(argv)
    if args.quick:
        args.agents, args.per_round, args.rounds, args.tau, args.batch = 9, 3, 4, 2, 8
        args.seeds, args.settings, args.eval_samples, args.model = 1, ["a=0.5"], 200, "small_cnn"
    common.apply_threads(args)
    spec = args.data
    if Path(spec).is_dir():
        args.dataset, args.root = "fashion-mnist", spec
    else:
        args.dataset, args.root = spec, None
    curves: dict[str, dict[str, list[list[dict[str, Any]]]]] = {}
    t_start = time.time()
    if args.merge:
        for f in args.merge:
            part = json.loads(f.read_text())
            for setting, by_method in part["curves"].items():
                curves.setdefault(setting, {}).update(by_method)
            args.settings = []
        curves = {s: {m: curves[s][m] for m in METHODS if m in curves[s]} for s in SETTINGS if s in curves}
    if args.from_runs:
        args.settings = []
        found: dict[str, dict[str, dict[int, list[dict[str, Any]]]]] = {}
        for f in sorted(args.from_runs.glob("**/metrics.jsonl")):
            setting, method, seed = f.parent.name.rsplit("-", 2)[0], f.parent.name.rsplit("-", 2)[1], f.parent.name.rsplit("-", 2)[2]
            recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            found.setdefault(setting, {}).setdefault(method, {})[int(seed[1:])] = [
                {k: r[k] for k in common.CURVE_KEYS} for r in recs]
        curves = {s: {m: [found[s][m][k] for k in sorted(found[s][m])] for m in METHODS if m in found[s]}
                  for s in SETTINGS if s in found}
    for setting in args.settings:
        curves[setting] = {}
        for method in args.methods:
            curves[setting][method] = common.simulate_seeds(
                f"{setting:>6} {method:>8}",
                lambda seed: run_config_from_dict(config(method, setting, seed, args, args.work)),
                args.seeds, args.device)
    rows, summary = [], {}
    for setting, by_method in curves.items():
        if not by_method:
            continue
        finals = {m: [statistics.mean(r["accuracy"] for r in run[-3:]) for run in runs] for m, runs in by_method.items()}
        best = {m: max(statistics.mean(run[i]["accuracy"] for run in runs) for i in range(len(runs[0])))
                for m, runs in by_method.items()}
        target = 0.95 * min(best.values())
        tta = {m: [time_to(run, target) for run in runs] for m, runs in by_method.items()}
        mean_tta = {m: (statistics.mean(v) if all(x is not None for x in v) else None) for m, v in tta.items()}
        summary[setting] = {"target_accuracy": target, "methods": {}}
        for m in by_method:
            f = finals[m]
            ref = mean_tta.get("SFL")
            speed = (ref / mean_tta[m]) if ref and mean_tta[m] else None
            summary[setting]["methods"][m] = {"final_accuracy_mean": statistics.mean(f),
                                             "final_accuracy_std": statistics.pstdev(f) if len(f) > 1 else 0.0,
                                             "time_to_target_s": tta[m], "time_to_target_mean_s": mean_tta[m],
                                             "speedup_vs_sfl": speed,
                                             "virtual_time_total_s": statistics.mean(run[-1]["elapsed_s"] for run in by_method[m])}
            rows.append([setting, m, f"{100 * statistics.mean(f):.2f} ± {100 * (statistics.pstdev(f) if len(f) > 1 else 0):.2f}",
                         f"{100 * target:.1f}", common.fmt(mean_tta[m]), common.fmt(speed)])
    common.print_table("S2FL comparison (virtual clock)", ["setting", "method", "acc %", "target %", "t@target s",
                                                            "speedup vs SFL"], rows,
                       caption=f"{args.agents} agents, {args.per_round}/round, {args.model}, {args.rounds} rounds, "
                               f"tau {args.tau}, batch {args.batch}, {args.seeds} seed(s); wall {time.time() - t_start:.0f} s")
    payload = {"benchmark": "s2fl", "note": args.note, "config": common.config_record(args),
               "summary": summary, "curves": curves}
    name = ("s2fl-quick" if args.quick else "s2fl") + (f"-{args.tag}" if args.tag else "")
    from coordinator.server_trainer import pick_device
    path = common.write_result(args.out, name, payload, pick_device(args.device))
    common.plot_accuracy_vs_time(curves, args.out / f"{name}.png")
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
