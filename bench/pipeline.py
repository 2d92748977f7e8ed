"""Devices that never wait: steps in flight (``window``) against lock-step, by the virtual clock.

The user's question: "my devices spend most of each step waiting for the link. If they keep
a few steps in flight, how much sooner do I reach my accuracy, and what does the staleness
cost?" Rows, on the same config and seeds, the default ``strategy: auto`` planning cut, codec
and batch with each window priced by the time model (docs/methods/pipeline.md):
``window`` 1 (lock-step, the reference), 2, 4, 8 and ``auto`` (per device the smallest of 1, 2, 4
within 5 % of the fastest), and ``window 2, first cut``: window 2 with ``auto.candidates: [1]``
(a run with a bottleneck keeps the bottleneck's cut beside it), which tells the staleness's
cost apart from the cut's (a window makes a deeper cut's larger compute cheap next to its
smaller activations, and on label-skewed data a deeper client portion learns less).

Fleets: the demo's (4 devices, digits, Dirichlet 0.5) and the 40 boards of the shipped
profiles (Jetson Nano/TX2/Xavier NX, Raspberry Pi 4 on WiFi; MNIST, Dirichlet 0.3, 8 a round,
``vgg_mini``), as ``bench/default_learning.py`` builds them. Lock-step runs the fleet's rounds;
the other rows run :data:`LONGER` times as many and are read at lock-step's virtual time of
the same seed: a user who gives the run lock-step's time has that model. Reported per fleet
and row: accuracy at lock-step's time (mean and worst seed) and at lock-step's rounds (mean),
virtual seconds to the fleet's target (90 % of the lock-step row's mean final accuracy) and
its ratio to lock-step's, the planner's median error (predicted round against the clock's), the
device-rounds by window and by cut over every seed, and the device-rounds the defense flagged
(its false positives: every device of these fleets is honest).

    python bench/pipeline.py --seeds 2                  # both fleets, 2 seeds
    python bench/pipeline.py --quick                    # smoke test
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import common  # noqa: E402  (puts the repo root on sys.path)
from default_learning import fleets, time_to  # noqa: E402

from sfl_core.config.run import run_config_from_dict  # noqa: E402

ROWS: dict[str, dict[str, Any]] = {
    "window 1": {"window": 1}, "window 2": {"window": 2}, "window 4": {"window": 4}, "window 8": {"window": 8},
    "window auto": {"window": "auto"}, "window 2, first cut": {"window": 2, "auto": {"candidates": [1]}}}
LONGER = 2
"""How many times lock-step's rounds the other rows run: enough to reach lock-step's virtual
time where a window makes rounds up to twice as short."""


def run_row(base: dict[str, Any], extra: dict[str, Any], seed: int, work: Path, rounds: int) -> dict[str, Any]:
    from simulation import run_simulation

    auto = {**base.get("auto", {}), **extra.get("auto", {})}
    cfg = run_config_from_dict({**base, **extra, **({"auto": auto} if auto else {}), "rounds": rounds, "seed": seed,
                                "data": {**base["data"], "seed": seed},
                                "output_dir": str(work / f"{abs(hash(str(extra)))}-s{seed}")})
    history, _ = run_simulation(cfg, device="cpu", quiet=True)
    errors = [abs(r["auto"]["error"]) for r in history[1:] if r.get("auto", {}).get("error") is not None]
    split = [a for r in history[1:] for a in r["agents"].values() if not a["whole_model"]]
    windows = [a.get("window", 1) for a in split]
    cuts = [a["split"] for a in split]
    return {"curve": [{**{k: r.get(k) for k in ("round", "accuracy", "elapsed_s")}, "flagged": common.flagged(r)}
                      for r in history],
            "plan_error": statistics.median(errors) if errors else None,
            "windows": {w: windows.count(w) for w in sorted(set(windows))},
            "cuts": {c: cuts.count(c) for c in sorted(set(cuts))}}


def main() -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--board-rounds", type=int, default=15)
    p.add_argument("--no-boards", action="store_true", help="leave out the 40-board fleet")
    p.add_argument("--only", nargs="*", default=None, help="fleets to run (default: all)")
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    args = p.parse_args()
    common.apply_threads(args)
    chosen = {k: v for k, v in fleets(args).items() if "IID" not in k and (not args.only or k in args.only)}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, base in chosen.items():
            seeds = range(args.seed, args.seed + (1 if args.quick else args.seeds))
            results[name] = {}
            for row in args.rows:
                rounds = base["rounds"] * (1 if row == "window 1" else LONGER)
                results[name][row] = [run_row(base, ROWS[row], s, Path(tmp) / name.replace(" ", "_"), rounds)
                                      for s in seeds]
                finals = [r["curve"][-1]["accuracy"] for r in results[name][row]]
                print(f"{name} / {row}: final {[round(f, 4) for f in finals]} after {rounds} rounds, virtual "
                      f"{[round(r['curve'][-1]['elapsed_s'], 1) for r in results[name][row]]} s", flush=True)
    table, summary = [], {}
    for name, rows in results.items():
        lockstep = rows.get("window 1") or next(iter(rows.values()))
        budgets = [r["curve"][-1]["elapsed_s"] for r in lockstep]   # lock-step's virtual time per seed
        rounds = lockstep[0]["curve"][-1]["round"]
        target = 0.9 * statistics.mean(r["curve"][-1]["accuracy"] for r in lockstep)
        for row, runs in rows.items():
            finals = [common.at_time(r["curve"], t) for r, t in zip(runs, budgets)]
            times = [time_to(r["curve"], target) for r in runs]
            errors = [r["plan_error"] for r in runs if r["plan_error"] is not None]
            summary.setdefault(name, {})[row] = {
                "final_mean": statistics.mean(finals), "final_worst": min(finals), "target": target,
                "at_lockstep_rounds_mean": statistics.mean(r["curve"][rounds]["accuracy"] for r in runs),
                "rounds_run": runs[0]["curve"][-1]["round"],
                "time_to_target_s": statistics.mean(times) if None not in times else None,
                "time_to_target_worst_s": max(times) if None not in times else None,
                "reached": f"{sum(t is not None for t in times)}/{len(times)}",
                "virtual_s": statistics.mean(r["curve"][-1]["elapsed_s"] for r in runs),
                "plan_error_median": statistics.median(errors) if errors else None,
                "windows": common.tally(r["windows"] for r in runs), "cuts": common.tally(r["cuts"] for r in runs),
                "flagged_device_rounds": sum(len(x["flagged"]) for r in runs for x in r["curve"])}
        ref = summary[name].get("window 1", {}).get("time_to_target_s")
        for row, s in summary[name].items():
            s["speedup_to_target"] = ref / s["time_to_target_s"] if ref and s["time_to_target_s"] else None
            table.append([name, row, 100 * s["final_mean"], 100 * s["final_worst"], 100 * s["at_lockstep_rounds_mean"],
                          s["time_to_target_s"] if s["time_to_target_s"] is not None else f"{s['reached']} seeds",
                          s["speedup_to_target"] or "-", s["virtual_s"],
                          100 * s["plan_error_median"] if s["plan_error_median"] is not None else "-"])
    common.print_table("Steps in flight against lock-step (virtual clock, strategy auto)",
                       ["fleet", "row", "% at lock-step's time (mean)", "(worst)", "% at lock-step's rounds",
                        "s to target", "x sooner", "virtual s", "plan error %"], table,
                       caption="target: 90 % of lock-step's mean final accuracy; x sooner: lock-step's time to it "
                               "over the row's; virtual s: the row's whole run")
    path = common.write_result(args.out, "pipeline-quick" if args.quick else "pipeline",
                               {"config": common.config_record(args), "summary": summary, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
