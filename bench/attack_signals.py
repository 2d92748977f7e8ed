"""Would the server see a device that flips its labels? Per-device statistics of the server's step.

The user's question (and the designer's, before building a defense of the server portion on
them): "on my label-skewed fleet, does a device training on flipped labels stand out from
honest devices by its loss on the server, or by how often the global model gets its rows
right?" The fleet of ``bench/attacks.py`` (20 simulated devices on the 8×8 digits at
Dirichlet 0.1, 10 a round, one merged server copy, 15 rounds) trains with its first 30 %
flipping labels (``c -> 9 - c``) under the plain mean without the label screen; the server's loss is instrumented to
record, at each round's first step (the round's global model, before it trains on the
round's rows), each device's mean loss over the round's median and the share of its rows
the model predicts right. Reference in the same run: the honest devices' ranges. A statistic
separates the flippers where their range does not overlap the honest one.

    python bench/attack_signals.py --seeds 2
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import common  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def run_one(seed: int, work: Path, rounds: int = 15) -> dict[str, Any]:
    from coordinator import server_trainer
    from sfl_core.config.run import run_config_from_dict
    from simulation import run_simulation
    from simulation.adversary import Attack

    steps: list[dict[str, tuple[float, float]]] = []   # per server step: device -> (loss, accuracy)
    loss = server_trainer.ServerTrainer._loss

    def recorded(self, group, order, inputs, logits, y):   # the server's own loss, per device's rows
        per_row = F.cross_entropy(logits.detach(), y, reduction="none")
        right = (logits.detach().argmax(1) == y).float()
        pos, rec = 0, {}
        for a in order:
            b = inputs[a].shape[0]
            rec[a] = (float(per_row[pos:pos + b].mean()), float(right[pos:pos + b].mean()))
            pos += b
        steps.append(rec)
        return loss(self, group, order, inputs, logits, y)

    server_trainer.ServerTrainer._loss = recorded
    try:
        attackers = [f"sim-{i:03d}" for i in range(6)]
        cfg = run_config_from_dict({
            "run": "signals", "model": "small_cnn", "strategy": "sfl", "server_mode": "merged",
            "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.1, "seed": seed},
            "fleet": [{"profile": "s2fl-mid-mid", "count": 20}], "per_round": 10, "rounds": rounds, "batch_size": 32,
            "lr": 0.05, "local_iters": 10, "seed": seed, "robust": {"aggregate": "mean", "label_margin": 0},
            "output_dir": str(work / f"signals-s{seed}")})
        run_simulation(cfg, device="cpu", attacks={a: Attack("label_flip") for a in attackers})
    finally:
        server_trainer.ServerTrainer._loss = loss
    firsts = steps[::cfg.local_iters]
    out: dict[str, dict[str, list[float]]] = {"flippers": {"loss": [], "accuracy": []},
                                              "honest": {"loss": [], "accuracy": []}}
    for rec in firsts:
        median = statistics.median(v[0] for v in rec.values())
        for a, (mean_loss, acc) in rec.items():
            side = out["flippers" if a in attackers else "honest"]
            side["loss"].append(mean_loss / median)
            side["accuracy"].append(acc)
    return {"seed": seed, **{side: {k: [min(v), max(v)] for k, v in stats.items()} for side, stats in out.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("/tmp/sfl-bench-attack-signals"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = [run_one(args.seed + s, args.work, 2 if args.quick else 15) for s in range(1 if args.quick else args.seeds)]
    rows = []
    for stat in ("loss", "accuracy"):
        flip = [min(r["flippers"][stat][0] for r in runs), max(r["flippers"][stat][1] for r in runs)]
        honest = [min(r["honest"][stat][0] for r in runs), max(r["honest"][stat][1] for r in runs)]
        rows.append({"statistic": stat, "flippers": flip, "honest": honest,
                     "separates": flip[0] > honest[1] or flip[1] < honest[0]})
    common.print_table("per-device statistics at a round's first server step (loss: over the round's median)",
                       ["statistic", "flippers' range", "honest range", "separates"],
                       [[r["statistic"], f"{r['flippers'][0]:.2f}–{r['flippers'][1]:.2f}",
                         f"{r['honest'][0]:.2f}–{r['honest'][1]:.2f}", r["separates"]] for r in rows])
    payload = {"config": common.config_record(args), "reference": "the honest devices' ranges in the same runs",
               "results": rows, "runs": runs}
    path = common.write_result(args.out, "attack_signals" + ("-quick" if args.quick else ""), payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
