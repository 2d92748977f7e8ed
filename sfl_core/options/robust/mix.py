"""The mix of classes a device registered, checked against the labels it sends.

A device registers how many samples of each class it holds, and the planners read that mix:
MergeSFL's KL selection picks the agents whose merged mix is nearest the fleet's, the joint
planner regulates batches by it, S2FL groups devices into balanced groups by it, and the
population every one of them aims at is the fleet's claims added up. A mix is a claim, and a
device that claims the fleet's missing classes (or a perfectly even mix) is picked round after
round whatever it holds; where such devices take most rounds from the start, the model may
never learn enough for the label screen, whose held-out rates need a model that separates the
classes, to judge them (docs/results.md measures the claim under MergeSFL's selection).

The labels a device sends with its activations are draws from what it holds: its sampler walks
reshuffled epochs of its data, so a round's rows follow its true mix at least as closely as
independent draws would. Under the claim, the likelihood-ratio statistic of the labels sent,

    G = 2 · Σ_k n_k · ln(n_k / (N · p_k)),   p_k = claimed_k / Σ claimed,

is about χ² with (classes claimed − 1) degrees of freedom; its Wilson–Hilferty transform gives
the standard deviations of a normal tail (:func:`deviations`). A label of a class the device
claimed none of is impossible under the claim. Where the deviations pass the limit
(``robust.mix_limit``), the claim is refuted: the device is named, and the mix the planners read
becomes the one it showed (:func:`shown_mix`: its labels' shares of its claimed total, so its
weight as a data size stays what the weight cap made of it).

Limits: only labels that travel are checked (a device that keeps its labels is not), and a
device whose labels follow its claim passes whatever they are (random labels drawn from an even
mix: that is the label screen's to see).
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["deviations", "shown_mix"]


def deviations(claimed: Sequence[int], sent: Sequence[int]) -> float:
    """How far the labels ``sent`` (a count per class) lie from the ``claimed`` mix, in standard
    deviations of a normal tail (Wilson–Hilferty on G, above); ``inf`` where a label of a class
    claimed at zero was sent; 0 with no labels, or a claim of one class only that they match."""
    total, n = sum(claimed), sum(sent)
    if n == 0 or total <= 0:
        return 0.0
    g, classes = 0.0, 0
    for c, k in zip(claimed, sent):
        if c <= 0:
            if k > 0:
                return math.inf
            continue
        classes += 1
        if k > 0:
            g += 2.0 * k * math.log(k / (n * c / total))
    dof = classes - 1
    if dof < 1:
        return 0.0
    spread = 2.0 / (9.0 * dof)
    return ((max(g, 0.0) / dof) ** (1.0 / 3.0) - (1.0 - spread)) / math.sqrt(spread)


def shown_mix(sent: Sequence[int], total: int) -> list[int]:
    """``total`` samples in the shares of the labels ``sent`` (largest remainders, so the counts
    add up to ``total`` exactly)."""
    n = sum(sent)
    if n == 0:
        raise ValueError("no labels to take a mix from")
    exact = [total * k / n for k in sent]
    counts = [int(math.floor(x)) for x in exact]
    by_remainder = sorted(range(len(sent)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts
