"""The server's validation set scored by every server worker (``--server-workers N``).

Between two rounds only the leader works: it aggregates, scores the new model, records the
round and sends the next round's assignments, while the other workers and every agent wait.
On a CPU scoring is often the largest part of that time (the whole model, its convolutions
included, over the validation set), and it divides: each rank scores one block of the set (every rank
holds the same set), and the leader adds the blocks' sums up (:class:`~coordinator.validation.Score`).

The leader broadcasts what to score (the split whose held-out rows the screens keep, the
screens' draw, the bottlenecks' widths) and the model to score (the global model, or the one
a training option delivers); each rank scores its block and sends back its sums and the client
portion's rows of the draw's samples in its block, which the leader puts in the draw's order.
The accuracy is the one-process accuracy; the loss the same sum taken in another order (to float
rounding).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Optional

import torch

from coordinator.validation import Score

if TYPE_CHECKING:
    from coordinator.server_workers import ServerShards
    from coordinator.validation import ValidationSet
    from sfl_core.model.zoo import SplitModel

__all__ = ["block", "lead", "follow"]


def block(total: int, rank: int, world: int) -> slice:
    """The samples rank ``rank`` of ``world`` scores, of a set of ``total``: contiguous blocks
    whose sizes differ by one at most, in rank order."""
    return slice(total * rank // world, total * (rank + 1) // world)


def lead(shards: "ServerShards", validation: "ValidationSet", model: "SplitModel", split: Optional[int],
         draw: Optional[torch.Tensor], device: torch.device, batch_size: int
         ) -> tuple[Optional[float], Optional[float], Optional[torch.Tensor]]:
    """The leader's side: accuracy and mean loss of ``model`` on the whole set, and with a
    ``split``, the client portion's rows of the samples at ``draw`` (in its order; None without)."""
    shards.broadcast({"score": {"split": split, "draw": None if draw is None else draw.tolist(),
                                "infer_widths": {k: pair.infer_width for k, pair in model.bottlenecks.items()}}})
    shards.broadcast_model(model)
    doc, own = _part(shards, validation, model, split, draw, device, batch_size)
    parts = shards.gather(doc)
    n = len(validation)
    blocks = [len(range(n)[block(n, rank, shards.world)]) for rank in range(shards.world)]
    if [int(p["count"]) for p in parts] != blocks:
        raise RuntimeError(f"the server workers scored blocks of {[p['count'] for p in parts]} samples where the "
                           f"leader's validation set of {n} makes {blocks}: every rank must hold the same set")
    total = Score(0, 0.0, 0)
    for p in parts:
        total += Score(int(p["correct"]), float(p["loss"]), int(p["count"]))
    accuracy, loss = total.means()
    if split is None or draw is None:
        return accuracy, loss, None
    rows: Optional[torch.Tensor] = None
    for rank, p in enumerate(parts):   # each rank's rows, of the draw's samples in its block
        if p["rows"] is None:
            continue
        got = own if rank == 0 else shards.receive(rank, p["rows"], _DTYPES[p["dtype"]])
        assert got is not None
        if rows is None:
            rows = torch.empty((len(draw), *got.shape[1:]), dtype=got.dtype, device=device)
        rows[_in_block(draw, len(validation), rank, shards.world)[0].to(device)] = got.to(device)
    return accuracy, loss, rows


def follow(shards: "ServerShards", validation: "ValidationSet", model: "SplitModel", doc: dict[str, Any],
           device: torch.device, batch_size: int) -> slice:
    """A worker's side of :func:`lead`, from the leader's broadcast ``doc`` (its ``score``):
    the leader's model on a copy of this rank's (its own stays the round's), its block scored;
    returns the block."""
    scored = copy.deepcopy(model)
    for key, width in doc["infer_widths"].items():
        scored.bottlenecks[key].infer_width = int(width)  # type: ignore[assignment]  # a Bottleneck
    shards.broadcast_model(scored)
    draw = None if doc["draw"] is None else torch.tensor(doc["draw"], dtype=torch.long)
    part, rows = _part(shards, validation, scored, doc["split"], draw, device, batch_size)
    shards.gather(part)
    if rows is not None:
        shards.send_to_leader(rows)
    return block(len(validation), shards.rank, shards.world)


_DTYPES = {str(t).split(".")[-1]: t for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


def _in_block(draw: torch.Tensor, total: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions in ``draw`` of its samples in rank ``rank``'s block, and those samples'
    indices counted from the block's first."""
    part = block(total, rank, world)
    start = part.start or 0
    mine = ((draw >= start) & (draw < part.stop)).nonzero().flatten()
    return mine, draw[mine] - start


def _part(shards: "ServerShards", validation: "ValidationSet", model: "SplitModel", split: Optional[int],
          draw: Optional[torch.Tensor], device: torch.device, batch_size: int
          ) -> tuple[dict[str, Any], Optional[torch.Tensor]]:
    """This rank's block scored: the sums as they travel to the leader (with the shape and dtype
    of the rows that follow them, with a ``split``), and the client portion's rows of the draw's
    samples in the block (None where there are none)."""
    part = block(len(validation), shards.rank, shards.world)
    rows: Optional[torch.Tensor] = None
    if split is None or draw is None:
        score = validation.score(model, device, batch_size, part)
    else:
        at, index = _in_block(draw, len(validation), shards.rank, shards.world)
        score, rows = validation.score_at_cut(model, split, index, device, batch_size, part)
        if not len(at):
            rows = None
    return {"correct": score.correct, "loss": score.loss, "count": score.count,
            "rows": None if rows is None else list(rows.shape),
            "dtype": None if rows is None else str(rows.dtype).split(".")[-1]}, rows
