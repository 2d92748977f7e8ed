"""How much of a run's accuracy its BatchNorm statistics cost.

A federated model's BatchNorm running statistics are averaged with its weights. When every
device sees a few classes, and with HeteroSFL's narrow and wide bottlenecks sharing the
server's layers, those averages describe no input the aggregated weights will see, and the
model is evaluated with the wrong normalisation. This script takes finished run directories
(``checkpoint.pt`` + ``state.json``), recomputes every BatchNorm layer's statistics from
``--samples`` training images passed through the aggregated model, and evaluates again on
the same test slice the run used:

    python bench/norm_stats.py /tmp/sfl-paper-heterosfl/16:1-HetBL_64x-s0 ... --image-size 32

The recomputation is a diagnostic, not something a deployment can do as is: the coordinator
holds no training images. A large gap says the run's accuracy is limited by normalisation,
not by what the method learned (docs/methods/round.md, "Which normalisation").
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

import common  # noqa: E402  (puts the repo root on sys.path)

from coordinator import state as checkpoint  # noqa: E402
from coordinator.export import rebuild_model  # noqa: E402
from sfl_core.data.builtin import Dataset, load_dataset  # noqa: E402
from sfl_core.option_registry import delivered_weights  # noqa: E402
from sfl_core.options.base import split_state  # noqa: E402


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    model.eval()
    correct = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum()) for i in range(0, len(y), batch))
    return correct / max(len(y), 1)


@torch.no_grad()
def recompute_batch_norm(model: nn.Module, x: torch.Tensor, batch: int = 250) -> None:
    """Replace every BatchNorm layer's running statistics by the plain average over ``x``
    (``momentum=None``), with the rest of the model in evaluation mode."""
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in layers]
    model.eval()
    for m in layers:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    for i in range(0, len(x), batch):
        model(x[i:i + batch])
    for m, momentum in zip(layers, saved):
        m.momentum = momentum
    model.eval()


def load_run_model(run_dir: Path) -> nn.Module:
    """The aggregated model a finished run left (weights only, no pickle)."""
    weights, state = checkpoint.load(run_dir)
    model = rebuild_model(state["model_info"])
    model.load_state_dict(delivered_weights(*split_state(weights)))   # what the run delivers: with model_ema, the average
    return model


def calibration_slices(data: Dataset, samples: int, eval_samples: int | None, seed: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``samples`` random training images (fixed seed) and the run's test slice (the first ``eval_samples``)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(data.y_train), generator=g)[:samples]
    n = len(data.y_test) if eval_samples is None else eval_samples
    return data.x_train[idx], data.x_test[:n], data.y_test[:n]


def compare(run_dirs: Sequence[Path], data: Dataset, samples: int = 3000, eval_samples: int | None = 2000
            ) -> dict[str, tuple[float, float] | None]:
    """Per run directory: (accuracy as run, accuracy with statistics recomputed), or ``None``
    where the model has no BatchNorm or the run left no checkpoint."""
    x_cal, x_test, y_test = calibration_slices(data, samples, eval_samples)
    out: dict[str, tuple[float, float] | None] = {}
    for d in run_dirs:
        if not (d / "checkpoint.pt").is_file():
            out[str(d)] = None
            continue
        model = load_run_model(d)
        if not has_batch_norm(model):
            out[str(d)] = None
            continue
        before = accuracy(model, x_test, y_test)
        recompute_batch_norm(model, x_cal)
        out[str(d)] = (before, accuracy(model, x_test, y_test))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="finished run directories")
    p.add_argument("--data", default=common.default_data())
    p.add_argument("--image-size", type=int, default=None, help="the size the run resized its images to")
    p.add_argument("--samples", type=int, default=3000, help="training images for the statistics")
    p.add_argument("--eval-samples", type=int, default=2000, help="the run's eval_samples (0 = whole test set)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    common.apply_threads(args)
    root = Path(args.data)
    data = load_dataset("fashion-mnist" if root.is_dir() else args.data, root if root.is_dir() else None,
                        image_size=args.image_size)
    rows = []
    for d, r in compare(args.runs, data, args.samples, args.eval_samples or None).items():
        rows.append([d, "—", "—"] if r is None else [d, f"{100 * r[0]:.1f}", f"{100 * r[1]:.1f}"])
    common.print_table("Accuracy with the BatchNorm statistics the run averaged, and recomputed",
                       ["run", "as run %", "recomputed %"], rows,
                       caption=f"statistics from {args.samples} training images")


if __name__ == "__main__":
    main()
