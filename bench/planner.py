"""How fast ``strategy: auto`` plans, and how right its predictions are.

    python bench/planner.py              # planning time (100, 1,000 agents) + prediction error
    python bench/planner.py --quick      # smoke test

1. **Planning time**: one round's whole plan — pricing every (split, codec) option of every
   selected agent with the time model, the deadline bisection, the label-mix bound (and, in a
   second column, choosing a tenth of the fleet by label mix first) — for
   fleets of 100 and 1,000 agents whose compute spans 50x, links 16x, with memory limits on
   a third of them (VGG-16 at CIFAR size: every candidate cut x every allowed codec). The budget:
   < 1 s for 100, < 10 s for 1,000.
2. **Prediction error** (predicted / measured round time - 1, per round after the first):
   in simulation against the virtual clock, and over MQTT with emulated agent processes
   (``sfl-coord demo``: embedded broker, one ``sfl-agent start --emulate`` per device) against
   the wall clock: the round's training phase as the coordinator timed it (assignments out to
   the last weights in), its own per-message work and the lock-step waits included, which the
   planner learns as ``agent_step_overhead_s`` and step jitter. Median and 90th percentile of
   |error|.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import common  # noqa: E402  (puts the repo root on sys.path)

from sfl_core.model.accounting import model_costs  # noqa: E402
from sfl_core.config.run import DeviceProfile, load_run_config, run_config_from_dict  # noqa: E402
from sfl_core.fleet import AgentInfo  # noqa: E402
from sfl_core.methods import build_method  # noqa: E402
from sfl_core.model.zoo import build_model  # noqa: E402


def synthetic_fleet(n: int, seed: int) -> dict[str, AgentInfo]:
    rng = np.random.default_rng(seed)
    agents = {}
    for i in range(n):
        compute = float(10 ** rng.uniform(9, 9 + np.log10(50)))      # 1e9 .. 5e10 FLOP/s
        link = float(10 ** rng.uniform(5, 5 + np.log10(16)))         # 0.1 .. 1.6 MB/s
        memory = float(rng.uniform(5e7, 2e8)) if i % 3 == 0 else None
        counts = rng.multinomial(500, rng.dirichlet([0.1] * 10)).tolist()
        profile = DeviceProfile(f"dev{i}", compute_flops=compute, link_bytes_per_s=link, memory_bytes=memory)
        agents[f"a{i:04d}"] = AgentInfo(f"a{i:04d}", i, profile, {}, counts, int(sum(counts)))
    return agents


def planning_time(n: int, repeats: int) -> dict[str, float]:
    cfg = run_config_from_dict({"run": "plan", "model": "vgg16", "strategy": "auto", "min_agents": n,
                                "batch_size": 32, "local_iters": 10, "data": {"image_size": 32},
                                "auto": {"selection": "kl"}})
    shape = (3, 32, 32)
    model = build_model(cfg.model, shape, 10)
    method = build_method(cfg, model, model_costs(cfg.model, shape, 10))
    agents = synthetic_fleet(n, seed=n)
    ids = sorted(agents)
    seconds = common.median_seconds(lambda: method.select(2, ids, agents, ids), repeats=repeats)
    plan = method.current
    # a tenth of them chosen by label mix first (auto.selection: kl), then planned
    tenth = ids[: n // 10]
    select_s = common.median_seconds(lambda: method.select(2, ids, agents, tenth), repeats=repeats)
    return {"agents": n, "options_per_agent": len(method.choices()), "plan_s": seconds,
            "select_tenth_and_plan_s": select_s, "left_out_for_memory": len(plan.infeasible) if plan else 0}


def _errors(history: list[dict]) -> list[float]:
    return [abs(r["auto"]["error"]) for r in history if r.get("auto", {}).get("error") is not None][1:]


def _summary(errors: list[float]) -> dict[str, float | int | None]:
    if not errors:
        return {"rounds": 0, "median": None, "p90": None}
    return {"rounds": len(errors), "median": float(np.median(errors)), "p90": float(np.quantile(errors, 0.9))}


def prediction_error(config: Path, rounds: int, mqtt: bool) -> dict[str, dict]:
    from simulation import run_simulation

    cfg = dataclasses.replace(load_run_config(config), rounds=rounds, strategy="auto")
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        history, _ = run_simulation(dataclasses.replace(cfg, output_dir=str(Path(tmp) / "sim")), quiet=True)
        out["virtual clock"] = _summary(_errors(history))
        if mqtt:
            run_cfg = Path(tmp) / "auto.yaml"
            text = config.read_text()
            run_cfg.write_text(text.replace("strategy: sfl", "strategy: auto"))
            subprocess.run([sys.executable, "-m", "cli.coord", "demo", "-c", str(run_cfg), "--rounds", str(rounds),
                            "--output", str(Path(tmp) / "mqtt")], check=True, cwd=common.REPO_ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
            lines = (Path(tmp) / "mqtt" / "metrics.jsonl").read_text().splitlines()
            out["wall clock (MQTT, --emulate)"] = _summary(_errors([json.loads(x) for x in lines]))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__)
    p.add_argument("--config", type=Path, default=common.REPO_ROOT / "profiles" / "runs" / "demo.yaml",
                   help="run config for the prediction error (its fleet; strategy set to auto)")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--no-mqtt", action="store_true", help="skip the MQTT run")
    args = p.parse_args(argv)
    common.apply_threads(args)
    sizes = [20] if args.quick else [100, 1000]
    timing = [planning_time(n, repeats=2 if args.quick else 5) for n in sizes]
    common.print_table("auto: one round's plan", ["agents", "options per agent", "plan all s",
                                                  "select a tenth + plan s", "left out (memory)"],
                       [[t["agents"], t["options_per_agent"], t["plan_s"], t["select_tenth_and_plan_s"],
                         t["left_out_for_memory"]] for t in timing])
    t0 = time.monotonic()
    errors = prediction_error(args.config, 2 if args.quick else args.rounds, mqtt=not args.no_mqtt and not args.quick)
    common.print_table("auto: |predicted / measured round time - 1|", ["clock", "rounds", "median", "p90"],
                       [[k, v["rounds"], v["median"], v["p90"]] for k, v in errors.items()],
                       caption=f"{args.config.name}, {time.monotonic() - t0:.0f} s")
    doc = {"config": common.config_record(args),
           "reference": "planning budget 1 s for 100 agents, 10 s for 1,000; error = predicted / measured - 1",
           "results": {"planning_time": timing, "prediction_error": errors}}
    path = common.write_result(args.out, "planner", doc)
    print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
