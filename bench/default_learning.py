"""Does the default learn as well as a hand-made recipe? ``strategy: auto`` deciding the training
options (docs/methods/auto.md, "Training options") against the same run with them all off
(the default before it decided them) and with the recipe switched on by hand.

The user's question: "I write no learning switch. On my fleet, do I end where the best recipe
would have taken me, and as soon?" Rows, on the same config and seeds:

- **default**: ``strategy: auto``, every option left to it;
- **options off**: the same with ``drift: none``, ``server_opt: none``, ``norm_stats: averaged``,
  ``model_ema: 0``, ``server_mode: merged`` and every candidate cut (``auto.candidates``: the
  model's), which is what the default did before it decided them;
- **hand recipe**: the same with the four switched on by hand (``drift: scaffold``, FedAvgM
  ``server_opt: {kind: momentum, lr: 1, beta1: 0.5}``, ``norm_stats: federated``, ``model_ema: 0.8``)
  on the merged server copy and every candidate cut.

Fleets: the demo's (4 devices, digits, Dirichlet 0.5, 8 rounds), the same on IID shards (the
default must not cost accuracy or time where the labels are alike), and a 40-device
label-skewed fleet of boards (Jetson Nano/TX2/Xavier NX, Raspberry Pi 4; MNIST or Fashion-MNIST,
Dirichlet 0.3, 8 devices a round, ``vgg_mini``, 15 rounds). Reported per fleet and row: final
accuracy (mean and worst seed), the virtual time to the fleet's target (90 % of the best row's
mean final accuracy) and for the whole run, and what the default decided.

    python bench/default_learning.py                   # full: 4 seeds on the demo fleets, 2 on the boards
    python bench/default_learning.py --quick           # smoke test
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import common  # noqa: E402  (puts the repo root on sys.path)

from sfl_core.config.run import default_profiles_dir, load_run_config, run_config_from_dict  # noqa: E402
from sfl_core.config.run import run_config_to_dict  # noqa: E402
from sfl_core.model.zoo import candidate_splits  # noqa: E402

OFF = {"drift": "none", "server_opt": "none", "norm_stats": "averaged", "model_ema": 0, "server_mode": "merged"}
RECIPE = {"drift": "scaffold", "server_opt": {"kind": "momentum", "lr": 1.0, "beta1": 0.5},
          "norm_stats": "federated", "model_ema": 0.8, "server_mode": "merged"}
ROWS = {"default": {}, "options off": OFF, "hand recipe": RECIPE}
BOARDS = [{"profile": "jetson-nano", "count": 10}, {"profile": "jetson-tx2", "count": 10},
          {"profile": "jetson-xavier-nx", "count": 10}, {"profile": "rpi4", "count": 10}]


def fleets(args: Any) -> dict[str, dict[str, Any]]:
    demo = run_config_to_dict(load_run_config(default_profiles_dir() / "runs" / "demo.yaml"))
    demo.pop("output_dir", None)
    out = {"demo": demo, "demo, IID": {**demo, "data": {**demo["data"], "partition": "iid"}}}
    if not args.no_boards:
        out["40 boards, Dirichlet 0.3"] = {
            "run": "boards", "model": "vgg_mini", "fleet": BOARDS, "rounds": args.board_rounds, "per_round": 8,
            "data": {"dataset": "mnist" if "mnist" in args.data and "fashion" not in args.data else "fashion-mnist",
                     "root": args.data, "partition": "dirichlet", "alpha": 0.3},
            "batch_size": 32, "lr": 0.05, "momentum": 0.5, "local_iters": 10, "eval_samples": 2000}
    if args.quick:
        out = {k: {**v, "rounds": 2, "local_iters": 2, "eval_samples": 200} for k, v in out.items()}
    return out


def run_row(base: dict[str, Any], extra: dict[str, Any], seed: int, work: Path) -> dict[str, Any]:
    from simulation import run_simulation

    if extra:   # the hand-set rows plan over every candidate cut, as the default did before it chose the depth
        extra = {**extra, "auto": {**base.get("auto", {}), "candidates": list(candidate_splits(base["model"]))}}
    cfg = run_config_from_dict({**base, **extra, "seed": seed,
                                "data": {**base["data"], "seed": seed},
                                "output_dir": str(work / f"s{seed}-{abs(hash(str(sorted(extra.items()))))}")})
    history, _ = run_simulation(cfg, device="cpu", quiet=True)
    return {"curve": [{k: r.get(k) for k in ("round", "accuracy", "elapsed_s")} for r in history],
            "learning": history[-1].get("learning")}


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    return next((r["elapsed_s"] for r in curve if r["accuracy"] is not None and r["accuracy"] >= target), None)


def main() -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--seeds", type=int, default=4, help="seeds of the demo fleets")
    p.add_argument("--board-seeds", type=int, default=2, help="seeds of the 40-board fleet")
    p.add_argument("--board-rounds", type=int, default=15)
    p.add_argument("--no-boards", action="store_true", help="leave out the 40-board fleet")
    args = p.parse_args()
    common.apply_threads(args)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, base in fleets(args).items():
            seeds = range(args.seed, args.seed + (1 if args.quick else
                                                  args.board_seeds if "boards" in name else args.seeds))
            results[name] = {row: [run_row(base, extra, s, Path(tmp) / name.replace(" ", "_") / row.replace(" ", "_"))
                                   for s in seeds] for row, extra in ROWS.items()}
            for row, runs in results[name].items():
                finals = [r["curve"][-1]["accuracy"] for r in runs]
                print(f"{name} / {row}: final {[round(f, 4) for f in finals]}", flush=True)
    table, summary = [], {}
    for name, rows in results.items():
        means = {row: statistics.mean(r["curve"][-1]["accuracy"] for r in runs) for row, runs in rows.items()}
        target = 0.9 * max(means.values())
        for row, runs in rows.items():
            finals = [r["curve"][-1]["accuracy"] for r in runs]
            times = [time_to(r["curve"], target) for r in runs]
            reached = [t for t in times if t is not None]
            summary.setdefault(name, {})[row] = {
                "final_mean": means[row], "final_worst": min(finals), "target": target,
                "time_to_target_s": statistics.mean(reached) if len(reached) == len(times) else None,
                "reached": f"{len(reached)}/{len(times)}",
                "virtual_s": statistics.mean(r["curve"][-1]["elapsed_s"] for r in runs),
                "decided": runs[0]["learning"] if row == "default" else None}
            s = summary[name][row]
            table.append([name, row, 100 * s["final_mean"], 100 * s["final_worst"],
                          s["time_to_target_s"] if s["time_to_target_s"] is not None else f"{s['reached']} seeds",
                          s["virtual_s"]])
    common.print_table("The default against the options off and the hand recipe (virtual clock)",
                       ["fleet", "row", "final % (mean)", "final % (worst seed)", "s to target", "virtual s"], table,
                       caption="target: 90 % of the fleet's best row (mean final accuracy)")
    for name, rows in summary.items():
        print(f"{name}: the default decided {rows['default']['decided']}")
    path = common.write_result(args.out, "default-learning-quick" if args.quick else "default-learning",
                               {"config": common.config_record(args), "summary": summary, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
