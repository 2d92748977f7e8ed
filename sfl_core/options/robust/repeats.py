"""A row sent twice: found by equality, counted once by the label screen and trained once by
the server's step.

A device holding fewer samples than its batch sends each of them several times in a step (its
sampler wraps around its data). Counted as rows, its few images are many pieces of evidence
(:mod:`sfl_core.options.robust.labels`) and weigh in the server's step like a device's batch of
distinct images: a backdoor on 16 images in batches of 32 trained the server's layers on each
triggered image twice a step, as much as a device of 32 images. Trained once, a device weighs in
the server's step by the images it showed, at most its batch. Each copy gets back the gradient
of the row it repeats (in one step identical rows have identical gradients), scaled so the
device's gradient is still that of its mean loss over the rows it sent: where the server's
layers hold no BatchNorm, exactly what it got before; with BatchNorm, the batch's statistics
are now of the rows trained on.
"""

from __future__ import annotations

from typing import Optional

import torch

from sfl_core.options.base import RowsTrained

__all__ = ["repeats"]


def repeats(rows: torch.Tensor, labels: torch.Tensor) -> Optional[RowsTrained]:
    """Where ``rows`` (N, ...) with their ``labels`` repeat an identical (row, label) pair: each
    pair's first row, and for every row the position among those of the one it repeats; None
    where none repeats. Identical inputs in one batch come out of the client portion identical,
    BatchNorm included (one batch, one set of statistics), and so through the codec: what a
    device sent twice is found by equality.

    Cost: each row's largest element first, compared as (peak, label) pairs; only a step where
    two pairs agree is compared row by row. Identical rows share their peak exactly (a maximum
    does not round), and a device's rows of distinct images almost never do, so a step reads
    its rows once instead of sorting them."""
    flat = rows.detach().flatten(1)
    if len(flat) < 2:
        return None
    pairs = list(zip(flat.amax(1).tolist(), labels.tolist()))
    if len(set(pairs)) == len(pairs):
        return None
    keyed = torch.cat([flat.float(), labels.reshape(-1, 1).to(flat.device).float()], 1)
    _, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    inverse = inverse.cpu()
    first = torch.full((int(inverse.max()) + 1,), len(inverse), dtype=torch.long)
    first = first.scatter_reduce(0, inverse, torch.arange(len(inverse)), "amin")
    if len(first) == len(inverse):
        return None
    kept, order = first.sort()
    position = torch.empty_like(order)
    position[order] = torch.arange(len(order))   # unique's group -> its place among the kept rows
    return RowsTrained(kept, position[inverse])
