"""The server portion's screen: which devices' activations a server step leaves out.

In split learning a device reaches the server's layers through its activations: rows scaled
or noised by a device that lies pass through the server copy's forward, and in a merged batch
they skew its BatchNorm statistics for every other device's rows too, before any loss is
computed. So the screen runs before the forward, on what the step received.

The statistic is each device's activations' root mean square, against the median of the
devices that sent rows at the same cut (the same split and bottleneck width: activations
from different layers have different scales). Honest devices at one cut produce activations
of one scale whatever their labels, since they run the same client portion on inputs
normalised alike, so label skew does not look like an attack here; a device whose
activations are ``factor`` times larger or smaller than its cut's median is an outlier.

A cut fewer than three devices share has no typical scale and is not screened. The median
is an honest device's while fewer than half of the step's devices lie; in a step where most do
(a round that happened to select most of a fleet's attackers), the median the cut's accepted
devices sent in the previous step, and the coordinator's own activations on its held-out inputs,
keep the typical scale where the honest devices are (:func:`typical_size`).

What the statistic cannot see: activations of the right scale but the wrong content (and
labels flipped or a backdoor's trigger, which leave the activations' scale alone).
"""

from __future__ import annotations

import math
from typing import Hashable, Mapping, Optional, Sequence, TypeVar

import torch

__all__ = ["MIN_HOLDERS", "cut_sizes", "far_rows", "rms", "typical_size"]

Cut = TypeVar("Cut", bound=Hashable)

MIN_HOLDERS = 3
"""Devices that must share a cut for it to have a typical scale."""


def rms(x: torch.Tensor) -> float:
    """The root mean square of ``x``'s elements (0 for an empty tensor): their norm over the root
    of their number, one reduction in float32 (a screen reads a hundred devices' rows a step)."""
    return float(torch.linalg.vector_norm(x.detach(), dtype=torch.float32)) / math.sqrt(x.numel()) if x.numel() else 0.0


def cut_sizes(rows: Mapping[str, torch.Tensor], cut: Mapping[str, Cut]) -> dict[Cut, dict[str, float]]:
    """Per cut (``cut``: device -> its cut, any hashable) that at least :data:`MIN_HOLDERS`
    devices share, each such device's activations' RMS."""
    by_cut: dict[Cut, dict[str, float]] = {}
    for a, x in rows.items():
        by_cut.setdefault(cut[a], {})[a] = rms(x)
    return {c: sizes for c, sizes in by_cut.items() if len(sizes) >= MIN_HOLDERS}


def within(ratio: float, factor: float) -> bool:
    return 1 / factor <= ratio <= factor


def typical_size(sizes: Sequence[float], history: Optional[float], anchor: Optional[float], factor: float) -> float:
    """The typical activations' RMS at a cut in this step: the median of the step's ``sizes``.

    Unless the step disagrees with itself or with the past: its two middle values lie more than
    ``factor`` apart (as many devices lie as do not), or its median lies more than ``factor``
    from ``history`` (the median the cut's accepted devices sent in the step before). Then
    either most devices of this step lie, or every device's activations changed at once; the
    coordinator's own activations at that cut (``anchor``: its client portion on its held-out
    inputs) decide: the typical size is whichever of the two middle values and ``history`` lies
    nearest them. Without an anchor (no validation data on the server) the median stands, and
    a step where most devices lie goes unseen."""
    ordered = sorted(sizes)
    lo, hi = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
    m = (lo + hi) / 2
    if anchor is None or not 0 < anchor < math.inf or lo <= 0:
        return m
    if within(hi / lo, factor) and (history is None or history <= 0 or within(m / history, factor)):
        return m
    candidates = [lo, hi] + ([history] if history is not None and history > 0 else [])
    return min(candidates, key=lambda v: abs(math.log(v / anchor)))


def far_rows(sizes: Mapping[str, float], typical: float, factor: float) -> dict[str, float]:
    """The devices whose RMS in ``sizes`` lies outside ``[typical/factor, typical·factor]``,
    with their scale (RMS over ``typical``); none where that would be more than half of them (the
    typical size is then not the honest devices': a screen must not take out most of a fleet)."""
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    if not 0 < typical < math.inf:
        return {}
    far = {a: x / typical for a, x in sorted(sizes.items()) if not within(x / typical, factor)}
    return far if 2 * len(far) <= len(sizes) else {}
