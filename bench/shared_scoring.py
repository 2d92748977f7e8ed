"""Scoring shared among server workers: how long the score between two rounds takes with N ranks.

Command (a few minutes on 2 CPU cores)::

    python bench/shared_scoring.py                        # 1 and 2 ranks, 256 and 10000 samples
    python bench/shared_scoring.py --ranks 1 2 4 --samples 256 10000   # a machine with 4 free cores
    python bench/shared_scoring.py --quick                # smoke-test size, numbers not meaningful

Writes ``bench/results/shared_scoring.json``.

The user's question: between two rounds only the coordinator's rank 0 works while every agent
waits, and on a CPU the score of the round's model on the validation set is the largest part of
that time (``bench/coordinator_load.py``'s "between rounds"). With ``sfl-coord serve
--server-workers N`` each rank scores a block of the set (``coordinator/shard_scoring.py``):
how much shorter is the score?

What runs, per validation-set size and rank count N: N processes in one gloo group on this
machine, each on one torch thread with the allocator setting ``sfl-coord serve`` uses, each
holding the first ``--samples`` of the data set's test split. Rank 0 times
``shard_scoring.lead`` (the model and what to score broadcast, its own block scored, every
rank's sums and the client portion's rows of the screens' draw gathered and put in order); the
others answer with ``shard_scoring.follow``. The model is the bench's ``--model``, scored at its
default split as ``sfl-coord serve`` scores it when the robust screens read held-out rows there
(the default).

The reference, in the same processes: rank 0 also scores the whole set alone, as a coordinator
with one server worker does (``ValidationSet.evaluate_at_cut``), in turns with the shared score
while the other ranks wait. Columns: ``one process ms`` and ``shared ms`` (medians of
``--repeats`` after a warm-up), ``x one process`` (the first over the second), and ``ideal x``
(N: perfect division, nothing shared). Each rank needs a core of its own: a machine with fewer
cores than ranks shows the cores, not the code.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (bench helper; also puts the repo root on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from coordinator import shard_scoring  # noqa: E402
from coordinator.allocator import keep_freed_memory  # noqa: E402
from coordinator.option_host import LABELLED_REFERENCE_ROWS  # noqa: E402
from coordinator.server_workers import ServerShards  # noqa: E402
from coordinator.validation import ValidationSet, evaluation_batch, screen_draw  # noqa: E402
from sfl_core.model.accounting import split_costs  # noqa: E402
from sfl_core.model.zoo import build_model  # noqa: E402

CPU = torch.device("cpu")


def _setting(args: Any, samples: int) -> tuple[Any, ValidationSet, int, torch.Tensor, int]:
    """What every rank and the reference score: the model, the set, the split, the draw, the batch."""
    torch.set_num_threads(1)
    keep_freed_memory()
    data = common.load_data(args.data)
    torch.manual_seed(args.seed)
    model = build_model(args.model, data.input_shape, data.num_classes)
    held = ValidationSet(data.x_test, data.y_test, limit=samples)
    split = model.default_split
    costs = split_costs(model)
    batch = evaluation_batch(max(c.activation_bytes for c in costs.values()), CPU)
    return model, held, split, screen_draw(len(held), LABELLED_REFERENCE_ROWS), batch


def _paired_times(fns: list[Any], repeats: int) -> list[list[float]]:
    """Each of ``fns`` timed ``repeats`` times, taking turns (this shared machine's speed drifts
    within a minute: turns compare them at the same moments), after one untimed call each (the
    channels-last copy of the set, the first allocations)."""
    for fn in fns:
        fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, out):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return out


def _rank(rank: int, world: int, init: str, args: Any, samples: int, out: str) -> None:
    model, held, split, draw, batch = _setting(args, samples)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    shards = ServerShards(rank, world, CPU)
    if rank == 0:   # the workers wait in the next broadcast while the leader scores alone
        times = _paired_times([lambda: held.evaluate_at_cut(model, split, draw, CPU, batch),
                               lambda: shard_scoring.lead(shards, held, model, split, draw, CPU, batch)], args.repeats)
        shards.broadcast(None)
        Path(out).write_text(json.dumps({"alone": times[0], "shared": times[1], "samples": len(held)}))
    else:
        while (doc := shards.broadcast()) is not None:
            shard_scoring.follow(shards, held, model, doc["score"], CPU, batch)
    shards.close()


def measure(args: Any, samples: int, ranks: int) -> dict[str, Any]:
    """Rank 0's times of the score alone (one process's way) and shared with ``ranks`` processes."""
    with tempfile.TemporaryDirectory(prefix="sfl-bench-scoring-") as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_rank, args=(ranks, f"file://{tmp}/pg", args, samples, out), nprocs=ranks, join=True,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--model", default="small_cnn", help="zoo model (default small_cnn)")
    p.add_argument("--samples", type=int, nargs="+", default=[256, 10000],
                   help="validation samples (eval_samples; default 256, and 10000: all of a test split of that "
                        "size, as eval_samples' default scores)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="server workers (default 1 2)")
    p.add_argument("--repeats", type=int, default=10, help="timed scores of each kind per setting (default 10)")
    args = p.parse_args()
    if args.quick:
        args.samples, args.ranks, args.repeats = [64], [1, 2], 3
    rows, results = [], []
    for samples in args.samples:
        for n in args.ranks:
            got = measure(args, samples, n)
            alone, shared = (1e3 * statistics.median(got[k]) for k in ("alone", "shared"))
            rows.append((got["samples"], n, alone, shared, alone / shared, float(n)))
            results.append({"samples": got["samples"], "ranks": n, "alone_ms_p50": alone, "shared_ms_p50": shared,
                            "x_one_process": alone / shared, "alone_ms": [1e3 * t for t in got["alone"]],
                            "shared_ms": [1e3 * t for t in got["shared"]]})
    common.print_table(f"the score of {args.model} at its default split, shared among server workers "
                       f"(gloo on the CPU, one thread a rank, {os.cpu_count()} cores)",
                       ["samples", "ranks", "one process ms", "shared ms", "x one process", "ideal x"], rows,
                       caption="medians; one process: scored as a coordinator with one server worker does, "
                               "timed in turns with the shared score on rank 0")
    path = common.write_result(args.out, "shared_scoring" + ("_quick" if args.quick else ""),
                               {"config": common.config_record(args),
                                "reference": "one process scoring the whole set (ValidationSet.evaluate_at_cut), "
                                             "timed in turns with the shared score on rank 0",
                                "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
