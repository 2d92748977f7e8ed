"""Fleet simulation on Ray against the serial simulation: wall time for the same run.

    python bench/ray_sim.py                      # sim-100 (100 agents, ResNet-8, Fashion-MNIST), 4 rounds
    python bench/ray_sim.py --workers 1 2 16     # on a machine with 16 cores
    python bench/ray_sim.py --quick              # smoke test (digits, 8 agents)

The user's question: my simulations take hours. Does ``sfl-coord simulate --ray`` make them
shorter, and are the results still the same?

The run is ``profiles/runs/sim-100.yaml``: 100 agents of the nine S2FL device classes,
``--per-round`` of them per round (default 20), ResNet-8 on Fashion-MNIST. It runs once
serially (every agent in this process) and once on a local Ray per ``--workers`` count
(agents spread over that many actors, one core each). The server step and aggregation stay
in this process in every mode.

Per mode the bench records:

- the wall time of round 1 and of the later rounds (the engine's ``wall_s``; round 1 also
  pays every process's first torch calls), and the wall time including Ray's start and
  shipping the shards to the actors;
- whether every round's accuracy, loss, virtual time and bytes equal the serial run's.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import common  # noqa: E402  (puts the repo root on sys.path)

from simulation import run_simulation  # noqa: E402
from sfl_core.config.run import default_profiles_dir, load_run_config  # noqa: E402

_SAME = ("accuracy", "test_loss", "train_loss", "round_time_s", "bytes_up", "bytes_down", "selected")


def _config(args, out: Path):
    cfg = load_run_config(default_profiles_dir() / "runs" / "sim-100.yaml")
    given = Path(args.data).expanduser()
    data = dataclasses.replace(cfg.data, dataset=common.load_data(args.data).name,
                               root=str(given.resolve()) if given.exists() else None)
    changes = dict(rounds=args.rounds, per_round=args.per_round, output_dir=str(out), seed=args.seed,
                   eval_samples=2000, data=data)
    if args.quick:   # 8 agents of one class, the small CNN
        changes.update(model="small_cnn", fleet=[dataclasses.replace(cfg.fleet[0], count=8)], per_round=4,
                       local_iters=3)
    return dataclasses.replace(cfg, **changes)


def run_mode(args, label: str, workers: int | None, tmp: Path) -> tuple[dict, list[dict]]:
    cfg = _config(args, tmp / label.replace(" ", "-"))
    t0 = time.monotonic()
    history, _ = run_simulation(cfg, device="cpu", ray=None if workers is None else "local", ray_workers=workers)
    total = time.monotonic() - t0
    # round 1 also pays each process's first torch calls (an actor's first model, first backward)
    return {"mode": label, "workers": workers, "round1_wall_s": history[1]["wall_s"],
            "rounds_wall_s": sum(r["wall_s"] for r in history[2:]), "total_wall_s": total,
            "final_accuracy": history[-1]["accuracy"]}, history


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--per-round", type=int, default=20, help="agents selected per round (of 100)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="Ray actor counts to run")
    args = p.parse_args(argv)
    common.apply_threads(args)
    if args.quick:
        args.rounds, args.workers = 3, [2]
    rows, histories = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        modes = [("serial", None)] + [(f"ray {w}", w) for w in args.workers]
        for label, workers in modes:
            row, histories[label] = run_mode(args, label, workers, Path(tmp))
            rows.append(row)
    serial = histories["serial"]
    for row in rows:
        h = histories[row["mode"]]
        row["same_as_serial"] = len(h) == len(serial) and all(
            all(a.get(k) == b.get(k) for k in _SAME) for a, b in zip(h, serial))
        row["speedup_rounds"] = rows[0]["rounds_wall_s"] / row["rounds_wall_s"]
    common.print_table(
        "sim-100" + (" (quick: 4 of 8 agents)" if args.quick else f": {args.per_round} of 100 agents per round")
        + f", {args.rounds} rounds (wall seconds)",
        ["mode", "round 1 s", "rounds 2.. s", "total s (with start)", "speed-up (rounds 2..)", "same results",
         "final accuracy"],
        [[r["mode"], r["round1_wall_s"], r["rounds_wall_s"], r["total_wall_s"], r["speedup_rounds"],
          r["same_as_serial"], r["final_accuracy"]] for r in rows],
        caption="serial: every agent in this process; ray N: agents on N actors of a local Ray, one core each")
    payload = {"quick": args.quick, "config": common.config_record(args), "results": rows,
               "reference": "the serial simulation of the same config and seed (same process, no Ray)"}
    path = common.write_result(args.out, "ray_sim", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
