"""Devices that lie: each defense of ``robust:`` against each attack, by real training.

The user's question: "if some of my devices are compromised, which defense keeps my model, at
what cost on an honest fleet?" A fleet of 20 simulated devices at Dirichlet 0.1 (10 a round,
split learning with one merged server copy) trains with the attackers among them
(:mod:`simulation.adversary`): the first 10 % or 30 % of the fleet label-flipping, planting a
pixel-pattern backdoor, scaling their update x10 or x1000, sending NaN or random weights,
scaling and noising their activations, or claiming 1000x their samples. Per defense (no
defense at all, ``off``; then each ``robust.aggregate`` with the default weight cap and screens of
the server's rows (activations out of scale, labels that disagree with the inputs): the plain
mean, clipping at 10x (the default) and 3x the round's typical change, clipping without the
label screen (``clip@0``), the trimmed mean, the median, Multi-Krum; each with the default
quarantine after 3 flagged rounds in a row) and attack it reports the final clean accuracy, the attack's success
rate (label flip: test images sent to the flipped class; backdoor: triggered test images of
other classes sent to the target), the honest devices flagged (false positives) and the
attackers flagged, and the coordinator's wall seconds per round. The reference in the same run
is no defense without attackers. One more rule, ``absent``, is the default defense with the
attackers never selected (as if quarantined before round 1): what a perfect detector would
leave, so that what the defense costs and what losing the attackers' data costs are told apart.
Honest devices whose claimed samples the weight cap bounds are counted apart from those flagged
(a cap is not an accusation: it never leaves an update out nor counts towards quarantine unless
the claim is implausible).

    python bench/attacks.py --data digits --seeds 4 --jobs 2
    python bench/attacks.py --data digits --seeds 4 --jobs 2 --rules off clip --window 4   # 4 steps in flight
    python bench/attacks.py --data PATH/TO/mnist --seeds 2 --rules off clip@0 clip --attacks none "label flip" backdoor
    python bench/attacks.py --data digits --seeds 4 --method mergesfl --rules off clip --attacks none "even mix claim" "label flip"
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import common  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402

RULES = ("off", "mean", "clip", "clip~0", "clip@0", "clip:3", "trimmed_mean", "median", "multi_krum", "absent")
"""``robust.aggregate`` values; ``clip:3`` is clip with ``clip_factor: 3`` (the default factor is 10),
``clip@0`` clip with ``label_margin: 0`` (no label screen; ``@M`` sets the label screen's margin
of any rule), ``clip~0`` clip with ``peer_factor: 0`` (no bound against peers; ``~P`` sets it,
after any ``@M``); ``off`` is no defense at all: the plain mean, no weight cap, no screen of the
server's rows, every row trained as sent; ``absent`` the default with the attackers never selected."""
ATTACKS = {   # name -> (kind, factor, noise)
    "none": None,
    "label flip": ("label_flip", 1.0, 0.0),
    "backdoor": ("backdoor", 1.0, 0.0),
    "scale x10": ("scale", 10.0, 0.0),
    "scale x1000": ("scale", 1000.0, 0.0),
    "NaN": ("nan", 1.0, 0.0),
    "random weights": ("random", 1.0, 0.0),
    "activations x10 + noise": ("activations", 10.0, 1.0),
    "claim x1000": ("claim", 1000.0, 0.0),
    "even mix claim": ("even_mix", 1.0, 0.0),
}
DEFAULT_ATTACKS = [a for a in ATTACKS if a != "even mix claim"]
"""What a run measures unless ``--attacks`` says: a claimed mix of classes pays only where a
method selects devices by it (``--method mergesfl``)."""
METHODS = {
    "sfl": {"strategy": "sfl", "server_mode": "merged"},
    "mergesfl": {"strategy": "sfl", "server_mode": "merged", "mergesfl": {"select": True, "regulate": True}},
}
"""The fleet's method: SplitFed with a random half of the fleet a round (the default), or
MergeSFL with its KL selection by the devices' registered mix of classes (at most half the fleet
a round) and its batch regulation."""
TARGET = 0
"""The backdoor's target class."""


def robust_section(rule: str) -> dict[str, Any]:
    """The run config's ``robust:`` for a bench rule (``clip:3``: clip at factor 3)."""
    if rule == "off":
        return {"aggregate": "mean", "weight_cap": 0, "activation_factor": 0, "label_margin": 0,
                "repeated_rows": "each", "mix_limit": 0}
    if rule == "absent":
        return {}
    rule, _, peers = rule.partition("~")
    rule, _, margin = rule.partition("@")
    name, _, factor = rule.partition(":")
    return {"aggregate": name, **({"clip_factor": float(factor)} if factor else {}),
            **({"label_margin": float(margin)} if margin else {}),
            **({"peer_factor": float(peers)} if peers else {})}


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One run: the fleet with its attackers under one defense; its figures."""
    torch.set_num_threads(1)   # one core per run (--jobs runs side by side)
    from coordinator.engine import RoundFailed
    from sfl_core.config.run import run_config_from_dict
    from simulation import run_simulation
    from sfl_core.options.robust.option import flagged_in
    from simulation.adversary import Attack, trigger

    data = common.load_data(job["data"])
    n, share = job["agents"], job["share"]
    attackers = [f"sim-{i:03d}" for i in range(int(round(share * n)))] if job["attack"] != "none" else []
    spec = ATTACKS[job["attack"]]
    attack = Attack(spec[0], factor=spec[1], noise=spec[2], target=TARGET) if spec else None
    dataset = {"dataset": data.name} if job["data"] in ("digits", "mnist", "fashion-mnist") and not Path(job["data"]).exists() \
        else {"dataset": data.name, "root": job["data"]}
    cfg = run_config_from_dict({
        "run": "attacks", "model": job["model"], **_method(job["method"], n),
        "data": {**dataset, "partition": "dirichlet", "alpha": job["alpha"], "seed": job["seed"]},
        "fleet": [{"profile": "s2fl-mid-mid", "count": n}], "per_round": n // 2, "rounds": job["rounds"],
        "batch_size": job["batch"], "lr": 0.05, "local_iters": 10, "seed": job["seed"], "robust": robust_section(job["rule"]),
        "window": job["window"],
        "output_dir": str(Path(job["work"]) / f"{job['rule']}-{job['attack']}-{share}-s{job['seed']}".replace(" ", "_"))})
    t0 = time.time()
    try:
        with never_selected(attackers if job["rule"] == "absent" else []):
            history, engine = run_simulation(cfg, device="cpu", attacks={a: attack for a in attackers} if attack else None)
    except (RoundFailed, TimeoutError) as exc:   # a round fails, or every agent is quarantined
        print(f"{job['rule']:>12} {job['attack']:>24} {share:.0%} seed {job['seed']}: failed", flush=True)
        return {**job, "failed": str(exc).splitlines()[0], "accuracy": None}
    wall = time.time() - t0
    model = engine.model.eval()
    x, y = data.x_test, data.y_test
    with torch.no_grad():
        pred = model(x).argmax(1)
        flipped = float((pred == (data.num_classes - 1 - y)).float().mean())
        others = y != TARGET
        backdoor = float((model(trigger(x[others], 3)).argmax(1) == TARGET).float().mean())
    named: dict[str, int] = {}     # rounds an agent was named in: flagged or capped
    flagged: dict[str, int] = {}   # rounds it was flagged in (a cap alone is not a flag)
    seen: dict[str, int] = {}
    for r in history[1:]:
        for a in r.get("selected", []):
            seen[a] = seen.get(a, 0) + 1
        rb = r.get("robust", {})
        accused = flagged_in(rb)
        for a in accused:
            flagged[a] = flagged.get(a, 0) + 1
        for a in accused | set(rb.get("capped", ())):
            named[a] = named.get(a, 0) + 1
    honest_seen = sum(v for a, v in seen.items() if a not in attackers)
    bad_seen = sum(v for a, v in seen.items() if a in attackers)
    print(f"{job['rule']:>12} {job['attack']:>24} {share:.0%} seed {job['seed']}: acc {history[-1]['accuracy']:.3f} "
          f"({wall:.0f} s)", flush=True)
    return {**job, "accuracy": history[-1]["accuracy"], "flip_rate": flipped, "backdoor_rate": backdoor,
            "honest_flagged": sum(v for a, v in flagged.items() if a not in attackers) / max(1, honest_seen),
            "honest_capped": sum(v - flagged.get(a, 0) for a, v in named.items() if a not in attackers)
            / max(1, honest_seen),
            "attackers_flagged": (sum(v for a, v in named.items() if a in attackers) / bad_seen) if bad_seen else None,
            "named": sorted(a for a in named if a in attackers),
            "attackers_share_of_rounds": bad_seen / max(1, bad_seen + honest_seen),
            "coordinator_s_per_round": statistics.mean(r["wall_s"] for r in history[1:]), "wall_s": wall}


@contextlib.contextmanager
def never_selected(agents: list[str]) -> Iterator[None]:
    """While inside, ``agents`` register quarantined (the ``absent`` reference: never selected)."""
    from coordinator.registry import Registry
    register = Registry.register

    def quarantined_at_once(self: Registry, msg: Any) -> Any:
        info = register(self, msg)
        if info.agent_id in agents:
            info.quarantined = "absent from this reference run"
        return info
    Registry.register = quarantined_at_once  # type: ignore[method-assign]
    try:
        yield
    finally:
        Registry.register = register  # type: ignore[method-assign]


def mean(xs: list[Any]) -> float | None:
    known = [float(x) for x in xs if x is not None]
    return statistics.mean(known) if known else None


def _method(name: str, agents: int) -> dict[str, Any]:
    """The run config's keys for ``name`` (:data:`METHODS`) on a fleet of ``agents``."""
    keys = dict(METHODS[name])
    if "mergesfl" in keys:
        keys["mergesfl"] = {**keys["mergesfl"], "max_agents": agents // 2}
    return keys


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--agents", type=int, default=20)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=32,
                   help="each device's batch (default 32); small batches of many classes make the label screen's "
                        "held-out references largest where the devices' layers hold BatchNorm")
    p.add_argument("--shares", type=float, nargs="*", default=[0.1, 0.3])
    p.add_argument("--rules", nargs="*", default=list(RULES),
                   help="defenses: " + ", ".join(RULES) + " (any with @M: the label screen's margin M)")
    p.add_argument("--attacks", nargs="*", default=DEFAULT_ATTACKS, choices=list(ATTACKS))
    p.add_argument("--method", default="sfl", choices=list(METHODS),
                   help="sfl (default): SplitFed, a random half of the fleet a round; mergesfl: MergeSFL's KL "
                        "selection by the registered mix of classes and its batch regulation")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (one CPU thread each)")
    p.add_argument("--work", type=Path, default=Path("/tmp/sfl-bench-attacks"))
    p.add_argument("--tag", default="")
    p.add_argument("--window", default="1",
                   help="steps each device keeps in flight (docs/methods/pipeline.md): 1 (lock-step), 2..16 or auto")
    p.add_argument("--model", default="small_cnn",
                   help="the fleet's model (e.g. vgg_mini:width=0.5: BatchNorm in the devices' layers)")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.rounds, args.rules, args.attacks, args.shares = 1, 2, ["off", "clip"], ["none", "scale x1000"], [0.3]
    jobs = [{"rule": rule, "attack": attack, "share": share if attack != "none" else 0.0, "seed": args.seed + s,
             "agents": args.agents, "rounds": args.rounds, "alpha": args.alpha, "data": args.data, "work": str(args.work),
             "model": args.model, "batch": args.batch, "method": args.method,
             "window": int(args.window) if args.window.isdigit() else args.window}
            for rule in args.rules for attack in args.attacks for share in (args.shares if attack != "none" else [0.0])
            for s in range(args.seeds)]
    t0 = time.time()
    results = common.run_jobs(run_one, jobs, args)
    rows = []
    clean = mean([r["accuracy"] for r in results if r["rule"] == "off" and r["attack"] == "none"])
    for rule in args.rules:
        for attack in args.attacks:
            for share in (args.shares if attack != "none" else [0.0]):
                runs = [r for r in results if r["rule"] == rule and r["attack"] == attack and r["share"] == share]
                accs = [r["accuracy"] for r in runs]
                ok = [a for a in accs if a is not None]
                acc = mean(ok)
                rows.append({
                    "rule": rule, "attack": attack, "share": share, "runs": len(runs),
                    "failed": sum(a is None for a in accs),
                    "accuracy": acc, "worst": min(ok) if len(ok) == len(accs) and ok else None,
                    "vs_clean": (acc - clean) if acc is not None and clean is not None and len(ok) == len(accs) else None,
                    "success_rate": mean([r.get("flip_rate") if attack == "label flip" else r.get("backdoor_rate")
                                          for r in runs]) if attack in ("label flip", "backdoor") else None,
                    "honest_flagged": mean([r.get("honest_flagged") for r in runs]),
                    "honest_capped": mean([r.get("honest_capped") for r in runs]),
                    "attackers_flagged": mean([r.get("attackers_flagged") for r in runs]),
                    "attackers_share_of_rounds": mean([r.get("attackers_share_of_rounds") for r in runs]),
                    "coordinator_s_per_round": mean([r.get("coordinator_s_per_round") for r in runs])})
    _print(rows)
    payload = {"config": common.config_record(args), "reference": "no defense (rule off: the plain mean, no weight cap, no "
               "screen of the server's rows) without attackers, same seeds",
               "clean_accuracy": clean, "baseline_rates": {
                   "flip_rate": mean([r["flip_rate"] for r in results if r["attack"] == "none" and r["rule"] == "off"]),
                   "backdoor_rate": mean([r["backdoor_rate"] for r in results if r["attack"] == "none" and r["rule"] == "off"])},
               "rows": rows, "runs": results, "wall_s": time.time() - t0}
    path = common.write_result(args.out, "attacks" + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else ""),
                               payload)
    print(f"wrote {path}")
    return payload


def _print(rows: list[dict[str, Any]]) -> None:
    def f(x: Any, pct: bool = True) -> str:
        return "—" if x is None else (f"{100 * x:.1f}" if pct else f"{x:.3f}")
    print(f"{'defense':>12} {'attack':>24} {'share':>5} {'acc %':>6} {'worst':>6} {'Δ clean':>8} {'ASR %':>6} "
          f"{'FP %':>5} {'cap %':>5} {'named %':>7} {'theirs %':>8} {'coord s/rd':>10}")
    for r in rows:
        fails = f" ({r['failed']} of {r['runs']} failed)" if r["failed"] else ""
        print(f"{r['rule']:>12} {r['attack']:>24} {r['share']:>5.0%} {f(r['accuracy']):>6} {f(r['worst']):>6} "
              f"{f(r['vs_clean']):>8} {f(r['success_rate']):>6} {f(r['honest_flagged']):>5} {f(r['honest_capped']):>5} "
              f"{f(r['attackers_flagged']):>7} {f(r.get('attackers_share_of_rounds')):>8} "
              f"{f(r['coordinator_s_per_round'], False):>10}{fails}")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
