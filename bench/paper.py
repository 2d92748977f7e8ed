"""The four papers' headline settings, run through the product's engine: which method reaches
accuracy first in each paper's own setting, and by how much.

    python bench/paper.py heterosfl                  # CPU replica (default), 2 seeds
    python bench/paper.py s2fl --settings a=0.5      # one setting
    python bench/paper.py fedfc --full --device cuda # the papers' model sizes (GPU machine)
    python bench/paper.py mergesfl --quick           # smoke test (numbers not meaningful)

Each paper is one YAML file in ``bench/configs/<paper>.yaml``: the paper's run config at full
size (``base``), the settings (data partitions, link ratios) and methods it compares, the
published numbers, and the CPU replica's departures. Everything runs in ``simulate`` (the same
round engine as ``serve``, in-process agents, virtual clock): real training on real data, time
from the time model with each agent's profile and its real encoded bytes.

**CPU replica, same regime.** ``--full`` runs the paper's model; the default narrows every layer
by ``replica.width`` (``vgg16:width=0.125``) so it trains on 2 cores. Narrowing divides the
model's FLOPs by about width² and its activation bytes by width, which would change what the
mechanisms react to, so every device profile is scaled too: FLOP/s (devices and server) by the
FLOPs factor and link rates by the activation-bytes factor. Each device's compute/transfer
balance is then the full model's; weight transfer shrinks by width² and so weighs a little less
than at full size (stated in each result). The factors are in the JSON; virtual seconds are
the replica's, not the full model's.

Reported per setting and method: final accuracy (mean of the last 3 evaluations; mean ± std
over seeds), best accuracy, rounds and virtual seconds to a target accuracy (the paper's kind:
``target.fraction`` x the lowest best accuracy among the methods that must reach it), and the
speedup against each baseline the paper names. Results: ``bench/results/paper-<name>.json``
and a PNG of accuracy against virtual time and against rounds.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

import common  # noqa: E402  (puts the repo root on sys.path)

from sfl_core.model.accounting import model_costs  # noqa: E402
from sfl_core.config.run import load_profile, run_config_from_dict  # noqa: E402
from sfl_core.model.zoo import ModelSpec  # noqa: E402

CONFIG_DIR = common.BENCH_DIR / "configs"
PAPERS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


# --------------------------------------------------------------------------- config assembly


def input_shape(base: dict[str, Any]) -> tuple[int, int, int]:
    size = base["data"].get("image_size") or 28
    return (1, size, size)


def scale_factors(full_model: str, replica_model: str, shape: tuple[int, ...], split: int) -> dict[str, float]:
    """How much the replica shrank: whole-model FLOPs, activation bytes at ``split``, client weights."""
    full, rep = model_costs(full_model, shape, 10), model_costs(replica_model, shape, 10)
    whole = max(full)
    return {"flops": rep[whole].client_flops / full[whole].client_flops,
            "activation_bytes": rep[split].activation_bytes / full[split].activation_bytes,
            "weight_bytes": rep[whole].client_param_bytes / full[whole].client_param_bytes}


def scaled_profile(name: str, factors: dict[str, float], out_dir: Path,
                   capacity: list[dict[str, Any]] | None = None) -> str:
    """A copy of profile ``name`` with FLOP/s and link rates scaled (and, for time-varying
    fleets, a capacity schedule); returns its path. ``name`` is a profile name
    (profiles/devices/) or a path to a profile YAML, relative to bench/configs/ (where the
    paper configs live) or to the working directory; the copy keeps the profile's ``name``."""
    from sfl_core.config.fields import looks_like_path
    if looks_like_path(name) and not Path(name).is_absolute() and (CONFIG_DIR / name).is_file():
        p = load_profile(str(CONFIG_DIR / name))
    else:
        p = load_profile(name)
    doc = {"name": p.name, "compute_flops": p.compute_flops * factors["flops"],
           "link_bytes_per_s": p.link_bytes_per_s * factors["activation_bytes"],
           "downlink_bytes_per_s": p.downlink_bytes_per_s * factors["activation_bytes"],
           "latency_s": p.latency_s,
           "description": p.description + (" (scaled for a CPU replica)" if factors["flops"] != 1 else ""),
           "source": f"{name} x flops {factors['flops']:.4g}, links x {factors['activation_bytes']:.4g}"}
    if p.memory_bytes:
        # Memory limits (what strategy: auto plans against) scale with the replica's client
        # weight bytes (about width² when the model is narrowed), so a limit that excludes
        # the full model's largest client portions still excludes the replica's. The batch
        # part of training memory (activations) shrinks only by about width, so a narrowed
        # replica's memory-bound batch sizes are smaller than the full model's; at width 1
        # (a model run at full size) the limit is the profile's own.
        wf = factors.get("weight_bytes", 1.0)
        doc["memory_bytes"] = p.memory_bytes * wf
        doc["source"] += f", memory x {wf:.4g}"
    if capacity or p.capacity:
        doc["capacity"] = capacity or [{"from_round": r, "compute": c, "link": l} for r, c, l in p.capacity]
    path = out_dir / f"{p.name}.yaml"
    # write beside, then rename: parallel runs of one setting share this file and must never read half of it
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
    os.replace(tmp, path)
    return str(path)


def ordered_fleet(fleet: list[dict[str, Any]], correlate: dict[str, Any] | None, data: dict[str, Any],
                  labels: Any) -> list[dict[str, Any]]:
    """System-induced skew (HeteroSFL, after Maeng et al. 2022): put agents whose shards share
    dominant classes on the same device class, by ordering the fleet (agent i gets shard i)."""
    if not correlate:
        return fleet
    from sfl_core.data.partition import partition_indices
    import numpy as np
    profiles = [e["profile"] for e in fleet for _ in range(e["count"])]
    shards = partition_indices(labels, len(profiles), data["partition"], alpha=data.get("alpha", 0.5),
                               seed=data.get("seed", 0), num_classes=10)
    # sort shards by their label mean: similar label mixes become neighbours, then deal device
    # classes out in fleet order, so each class holds a contiguous band of the label space
    order = sorted(range(len(shards)), key=lambda i: float(np.mean(labels[shards[i]])) if len(shards[i]) else 0.0)
    slot = {agent: profiles[rank] for rank, agent in enumerate(order)}
    return [{"profile": slot[i], "count": 1} for i in range(len(profiles))]


def build_config(spec: dict[str, Any], setting: str, method: str, seed: int, args: Any,
                 factors: dict[str, float] | None, work: Path, labels: Any) -> dict[str, Any]:
    base = common.deep_merge(spec["base"], {} if args.full else spec["replica"].get("overrides", {}))
    cfg = common.deep_merge(common.deep_merge(base, spec["settings"][setting] or {}), spec["methods"][method] or {})
    cfg.pop("correlate", None)
    parsed = ModelSpec.parse(cfg["model"])
    norm = args.norm or parsed.norm
    model = str(ModelSpec(parsed.name, parsed.width if args.full else spec["replica"]["width"], norm))
    cfg["model"] = model
    if args.rounds:
        cfg["rounds"] = args.rounds
    correlate = common.deep_merge(spec["base"], spec["settings"][setting] or {}).get("correlate")
    fleet = ordered_fleet(cfg["fleet"], correlate, cfg["data"], labels)
    # profile copies (scaled for a replica, with the setting's capacity schedules); a copy keeps
    # its profile's name, so profile_splits still match
    f = factors or {"flops": 1.0, "activation_bytes": 1.0}
    capacity = cfg.pop("capacity", None) or {}
    prof_dir = work / f"profiles-{setting}".replace(" ", "_").replace("/", "_")
    prof_dir.mkdir(parents=True, exist_ok=True)
    fleet = [{**e, "profile": scaled_profile(e["profile"], f, prof_dir, capacity.get(e["profile"]))} for e in fleet]
    cfg["server_flops"] = float(cfg.get("server_flops", 5e10)) * f["flops"]
    cfg["fleet"] = fleet
    shape, costs = input_shape(cfg), model_costs(model, input_shape(cfg), 10)
    if cfg.get("split") == "fastest":        # the best fixed split: lowest round time by the time model
        cfg["split"] = fastest_split(cfg, costs)
    reduce = (cfg.get("hetero") or {}).pop("reduce", None)
    if reduce:                               # bottleneck widths as data reductions of the full width p̄
        full = costs[cfg["split"]].activation_shape[0]
        cfg["hetero"].update(width=full, widths=[max(1, full // r) for r in reduce])
    reduce = (cfg.get("auto") or {}).pop("reduce", None)
    if reduce:                               # auto's widths, the same way
        full = costs[cfg["split"]].activation_shape[0]
        cfg["auto"]["widths"] = sorted({max(1, full // r) for r in reduce})
    cfg["data"] = {**cfg["data"], "seed": seed, "root": args.root, "dataset": args.dataset}
    cfg.update(run=f"paper-{args.paper}", seed=seed, output_dir=str(work / run_dir_name(setting, method, seed)))
    if args.quick:
        cfg.update(rounds=2, local_iters=1, eval_samples=200)
    return cfg


def run_dir_name(setting: str, method: str, seed: int) -> str:
    return f"{setting}-{method}-s{seed}".replace(" ", "_").replace("/", "_")


def curves_from_runs(spec: dict[str, Any], work: Path, settings: list[str], methods: list[str], seeds: range
                     ) -> dict[str, dict[str, list[list[dict[str, Any]]]]]:
    """Rebuild the curves from the run directories a (possibly interrupted) bench left in ``work``:
    those of ``seeds`` that exist, so that a report's seeds are the ones asked for even where the
    same directory holds more."""
    from coordinator.state import read_metrics
    curves: dict[str, dict[str, list[list[dict[str, Any]]]]] = {}
    for setting in settings:
        for method in methods:
            runs = []
            for seed in seeds:
                d = work / run_dir_name(setting, method, seed)
                if not (d / "metrics.jsonl").is_file():
                    continue
                recs = read_metrics(d)
                if recs and recs[-1]["round"] >= 1:
                    runs.append([{k: r[k] for k in common.CURVE_KEYS}
                                 for r in recs])
            if runs:
                n = min(len(r) for r in runs)       # an interrupted run counts up to where all seeds got
                curves.setdefault(setting, {})[method] = [r[:n] for r in runs]
    return curves


def fastest_split(cfg: dict[str, Any], costs: dict[int, Any]) -> int:
    """The candidate split whose synchronous round (slowest agent) is shortest for this fleet."""
    from sfl_core.config.run import run_config_from_dict
    from sfl_core.model.zoo import candidate_splits
    from sfl_core.timing import fleet_round_time
    cands = (cfg.get("s2fl") or {}).get("candidates") or candidate_splits(cfg["model"])
    priced = run_config_from_dict({key: cfg[key] for key in ("model", "fleet", "batch_size", "local_iters",
                                                             "server_flops", "codec", "momentum") if key in cfg})
    profiles = [load_profile(e["profile"]) for e in cfg["fleet"]]
    return min(cands, key=lambda s: fleet_round_time(priced, costs[s], profiles))


# --------------------------------------------------------------------------- summary


def time_to(history: list[dict[str, Any]], target: float, key: str) -> float | None:
    for rec in history:
        if rec["accuracy"] >= target:
            return rec[key]
    return None


def mean_or_none(values: list[float | None]) -> float | None:
    return statistics.mean(values) if values and all(v is not None for v in values) else None


def summarise(spec: dict[str, Any], curves: dict[str, dict[str, list[list[dict[str, Any]]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    frac = spec.get("target", {}).get("fraction", 0.95)
    for setting, by_method in curves.items():
        best = {m: max(statistics.mean(run[i]["accuracy"] for run in runs) for i in range(min(map(len, runs))))
                for m, runs in by_method.items()}
        must = [m for m in spec.get("target", {}).get("methods", list(by_method)) if m in best] or list(best)
        target = frac * min(best[m] for m in must)
        rows = {}
        for m, runs in by_method.items():
            finals = [statistics.mean(r["accuracy"] for r in run[-3:]) for run in runs]
            rows[m] = {"final_accuracy_mean": statistics.mean(finals),
                       "final_accuracy_std": statistics.pstdev(finals) if len(finals) > 1 else 0.0,
                       "best_accuracy_mean": best[m],
                       "rounds_to_target": [time_to(run, target, "round") for run in runs],
                       "time_to_target_s": [time_to(run, target, "elapsed_s") for run in runs],
                       "round_time_s_mean": statistics.mean(
                           (run[-1]["elapsed_s"] / max(1, run[-1]["round"])) for run in runs),
                       "bytes_per_round_mean": statistics.mean(
                           sum(r["bytes_up"] + r["bytes_down"] for r in run) / max(1, run[-1]["round"]) for run in runs)}
            rows[m]["time_to_target_mean_s"] = mean_or_none(rows[m]["time_to_target_s"])
            rows[m]["rounds_to_target_mean"] = mean_or_none(rows[m]["rounds_to_target"])
        for m, row in rows.items():
            for base in spec.get("baselines", []):
                ref = rows.get(base, {}).get("time_to_target_mean_s")
                mine = row["time_to_target_mean_s"]
                row[f"speedup_vs_{base}"] = (ref / mine) if ref and mine else None
                ref_r = rows.get(base, {}).get("round_time_s_mean")
                row[f"per_round_speedup_vs_{base}"] = (ref_r / row["round_time_s_mean"]) if ref_r else None
        out[setting] = {"target_accuracy": target, "methods": rows}
    return out


def add_norm_stats(spec: dict[str, Any], summary: dict[str, Any], work: Path, args: Any) -> None:
    """Each method's final accuracy with BatchNorm statistics recomputed (mean ± std over its
    seeds' run directories; models without BatchNorm get none)."""
    import norm_stats
    from sfl_core.data.builtin import load_dataset
    image_size = (spec["base"].get("data") or {}).get("image_size")
    data = load_dataset(args.dataset, args.root, image_size=image_size)
    for setting, s in summary.items():
        for method, row in s["methods"].items():
            dirs = [work / run_dir_name(setting, method, seed) for seed in range(args.seed, args.seed + len(row["rounds_to_target"]))]
            pairs = [r for r in norm_stats.compare(dirs, data, eval_samples=spec["base"].get("eval_samples")).values()
                     if r is not None]
            if pairs:
                after = [a for _, a in pairs]
                row["norm_stats_recomputed_mean"] = statistics.mean(after)
                row["norm_stats_recomputed_std"] = statistics.pstdev(after) if len(after) > 1 else 0.0


def _recomputed(r: dict[str, Any]) -> str:
    if "norm_stats_recomputed_mean" not in r:
        return "—"
    return f"{100 * r['norm_stats_recomputed_mean']:.1f} ± {100 * r['norm_stats_recomputed_std']:.1f}"


def print_summary(spec: dict[str, Any], summary: dict[str, Any], caption: str) -> None:
    bases = spec.get("baselines", [])
    norm = _has_norm_stats(summary)
    rows = []
    for setting, s in summary.items():
        for m, r in s["methods"].items():
            rows.append([setting, m,
                         f"{100 * r['final_accuracy_mean']:.2f} ± {100 * r['final_accuracy_std']:.2f}",
                         f"{100 * s['target_accuracy']:.1f}", common.fmt(r["rounds_to_target_mean"]),
                         common.fmt(r["time_to_target_mean_s"]),
                         *[common.fmt(r.get(f"speedup_vs_{b}")) for b in bases],
                         *[common.fmt(r.get(f"per_round_speedup_vs_{b}")) for b in bases],
                         *([_recomputed(r)] if norm else []),
                         str(spec.get("published", {}).get(m, ""))])
    common.print_table(f"{spec['title']}", ["setting", "method", "acc %", "target %", "rounds@t", "t@target s",
                                            *[f"× vs {b}" for b in bases], *[f"×/round vs {b}" for b in bases],
                                            *(["acc %, BN stats recomputed"] if norm else []),
                                            "paper"], rows, caption=caption)


def _has_norm_stats(summary: dict[str, Any]) -> bool:
    return any("norm_stats_recomputed_mean" in r for s in summary.values() for r in s["methods"].values())


def dash(v: Any) -> str:
    return "—" if v is None else common.fmt(v)


def markdown_summary(spec: dict[str, Any], summary: dict[str, Any], caption: str) -> str:
    """The summary as Markdown tables, one per setting (what docs/results.md quotes, regenerated
    with every run rather than copied by hand)."""
    bases = spec.get("baselines", [])
    norm = _has_norm_stats(summary)
    lines = [f"**{spec['title']}** — {caption}", ""]
    for setting, s in summary.items():
        lines += [f"*{setting}* (target {100 * s['target_accuracy']:.1f} %)", "",
                  "| method | final acc % | rounds to target | virtual s to target | "
                  + " | ".join(f"× vs {b}" for b in bases) + (" | final acc %, BN stats recomputed" if norm else "")
                  + " |",
                  "|---" * (4 + len(bases) + norm) + "|"]
        for m, r in s["methods"].items():
            rounds = [x for x in r["rounds_to_target"] if x is not None]
            reached = f"{common.fmt(r['rounds_to_target_mean'])}" if r["rounds_to_target_mean"] is not None else \
                f"not reached ({len(rounds)}/{len(r['rounds_to_target'])} seeds)"
            lines.append(f"| {m} | {100 * r['final_accuracy_mean']:.1f} ± {100 * r['final_accuracy_std']:.1f} | "
                         f"{reached} | {dash(r['time_to_target_mean_s'])} | "
                         + " | ".join(dash(r.get(f"speedup_vs_{b}")) for b in bases)
                         + (f" | {_recomputed(r)}" if norm else "") + " |")
        lines.append("")
    if norm:
        lines += ["*BN stats recomputed*: the final model with every BatchNorm layer's running statistics "
                  "recomputed from 3,000 training images (bench/norm_stats.py). A diagnostic, not a method: "
                  "it shows how much accuracy the averaged statistics cost.", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("paper", choices=PAPERS, help="which paper's setting (bench/configs/<paper>.yaml)")
    p.add_argument("--full", action="store_true", help="the paper's model at full size (GPU machine)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seeds", type=int, default=2,
                   help="how many seeds, from --seed on (split seeds over processes with --seed and --tag, "
                        "then --merge)")
    p.add_argument("--rounds", type=int, default=None, help="override the horizon")
    p.add_argument("--norm", choices=["batch", "group", "none"], default=None,
                   help="normalisation layers of every method's model (default: the config's)")
    p.add_argument("--settings", nargs="*", default=None)
    p.add_argument("--methods", nargs="*", default=None)
    p.add_argument("--work", type=Path, default=None, help="run directories (default /tmp/sfl-paper-<paper>)")
    p.add_argument("--tag", default="", help="suffix of the result file (for runs split over processes)")
    p.add_argument("--merge", nargs="*", type=Path, default=None,
                   help="instead of running, combine the curves of these result files into one report "
                        "(a method's seeds from several files are pooled)")
    p.add_argument("--norm-stats", action="store_true",
                   help="add a column: final accuracy with every BatchNorm layer's statistics recomputed "
                        "from training images (bench/norm_stats.py; a diagnostic of the averaged statistics)")
    p.add_argument("--from-runs", action="store_true",
                   help="instead of running, rebuild the report from the run directories under --work "
                        "(finished seeds of an interrupted bench)")
    p.add_argument("--ran-on", default=None,
                   help="with --from-runs: where the runs were made, when elsewhere (recorded in the result)")
    args = p.parse_args(argv)
    spec = yaml.safe_load((CONFIG_DIR / f"{args.paper}.yaml").read_text())
    settings = args.settings or list(spec["settings"])
    methods = args.methods or list(spec["methods"])
    for name, known in (("setting", spec["settings"]), ("method", spec["methods"])):
        bad = [x for x in (settings if name == "setting" else methods) if x not in known]
        if bad:
            raise SystemExit(f"unknown {name}(s) {bad}; {args.paper} has {list(known)}")
    if args.quick:   # a smoke test: one seed, the first setting, the first two methods unless named
        args.seeds, settings, methods = 1, settings[:1], methods if args.methods else methods[:2]
    common.apply_threads(args)
    spec_data = args.data
    args.dataset, args.root = ("fashion-mnist", spec_data) if Path(spec_data).is_dir() else (spec_data, None)
    if "mnist" in str(spec_data).lower() and "fashion" not in str(spec_data).lower():
        args.dataset = "mnist"
    work = args.work or Path(f"/tmp/sfl-paper-{args.paper}{'-full' if args.full else ''}")
    base = spec["base"]
    shape = input_shape(base)
    replica_model = str(ModelSpec(ModelSpec.parse(base["model"]).name, spec["replica"]["width"],
                                  args.norm or ModelSpec.parse(base["model"]).norm))
    factors = None if args.full else scale_factors(base["model"], replica_model, shape, spec["replica"]["split"])
    labels = common.load_data(spec_data).y_train.numpy()
    curves: dict[str, dict[str, list[list[dict[str, Any]]]]] = {}
    t_start = time.time()
    if args.from_runs:
        curves = curves_from_runs(spec, work, settings, methods, range(args.seed, args.seed + args.seeds))
    elif args.merge:
        for f in args.merge:
            merged = json.loads(f.read_text())
            for setting, by_method in merged["curves"].items():   # seeds of one method in several files add up
                for method, runs in by_method.items():
                    curves.setdefault(setting, {}).setdefault(method, []).extend(runs)
            # the merged runs' model and factors, not today's config's
            replica_model, factors = merged["scale"]["model"], merged["scale"]["factors"] or factors
        curves = {s: {m: curves[s][m] for m in spec["methods"] if m in curves[s]} for s in spec["settings"] if s in curves}
    else:
        for setting in settings:
            curves[setting] = {}
            for method in methods:
                curves[setting][method] = common.simulate_seeds(
                    f"{setting:>10} {method:>16}",
                    lambda seed: run_config_from_dict(build_config(spec, setting, method, seed, args, factors,
                                                                   work, labels)),
                    args.seeds, args.device, first=args.seed)
    summary = summarise(spec, curves)
    if args.norm_stats:
        add_norm_stats(spec, summary, work, args)
    scale = ("full size" if args.full else
             f"{replica_model} at full size (small enough for a CPU)" if factors["flops"] == 1 else
             f"CPU replica {replica_model}: device FLOP/s x {factors['flops']:.3g}, links x "
             f"{factors['activation_bytes']:.3g} (weights shrank x {factors['weight_bytes']:.3g})")
    seeds = max((len(runs) for by_method in curves.values() for runs in by_method.values()), default=0)
    caption = f"{scale}; {seeds} seed(s); wall {time.time() - t_start:.0f} s"
    print_summary(spec, summary, caption=caption)
    payload = {"paper": args.paper, "title": spec["title"], "reference": spec["reference"],
               "scale": {"full": args.full, "model": base["model"] if args.full else replica_model,
                         "factors": factors},
               "published": spec.get("published", {}), "departures": spec.get("departures", []),
               "config": common.config_record(args), "spec": spec, "summary": summary, "curves": curves,
               **({"ran_on": args.ran_on} if args.ran_on else {})}
    name = f"paper-{args.paper}" + ("-full" if args.full else "") + ("-quick" if args.quick else "") + \
        (f"-{args.tag}" if args.tag else "")
    from coordinator.server_trainer import pick_device
    path = common.write_result(args.out, name, payload, pick_device(args.device))
    shown = spec.get("plot")   # a long matrix draws only the methods its spec names
    common.plot_accuracy_vs_time({k: {m: c for m, c in by.items() if not shown or m in shown}
                                  for k, by in curves.items()}, args.out / f"{name}.png", by_round=True)
    (args.out / f"{name}.md").write_text(markdown_summary(spec, summary, caption.split("; wall")[0]
                                                          + (f"; runs made on {args.ran_on}" if args.ran_on else "")))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
