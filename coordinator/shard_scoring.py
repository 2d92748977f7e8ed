"""The server's validation set scored by every server worker (``--server-workers N``).

Between two rounds only the leader works: it aggregates, scores the new model, records the
round and sends the next round's assignments, while the other workers and every agent wait.
Scoring is the largest part of that time on a CPU (the whole model, its convolutions included,
over the validation set), and it divides: each rank scores one block of the set (every rank
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
from sfl_core.wire import codec as wire

if TYPE_CHECKING:
    from coordinator.server_workers import ServerShards
    from coordinator.validation import ValidationSet
    from sfl_core.model.zoo import SplitModel

__all__ = ["block", "lead", "follow"]

_ROWS_MAX_BYTES = 1 << 40
"""The rows come from this run's own ranks, as large as the draw at the cut makes them."""


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
    parts = shards.gather(_part(shards, validation, model, split, draw, device, batch_size))
    total = Score(0, 0.0, 0)
    for p in parts:
        total += Score(int(p["correct"]), float(p["loss"]), int(p["count"]))
    accuracy, loss = total.means()
    if split is None or draw is None:
        return accuracy, loss, None
    rows: Optional[torch.Tensor] = None
    for p in parts:
        if not p["at"]:
            continue
        got = wire.decode_tensor(p["rows"], shape=(len(p["at"]), *([None] * (len(p["rows"]["shape"]) - 1))),
                                 dtypes=("float32",), max_bytes=_ROWS_MAX_BYTES)
        if rows is None:
            rows = torch.empty((len(draw), *got.shape[1:]), dtype=got.dtype)
        rows[torch.tensor(p["at"], dtype=torch.long)] = got
    return accuracy, loss, None if rows is None else rows.to(device)


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
    shards.gather(_part(shards, validation, scored, doc["split"], draw, device, batch_size))
    return block(len(validation), shards.rank, shards.world)


def _part(shards: "ServerShards", validation: "ValidationSet", model: "SplitModel", split: Optional[int],
          draw: Optional[torch.Tensor], device: torch.device, batch_size: int) -> dict[str, Any]:
    """This rank's block scored, as it travels to the leader: the sums, and with a ``split`` the
    positions in ``draw`` of the draw's samples in the block and their rows."""
    part = block(len(validation), shards.rank, shards.world)
    if split is None or draw is None:
        score, at, rows = validation.score(model, device, batch_size, part), [], None
    else:
        start = part.start or 0
        mine = ((draw >= start) & (draw < part.stop)).nonzero().flatten()
        score, rows = validation.score_at_cut(model, split, draw[mine] - start, device, batch_size, part)
        at = mine.tolist()
    return {"correct": score.correct, "loss": score.loss, "count": score.count, "at": at,
            "rows": wire.encode_tensor(rows, "fp32", 0) if rows is not None and at else None}
