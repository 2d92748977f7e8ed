"""HeteroSFL comparison in the virtual-clock simulation (docs/methods/heterosfl.md; HeteroSFL paper, Table 1).

    python bench/heterosfl.py --jobs 2                 # full: 4 settings x 14 methods x 2 seeds (~1 h, 2 cores)
    python bench/heterosfl.py --quick                  # smoke test (numbers not meaningful)

Setting (the paper's Table 1 at small scale): 10 agents, all selected every round, on
Fashion-MNIST (``--data``), label skew Dirichlet a in {0.05, 0.3}, 30% or 60% of the agents
high-end (profile ``heterosfl-high``, 20 Mb/s) and the rest low-end (``heterosfl-low``,
16x slower). Model ``vgg_mini`` cut after its third conv: 256 channels at 7x7, like the
paper's VGG-11 cut (p̄ = 256). Methods, at a reduction R in {16, 64, 256} of the low
group's bytes per sample (the high group's is R/16, so both groups' transfers take the
same time, as in the paper):

- ``SFL``: no compression, cross-entropy (the paper's baseline); ``SFL+LC`` the same with
  the calibrated loss, to tell the loss's effect from the compression's;
- ``Top-k``: top-k sparse activations and gradients per group (``hetero.codecs``), sized
  to the same nominal byte reduction (k values as float16 + int32 indices = 6 B per kept
  entry against 4 B per dense one); the codec's 1 % floor caps the low group at 67x;
- ``IdBL``: one bottleneck width for everybody, the low group's (256/R channels);
- ``HetBL``: widths 256/R (low) and 16·256/R (high), HetBL aggregation;
- ``HeteroSFL``: HetBL + BDKS (α = ``--alpha``, θ = 10 %).

All but SFL use the logit-calibrated loss, as in the paper. Everything runs through the
product's engine (``simulation.run_simulation``): real training on real data, virtual
time from the time model (docs/methods/time-model.md) with each agent's profile and its real encoded bytes (zstd included).
Reported: final accuracy (mean of the last 3 evaluated rounds; mean ± std over seeds),
total virtual training time for the same number of rounds and its reduction against SFL,
and the wire bytes per sample of every (width, codec) used, measured on real activations
and gradients of the trained SFL model.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import common  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sfl_core.wire import codec as wire  # noqa: E402

P_BAR = 256          # channels of vgg_mini at split 3
HIGH_LOW_RATIO = 16  # link-rate ratio of heterosfl-high to heterosfl-low
RATE_THRESHOLD = 1e6  # B/s between the two profiles' rates (1.5625e5 and 2.5e6)
SETTINGS = {"a=0.05/30%": (0.05, 3), "a=0.05/60%": (0.05, 6), "a=0.3/30%": (0.3, 3), "a=0.3/60%": (0.3, 6)}
REDUCTIONS = (16, 64, 256)


def topk_codec(reduction: float) -> str:
    """The topk<P> whose nominal bytes (6 B per kept entry) are 1/reduction of fp32's (4 B each)."""
    if reduction <= 1:
        return "fp32"
    return f"topk{max(1, min(99, round(100 * 4 / (6 * reduction))))}"


def methods() -> dict[str, dict[str, Any]]:
    """Method name -> run-config overrides (``SFL`` plus each compressed method at each R)."""
    out: dict[str, dict[str, Any]] = {"SFL": {"loss": "ce"}, "SFL+LC": {"loss": "calibrated"}}
    thr = {"groups": 2, "thresholds": [RATE_THRESHOLD]}
    for r in REDUCTIONS:
        low, high = P_BAR // r, P_BAR * HIGH_LOW_RATIO // r
        out[f"Top-k {r}x"] = {"loss": "calibrated",
                              "hetero": {**thr, "codecs": [topk_codec(r), topk_codec(r / HIGH_LOW_RATIO)]}}
        out[f"IdBL {r}x"] = {"loss": "calibrated", "hetero": {**thr, "width": low, "widths": [low, low]}}
        out[f"HetBL {r}x"] = {"loss": "calibrated", "hetero": {**thr, "width": P_BAR, "widths": [low, high]}}
        out[f"HeteroSFL {r}x"] = {"loss": "calibrated",
                                  "hetero": {**thr, "width": P_BAR, "widths": [low, high], "bdks": True}}
    return out


def config(method: str, setting: str, seed: int, args: Any) -> dict[str, Any]:
    alpha, n_high = SETTINGS[setting]
    m = methods()[method]
    hetero = dict(m.get("hetero", {}))
    if hetero.get("bdks"):
        hetero["bdks_alpha"] = args.alpha
    cfg = {
        "run": "bench-heterosfl", "model": "vgg_mini", "split": 3, "strategy": "sfl",
        "data": {"dataset": args.dataset, "root": args.root, "partition": "dirichlet", "alpha": alpha, "seed": seed},
        "fleet": [{"profile": "heterosfl-low", "count": args.agents - round(n_high * args.agents / 10)},
                  {"profile": "heterosfl-high", "count": round(n_high * args.agents / 10)}],
        "rounds": args.rounds, "batch_size": args.batch, "lr": args.lr, "momentum": args.momentum,
        "local_iters": args.tau, "seed": seed, "eval_samples": args.eval_samples, "codec": "fp32",
        "zstd_level": args.zstd_level, "loss": m["loss"],
        "output_dir": str(args.work / f"{setting.replace('/', '_')}-{method.replace(' ', '_')}-s{seed}"),
    }
    if hetero:
        cfg["hetero"] = hetero
    return cfg


def run_one(job: tuple[str, str, int, Any]) -> dict[str, Any]:
    """One simulated run (in a worker process when --jobs > 1)."""
    method, setting, seed, args = job
    torch.set_num_threads(args.threads or 1)
    from simulation import run_simulation
    from sfl_core.config.run import run_config_from_dict
    t0 = time.time()
    cfg = run_config_from_dict(config(method, setting, seed, args))
    history, engine = run_simulation(cfg, device="cpu", quiet=True)
    curve = [{k: r[k] for k in ("round", "accuracy", "elapsed_s", "bytes_up", "bytes_down")} for r in history]
    out = {"method": method, "setting": setting, "seed": seed, "curve": curve, "wall_s": time.time() - t0}
    if method == "SFL" and seed == 0:
        out["model_state"] = {k: v.cpu() for k, v in engine.model.state_dict().items()}
    print(f"{setting:>11} {method:>14} seed {seed}: acc {history[-1]['accuracy']:.4f} "
          f"virtual {history[-1]['elapsed_s']:.0f} s  ({out['wall_s']:.0f} s wall)", flush=True)
    return out


def bytes_per_sample(state: dict[str, torch.Tensor], args: Any) -> list[dict[str, Any]]:
    """Wire bytes per sample (activation up + gradient down, zstd included) for every width and
    codec the methods use, on real activations/gradients of the trained SFL model."""
    from sfl_core.data.builtin import load_dataset
    from sfl_core.model.zoo import build_model
    ds = load_dataset(args.dataset, args.root)
    x, y = ds.x_train[:256], ds.y_train[:256]
    rows = []
    combos = [(0, "fp32")] + [(0, topk_codec(r)) for r in (16, 64, 4, 1)] + [(0, c) for c in ("fp16", "bf16", "int8")]
    combos += [(w, "fp32") for w in (256, 64, 16, 4, 1)]
    for width, codec in dict.fromkeys(combos):
        torch.manual_seed(0)
        model = build_model("vgg_mini", tuple(x.shape[1:]), 10)
        model.load_state_dict(state)
        if width:   # a fresh bottleneck (orthogonal projection) on the trained trunk
            model.add_bottleneck(3, width)
        act = model.client(3)(x)
        sent = act.detach().requires_grad_(True)
        F.cross_entropy(model.server(3)(sent), y).backward()
        up = wire.encoded_nbytes(wire.encode_tensor(act.detach(), codec, args.zstd_level))
        down = wire.encoded_nbytes(wire.encode_tensor(sent.grad, codec, args.zstd_level))
        raw = 4 * act[0].numel()
        rows.append({"width": width or "none", "codec": codec, "raw_fp32_bytes": raw,
                     "up_bytes": up / len(x), "down_bytes": down / len(x),
                     "reduction_vs_sfl_fp32": None})
    base = rows[0]["up_bytes"] + rows[0]["down_bytes"]
    for r in rows:
        r["reduction_vs_sfl_fp32"] = base / (r["up_bytes"] + r["down_bytes"])
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--agents", type=int, default=10)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--tau", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--alpha", type=float, default=1.0, help="BDKS weight of N2W")
    p.add_argument("--eval-samples", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--jobs", type=int, default=1, help="parallel worker processes")
    p.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--methods", nargs="*", default=None, help="method names (default: all)")
    p.add_argument("--zstd-level", type=int, default=1)
    p.add_argument("--work", type=Path, default=Path("/tmp/sfl-bench-heterosfl"), help="run directories")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.tau, args.batch, args.seeds, args.eval_samples = 2, 2, 8, 1, 200
        args.settings = ["a=0.3/30%"]
        args.methods = args.methods or ["SFL", "Top-k 64x", "HetBL 64x", "HeteroSFL 64x"]
    all_methods = methods()
    chosen = args.methods or list(all_methods)
    unknown = [m for m in chosen if m not in all_methods]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {list(all_methods)}")
    spec = args.data
    if Path(spec).is_dir():
        args.dataset, args.root = "fashion-mnist", spec
    else:
        args.dataset, args.root = spec, None
    jobs = [(m, s, seed, args) for s in args.settings for m in chosen for seed in range(args.seeds)]
    t_start = time.time()
    results = common.run_jobs(run_one, jobs, args)

    curves: dict[str, dict[str, list[list[dict[str, Any]]]]] = {}
    for res in results:
        curves.setdefault(res["setting"], {}).setdefault(res["method"], []).append(res["curve"])
    summary: dict[str, Any] = {}
    rows = []
    for setting, by_method in curves.items():
        summary[setting] = {}
        sfl_t = statistics.mean(run[-1]["elapsed_s"] for run in by_method["SFL"]) if "SFL" in by_method else None
        for m, runs in by_method.items():
            finals = [statistics.mean(r["accuracy"] for r in run[-3:]) for run in runs]
            t = statistics.mean(run[-1]["elapsed_s"] for run in runs)
            up = statistics.mean(run[-1]["bytes_up"] for run in runs)
            mean, std = statistics.mean(finals), (statistics.pstdev(finals) if len(finals) > 1 else 0.0)
            summary[setting][m] = {"final_accuracy_mean": mean, "final_accuracy_std": std, "finals": finals,
                                   "virtual_time_s": t, "time_reduction_vs_sfl": (sfl_t / t) if sfl_t else None,
                                   "last_round_bytes_up": up}
            rows.append([setting, m, f"{100 * mean:.2f} ± {100 * std:.2f}", f"{t:.0f}",
                         common.fmt(sfl_t / t if sfl_t else None)])
    common.print_table("HeteroSFL comparison (virtual clock)", ["setting", "method", "acc %", "virtual s",
                                                                "time ÷ vs SFL"], rows,
                       caption=f"{args.agents} agents, vgg_mini split 3, {args.rounds} rounds, tau {args.tau}, "
                               f"batch {args.batch}, {args.seeds} seed(s); wall {time.time() - t_start:.0f} s")
    # Table 1 layout: one row per method, one column per (reduction, high share), per alpha
    table1 = {}
    for setting in curves:
        for m, v in summary[setting].items():
            table1.setdefault(m, {})[setting] = round(100 * v["final_accuracy_mean"], 2)
    state = next((r["model_state"] for r in results if "model_state" in r), None)
    per_codec = bytes_per_sample(state, args) if state is not None else []
    if per_codec:
        common.print_table("Wire bytes per sample at vgg_mini split 3 (activation up + gradient down)",
                           ["width", "codec", "up B", "down B", "reduction"],
                           [[r["width"], r["codec"], f"{r['up_bytes']:.0f}", f"{r['down_bytes']:.0f}",
                             f"{r['reduction_vs_sfl_fp32']:.1f}x"] for r in per_codec])

    payload = {"benchmark": "heterosfl", "config": common.config_record(args),
               "summary": summary, "table1": table1, "bytes_per_sample": per_codec, "curves": curves,
               "methods": {m: all_methods[m] for m in chosen}}
    path = common.write_result(args.out, "heterosfl-quick" if args.quick else "heterosfl", payload,
                               torch.device("cpu"))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
