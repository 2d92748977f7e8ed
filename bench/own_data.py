"""Your devices' own folders: how close does training over the fleet get to training on the
union of their data in one place, and which method gets there first?

The user's question: "my devices each hold their own photos, in unequal numbers and with
different label mixes; if I could pool them I would train centrally. Over the fleet, which
method (FedAvg, split learning, auto) reaches what accuracy, and how soon?"

The bench writes such a fleet to disk from real Fashion-MNIST images (``../shared/datasets``
or ``--data``): ``--devices`` image folders ``dev-k/train/<class>/*.png`` of unequal sizes
(largest first, halving towards the smallest) with label skew (each device's class mix drawn
from a Dirichlet with ``--alpha``), device profiles cycling over Raspberry Pi 4, Jetson Nano
and Jetson Xavier NX, and a server validation folder from the official test set. Then, for
each seed:

- **central** (the reference): the union of the devices' training images, read through the
  same loaders and standardised with the same constants, trained in a plain PyTorch loop
  with the same model, batch size and learning rate for as many samples as a fleet round
  trains times the rounds;
- **FedAvg**, **SFL** (split at the model's default cut, merged server batch) and **auto**:
  ``sfl-coord simulate`` of the run config, with the devices' folders as their data
  (``normalize: federated``, the server folder as ``eval.data``).

Reported per method: final and best accuracy on the server folder, the virtual time (device
profiles' time model) to reach 90 % and 95 % of central's final accuracy (``--targets``) and
for all rounds, and host wall time.

    python bench/own_data.py                      # full: 6 devices, 30 rounds, 2 seeds
    python bench/own_data.py --quick              # smoke test
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

import common  # noqa: E402  (puts the repo root on sys.path)

from sfl_core.config.run import load_run_config  # noqa: E402
from sfl_core.data.builtin import _read_mnist_dir  # noqa: E402
from sfl_core.data.local import load_local  # noqa: E402
from sfl_core.model.zoo import build_model  # noqa: E402
from sfl_core.data.preprocessing import ChannelStats  # noqa: E402

CLASSES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
PROFILES = ("rpi4", "jetson-nano", "jetson-xavier-nx")
METHODS = {"FedAvg": {"strategy": "fedavg"}, "SFL": {"strategy": "sfl"}, "auto": {"strategy": "auto"}}


def write_fleet(root: Path, raw: tuple[np.ndarray, ...], devices: int, largest: int, val: int, alpha: float,
                seed: int) -> dict[str, Any]:
    """Label-skewed device folders of unequal sizes and the server's validation folder (PNG)."""
    from PIL import Image

    xtr, ytr, xte, yte = raw
    rng = np.random.default_rng(seed)
    by_class = [list(rng.permutation(np.flatnonzero(ytr == c))) for c in range(10)]
    sizes = [max(largest >> k, 50) for k in range(devices)]
    info = []
    for k, n in enumerate(sizes):
        mix = rng.dirichlet([alpha] * 10)
        want = rng.multinomial(n, mix)
        folder = root / f"dev-{k}" / "train"
        counts = [0] * 10
        for c in range(10):
            for i in [by_class[c].pop() for _ in range(min(int(want[c]), len(by_class[c])))]:
                out = folder / CLASSES[c]
                out.mkdir(parents=True, exist_ok=True)
                Image.fromarray(xtr[i, 0], "L").save(out / f"{i}.png")
                counts[c] += 1
        info.append({"device": f"dev-{k}", "profile": PROFILES[k % len(PROFILES)], "samples": sum(counts),
                     "label_counts": counts})
    pick = rng.permutation(len(yte))[:val]
    for i in pick:
        out = root / "server" / "val" / CLASSES[int(yte[i])]
        out.mkdir(parents=True, exist_ok=True)
        Image.fromarray(xte[i, 0], "L").save(out / f"{i}.png")
    return {"devices": info, "validation": len(pick)}


def run_config(root: Path, fleet: list[dict[str, Any]], args: Any, seed: int, method: dict[str, Any]) -> Path:
    cfg = {"run": "own-data", "model": args.model, "rounds": args.rounds, "local_iters": args.local_iters,
           "batch_size": args.batch_size, "lr": args.lr, "momentum": 0.9, "seed": seed,
           "task": {"classes": CLASSES, "input_shape": [1, 28, 28], "normalize": "federated"},
           "eval": {"data": str(root / "server")},
           "fleet": [{"profile": d["profile"], "data": str(root / d["device"])} for d in fleet],
           "output_dir": str(root / "runs" / f"{method['strategy']}-{seed}"), **method}
    path = root / f"{method['strategy']}-{seed}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def central(root: Path, fleet: list[dict[str, Any]], args: Any, seed: int, samples: int) -> dict[str, Any]:
    """The reference: one plain loop over the union of the devices' data."""
    cfg = load_run_config(run_config(root, fleet, args, seed, {"strategy": "sfl"}))
    parts = [load_local(root / d["device"], cfg.task).train for d in fleet]
    norm = ChannelStats.combine(ChannelStats.of(p.x) for p in parts)
    x = norm.apply(torch.cat([p.x for p in parts]))
    y = torch.cat([p.y for p in parts])
    held = load_local(root / "server", cfg.task).train
    xv, yv = norm.apply(held.x), held.y
    torch.manual_seed(seed)
    model = build_model(args.model, (1, 28, 28), 10)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    done, curve = 0, []
    per_eval = samples // args.rounds
    while done < samples:
        idx = torch.randint(len(y), (args.batch_size,), generator=gen)
        model.train()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += args.batch_size
        if done // per_eval > len(curve):
            model.eval()
            with torch.no_grad():
                curve.append(float((model(xv).argmax(1) == yv).float().mean()))
    return {"final": curve[-1], "best": max(curve), "curve": curve, "wall_s": time.perf_counter() - t0,
            "samples": done}


def fleet_run(root: Path, fleet: list[dict[str, Any]], args: Any, seed: int, method: dict[str, Any]) -> dict[str, Any]:
    from simulation import run_simulation

    t0 = time.perf_counter()
    history, _ = run_simulation(load_run_config(run_config(root, fleet, args, seed, method)), quiet=True)
    trained = [h for h in history if h["round"] > 0]
    return {"final": trained[-1]["accuracy"], "best": max(h["accuracy"] for h in trained),
            "curve": [h["accuracy"] for h in trained], "elapsed_s": [h["elapsed_s"] for h in trained],
            "wall_s": time.perf_counter() - t0}


def time_to(run: dict[str, Any], target: float) -> float | None:
    return next((t for a, t in zip(run["curve"], run["elapsed_s"]) if a >= target), None)


def main() -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--devices", type=int, default=6)
    p.add_argument("--largest", type=int, default=4000, help="images on the largest device (halving per device)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew (small = severe)")
    p.add_argument("--val", type=int, default=2000, help="server validation images")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--local-iters", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--targets", type=float, nargs="+", default=[0.9, 0.95],
                   help="fractions of central's final accuracy to reach")
    p.add_argument("--work", type=Path, default=None, help="where the folders go (default: a temporary folder)")
    args = p.parse_args()
    if args.quick:
        args.devices, args.largest, args.val, args.rounds, args.local_iters, args.seeds = 3, 200, 200, 2, 5, 1
    common.apply_threads(args)
    data = Path(args.data)
    if not data.is_dir():
        raise SystemExit(f"--data {args.data}: this bench reads Fashion-MNIST's idx files from a folder "
                         f"(default {common.DEFAULT_FASHION_MNIST})")
    raw = _read_mnist_dir(data)
    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="sfl-own-data-") as tmp:
        for seed in range(args.seeds):
            root = (args.work or Path(tmp)) / f"seed{seed}"
            layout = write_fleet(root, raw, args.devices, args.largest, args.val, args.alpha, seed)
            fleet = layout["devices"]
            samples = args.rounds * args.local_iters * args.batch_size * len(fleet)
            ref = central(root, fleet, args, seed, samples)
            print(f"seed {seed}: central {ref['final']:.4f} ({ref['wall_s']:.0f} s)", flush=True)
            entry = {"seed": seed, "fleet": layout, "central": ref, "methods": {}}
            for name, method in METHODS.items():
                run = fleet_run(root, fleet, args, seed, method)
                run["time_to_s"] = {str(t): time_to(run, t * ref["final"]) for t in args.targets}
                entry["methods"][name] = run
                print(f"seed {seed}: {name} {run['final']:.4f} (virtual {run['elapsed_s'][-1]:.0f} s, "
                      f"{run['wall_s']:.0f} s wall)", flush=True)
            results.append(entry)
    def reach(runs: list[dict[str, Any]], t: float) -> Any:
        """Seed-mean virtual seconds to the target, or how many seeds reached it at all."""
        times = [r["time_to_s"][str(t)] for r in runs]
        return statistics.mean(times) if all(v is not None for v in times) else \
            f"{sum(v is not None for v in times)}/{len(times)} seeds"

    for name in ("central", *METHODS):
        runs = [r["central"] if name == "central" else r["methods"][name] for r in results]
        fleet_cols = ["-"] * (len(args.targets) + 1) if name == "central" else \
            [reach(runs, t) for t in args.targets] + [statistics.mean(r["elapsed_s"][-1] for r in runs)]
        rows.append([name, statistics.mean(r["final"] for r in runs), statistics.mean(r["best"] for r in runs),
                     statistics.mean(r["final"] for r in runs) - statistics.mean(r["central"]["final"]
                                                                               for r in results),
                     *fleet_cols, statistics.mean(r["wall_s"] for r in runs)])
    common.print_table(f"own data: {args.devices} devices' folders (Fashion-MNIST, alpha {args.alpha}), "
                       f"{args.rounds} rounds, {args.seeds} seed(s)",
                       ["method", "final acc", "best acc", "vs central",
                        *(f"virtual s to {t:g}x central" for t in args.targets), f"virtual s, {args.rounds} rounds",
                        "host wall s"], rows,
                       caption="virtual s: device profiles' time model (seed mean); central has no fleet time")
    path = common.write_result(args.out, "own_data", {
        "config": common.config_record(args),
        "reference": "central: a plain PyTorch loop over the union of the devices' data, same model, batch, lr, "
                     "samples and standardisation",
        "results": results,
        "summary": [dict(zip(("method", "final", "best", "vs_central",
                              *(f"time_to_{t:g}x_central_s" for t in args.targets), "virtual_s", "wall_s"), r))
                    for r in rows]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
