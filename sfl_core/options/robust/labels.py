"""The label screen: which devices' labels disagree with what their inputs look like at the cut.

In split learning the labels reach the server with the activations, and the server portion
trains on them as sent: a device that flips its labels (``c -> 9 - c``) or plants a backdoor
(its images with a trigger, labelled with the attacker's class) poisons the server's layers
through the loss, with activations of an honest scale (:mod:`sfl_core.options.robust.rows`
cannot see it) and an honest-looking update.

What gives it away is the pair: the activations of a flipped row look like their true class.
The coordinator holds labelled held-out data; run through the round's client portion (as a
device runs it) it gives each class's centroid at the cut. A row whose nearest centroid is not
its label's is a *mismatch*. Even an honest row mismatches where the classes are close at that
layer, so each class's own rate is measured on the held-out rows themselves, leaving each row
out of its class's centroid (:func:`class_centroids`): a device's *expected* mismatches are the
sum of its rows' classes' rates. Honest devices mismatch about as expected whatever their mix of
labels (label skew changes which classes a device holds, not what they look like); a flipper
mismatches nearly every row, a backdoor its triggered share. A device whose share of mismatches
is more than ``margin`` over its expected share is flagged (:func:`label_outliers`), on its first
rows of this round or on those of its last rounds pooled (:func:`judge`).

Where the device's layers hold BatchNorm, a batch is normalised by its own statistics: a batch
of one or two classes comes out shifted against a mixed held-out batch, and honest devices
mismatch. There the reference is matched to the device instead (:func:`matched_selection`,
:func:`count_far`): held-out samples in the device's claimed mix of classes, run as one batch
as the device ran its own, and a row is a mismatch where it lies farther from its claimed
class's centroid than ``quantile`` of that class's held-out rows do (each left out of the
centroid). A flipped row is of another class and lies far; an honest one lies as close as the
held-out rows of its class, in a batch normalised like its own.

A row sent twice is one piece of evidence. A device holding fewer samples than its batch sends
each of them several times in a step (its sampler wraps around its data), and the same few
images again in every round: counted as rows, two odd images of an honest device's four, each
sent ten times in a batch of 42, were 21 mismatches of 42 rows, the same four pooled over three
rounds were flagged again, and the device was quarantined. So a step's identical rows are
counted once (:func:`distinct`); a device whose step repeated rows and holds as many images as
it registered has shown all its data: its count is *whole*, no later step of the round adds to
it, and its past rounds, the same images, are not pooled with it. Where a device's batch is its
data without repeats, its rounds pooled re-count its images: pooled, they count as the evidence
of at most the samples it registered (:meth:`LabelCount.at_most`). A whole count is judged
from :data:`MIN_WHOLE_ROWS` distinct images, short of :data:`MIN_ROWS`: the device has no more
to show, and a liar of ten images in a batch of 32 still trains the server's layers on all ten
every step (waiting for 16 let one of the digits fleet's backdoors through every round); the
test of chance (:func:`label_outliers`) decides on its few images as on any count.

Limits: the rows must be labelled (a device that keeps its labels, U-shaped, is not screened),
the server must hold labelled held-out data of the same task, and a class missing from it is
not judged. A device with fewer than :data:`MIN_WHOLE_ROWS` distinct samples is not judged,
and one of a few more only where it mismatches nearly all of them (its repeats carry no more
evidence than its images). An attacker that poisons fewer
than ``margin`` of its rows goes unseen; so does one whose held-out rates are near chance
(early rounds, a cut where the classes do not separate yet), since its expected share leaves
no room for the margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Mapping, Sequence

import torch

from sfl_core.options.robust.repeats import repeats

__all__ = ["MIN_ROWS", "MIN_WHOLE_ROWS", "POOLED_ROUNDS", "QUANTILE", "SIGNIFICANCE", "SUSPICION", "LabelCount", "Reference", "Verdict",
           "binomial_tail", "class_centroids", "count_each", "count_far", "distinct", "judge", "label_outliers",
           "matched_selection"]

MIN_ROWS = 16
"""Rows a device must have sent in a round before its share of mismatches is judged."""

MIN_WHOLE_ROWS = 8
"""The distinct samples a device whose step showed all its data (:attr:`LabelCount.whole`)
must hold to be judged on them."""

POOLED_ROUNDS = 3
"""A device is judged on its first rows of this round alone, and also on those of its last this
many rounds (this one included) pooled (:func:`judge`): flagged where either is over. Why pool
first steps and not count a round's later steps: only a device's first rows ran through the
portion the held-out rows ran through; a few local steps later its own portion has moved, and an
honest device's rows drift off the reference as a liar's do. Each round's rows are compared with
that round's reference, so rounds pool without drift, and over three rounds chance spreads a
share 1/sqrt(3) as far from the expected one (a liar's excess stays what it is)."""

SUSPICION = 0.0
"""A device's past rounds are pooled with this round's rows only where those rows lie more than
this share of the margin over their expected share (:func:`judge`; 0: where they mismatch more
than expected at all): pooling adds evidence to a leaning and does not carry an old verdict onto
a round that looks honest. Without it an honest device flagged twice (on the digits, one whose
handwritten 5s lie nearest the held-out 9s) was flagged a third time on its past alone, with
rows that mismatched less than expected, and quarantined. At half the margin a backdoor on a
hundred devices passed again: its devices' passing rounds often lie under that."""

SIGNIFICANCE = 4.0
"""How unlikely chance must make a device's mismatches for it to be flagged
(:func:`label_outliers`): as unlikely as 4 standard deviations of a normal tail (3 in 100,000),
by the binomial's exact tail (:attr:`LabelCount.significance`)."""

QUANTILE = 0.9
"""Matched reference: a row is far from its class where it lies farther than this share of the
class's held-out rows."""

MATCHED_LEAST = 4
"""Matched reference: held-out samples a class needs to be judged."""


@dataclass(frozen=True)
class Reference:
    """Each class's centroid at a cut, and its rows' rate of mismatches (nan: a class with fewer
    than 2 held-out rows, not judged)."""

    centroids: torch.Tensor
    """(classes, features): the mean flattened activation of each class's held-out rows."""
    rates: torch.Tensor
    """(classes,): the share of a class's held-out rows nearer another class's centroid than
    their own class's centroid without them."""
    _judged: torch.Tensor = field(init=False, repr=False, compare=False)
    _known: torch.Tensor = field(init=False, repr=False, compare=False)
    _squares: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # what every device's rows are compared with, prepared once a round (the screen compares
        # each device's rows of a step: a hundred devices, a hundred comparisons a step)
        judged = (~torch.isnan(self.rates)).nonzero().flatten()
        known = self.centroids[judged].float()
        object.__setattr__(self, "_judged", judged)
        object.__setattr__(self, "_known", known.contiguous())
        object.__setattr__(self, "_squares", (known * known).sum(1))

    def nearest(self, *rows: torch.Tensor) -> torch.Tensor:
        """The judged class whose centroid lies nearest each flattened row of ``rows`` (each (N,
        features), in turn): the least ``|m|² - 2 x·m`` (``|x|²`` is the same for every class).
        Several devices' rows are taken as they are, not copied into one tensor first.

        Each device's products are taken as centroids by rows, ``M xᵀ`` (classes x N): with a
        few classes and many features, the matrix product runs about twice as fast in that
        orientation as ``x Mᵀ`` on a CPU."""
        products = torch.cat([self._known @ x.T for x in rows], 1)
        return self._judged[(self._squares[:, None] - 2 * products).argmin(0)]


@dataclass
class LabelCount:
    """A device's rows in a round: how many, how many mismatched, how many were expected to."""

    rows: int = 0
    mismatched: int = 0
    expected: float = 0.0
    whole: bool = False
    """The rows are all the device's data: its step repeated rows (:func:`distinct`)."""

    @classmethod
    def total(cls, counts: Sequence["LabelCount"]) -> "LabelCount":
        """The counts added up (a device's steps of a round, or its rounds)."""
        out = cls()
        for c in counts:
            out.add(c)
        return out

    def add(self, other: "LabelCount") -> None:
        self.rows += other.rows
        self.mismatched += other.mismatched
        self.expected += other.expected
        self.whole = self.whole or other.whole

    @property
    def significance(self) -> float:
        """How unlikely chance makes this many mismatches, in standard deviations: the chance that
        an honest device's rows mismatch at least this often (:func:`binomial_tail`, each row at
        their mean expected rate), as the deviations of a normal tail that unlikely. Infinite
        where chance allows none; 0 where there are no more than expected.

        Why the exact tail: over 16-32 rows at rates of a few percent the count is skewed, and the
        normal approximation (the excess over the binomial's standard deviation) put an honest
        device's 6 mismatches of 16 rows, 1.3 expected, at 4.3 deviations; their tail is 0.1 %,
        3.1. The rows' own rates differ by class, and a sum of unequal Bernoulli trials spreads
        less than the binomial at their mean rate: a row or more over the mean, where a device can
        be flagged, the binomial's tail is never the smaller (Hoeffding, *On the distribution of
        the number of successes in independent trials*, 1956)."""
        if self.mismatched <= self.expected or self.rows <= 0:
            return 0.0
        tail = binomial_tail(self.mismatched, self.rows, self.expected / self.rows)
        if tail <= 0.0:
            return math.inf
        return -NormalDist().inv_cdf(tail) if tail < 1.0 else 0.0

    def at_most(self, images: int) -> "LabelCount":
        """This count as the evidence of at most ``images`` distinct samples: rows, mismatches and
        expected mismatches scaled by ``images / rows`` where there are more rows (a device's
        rounds pooled re-count its images when it holds few). The share is unchanged, and with
        it the excess; what chance explains grows."""
        if images <= 0 or self.rows <= images:
            return self
        f = images / self.rows
        return LabelCount(images, round(self.mismatched * f), self.expected * f, self.whole)

    @property
    def excess(self) -> float:
        """The share of mismatched rows over the expected share (0 with no rows)."""
        return (self.mismatched - self.expected) / self.rows if self.rows else 0.0


def binomial_tail(k: int, n: int, p: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, p)``: its terms summed in log space, exact and without
    overflow for any ``n`` (a device's rows pooled over its rounds are a few hundred at most)."""
    if k <= 0 or p >= 1.0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    lp, lq, ln = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    logs = [ln - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k, n + 1)]
    top = max(logs)
    return math.exp(top) * math.fsum(math.exp(x - top) for x in logs)


def distinct(rows: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``rows`` (N, ...) and their ``labels`` with each identical (row, label) pair kept once, in
    the order first sent, and whether any was repeated (:func:`~sfl_core.options.robust.repeats.repeats`)."""
    found = repeats(rows, labels)
    if found is None:
        return rows, labels, False
    return found.take(rows), found.take(labels), True


def class_centroids(rows: torch.Tensor, labels: torch.Tensor, classes: int) -> Reference:
    """Centroids and leave-one-out mismatch rates of the held-out ``rows`` (N, ...) with ``labels``.

    A held-out row ``x`` of class ``c`` (``n_c`` rows, centroid ``m_c``) is compared with its
    class's centroid without itself, ``(n_c m_c - x) / (n_c - 1)``, at distance
    ``n_c / (n_c - 1) |x - m_c|``, and with every other class's: it mismatches where another
    lies nearer. Cost: one sum of the rows by class and one (classes x N) matrix product for
    the distances, taken as ``|x|² + |m|² - 2 m·x`` (a fraction of the time of element-wise
    differences, at a relative error of about 1e-5 in float32); the distance to a row's own
    centroid is taken exactly."""
    f, labels = _rows_where(rows.detach().flatten(1).float(), labels.long(), (labels >= 0) & (labels < classes))
    counts = torch.bincount(labels, minlength=classes)
    known = counts >= 2
    sums = torch.zeros(classes, f.shape[1]).index_add_(0, labels, f)
    centroids = torch.where(known[:, None], sums / counts.clamp(min=1)[:, None], float("nan"))
    rates = torch.full((classes,), float("nan"))
    judged = known[labels]
    if not judged.any():
        return Reference(centroids, rates)
    f, labels = _rows_where(f, labels, judged)
    n = counts[labels].float()
    own = (f - centroids.index_select(0, labels)).norm(dim=1) * (n / (n - 1))
    at = known.nonzero().flatten()
    m = centroids[at]
    squared = (f * f).sum(1) + (m * m).sum(1)[:, None] - 2 * (m @ f.T)    # (judged classes, rows)
    others = torch.full((classes, len(f)), float("inf"))
    others[at] = squared.clamp(min=0).sqrt()
    others[labels, torch.arange(len(f))] = float("inf")
    mismatched = (others.min(0).values < own).double()
    rates[known] = (torch.zeros(classes, dtype=torch.float64).index_add_(0, labels, mismatched)[known]
                    / counts[known]).float()
    return Reference(centroids, rates)


def _rows_where(f: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``f`` and ``labels`` where ``keep``, gathered by index (a boolean mask gathers
    a wide matrix's rows several times slower), or the same tensors where all are kept."""
    if bool(keep.all()):
        return f, labels
    at = keep.nonzero().flatten()
    return f.index_select(0, at), labels.index_select(0, at)


def count_each(batches: Sequence[tuple[torch.Tensor, torch.Tensor]], ref: Reference) -> list[LabelCount]:
    """Each device's rows of one step against ``ref``, for several devices' ``(rows, labels)`` at
    one cut: rows of a judged class, how many lie nearer another class's centroid than their
    label's, and how many were expected to (the sum of their classes' rates); rows of a class the
    reference does not judge are not counted. Counted together, one product per device and one
    sum for all: small operations per device, not arithmetic, were most of what a hundred
    devices' screens cost."""
    if not batches:
        return []
    classes = ref.rates.shape[0]
    nearest = ref.nearest(*(x.detach().flatten(1).float() for x, _ in batches))
    y = torch.cat([labels.long() for _, labels in batches])
    owner = torch.repeat_interleave(torch.arange(len(batches)), torch.tensor([len(labels) for _, labels in batches]))
    judged = (y >= 0) & (y < classes) & ~torch.isnan(ref.rates[y.clamp(0, classes - 1)])
    if not judged.all():
        nearest, y, owner = nearest[judged], y[judged], owner[judged]
    p = ref.rates[y].double()
    found = torch.stack([torch.ones_like(p), (nearest != y).double(), p])
    sums = torch.zeros(3, len(batches), dtype=torch.float64).index_add_(1, owner, found)
    return [LabelCount(int(n), int(m), e) for n, m, e in sums.T.tolist()]


def label_outliers(counts: Mapping[str, LabelCount], margin: float,
                   significance: float = SIGNIFICANCE) -> dict[str, float]:
    """The devices (of at least :data:`MIN_ROWS` rows, or :data:`MIN_WHOLE_ROWS` where their count
    is whole) whose share of mismatched rows is more
    than ``margin`` over their expected share, and more than chance explains (``significance``
    standard deviations), with that excess; none where that would be more than half of the
    devices judged (the held-out data then does not describe the fleet's, and a screen must not
    take out most of a round). Why both: over a device's first 16-32 rows chance alone puts an
    honest share a tenth or two over the expected one now and then; the margin is what an
    attack must exceed, the significance what chance must not explain."""
    if not 0 < margin < 1:
        raise ValueError(f"margin must be in (0, 1), got {margin}")
    judged = {a: c for a, c in counts.items() if c.rows >= MIN_ROWS or (c.whole and c.rows >= MIN_WHOLE_ROWS)}
    out = {a: round(c.excess, 4) for a, c in sorted(judged.items())
           if c.excess > margin and c.significance > significance}
    return out if 2 * len(out) <= len(judged) else {}


@dataclass(frozen=True)
class Verdict:
    """Why a device is flagged: its share of mismatches over the expected share, the count that
    share is of, and how many rounds that count pools (1: this round's rows alone)."""

    excess: float
    count: LabelCount
    rounds: int


def judge(now: Mapping[str, LabelCount], past: Mapping[str, Sequence[LabelCount]], margin: float,
          significance: float = SIGNIFICANCE, images: Mapping[str, int] | None = None) -> dict[str, Verdict]:
    """The devices flagged on this round's rows (``now``) alone or on them pooled with their
    counts of earlier rounds (``past``, each against its own round's reference; at most
    :data:`POOLED_ROUNDS` - 1 kept), each by :func:`label_outliers`. Pooled only where this
    round's rows lean that way already (over :data:`SUSPICION` of the margin over the expected
    share): a device is never judged on its past alone, neither before its rows of this round
    are enough to judge nor where they look honest; nor pooled where this round's count is
    whole (its past rounds hold the same images). A device's rounds pooled count as the
    evidence of at most its ``images`` (the samples it registered, or this round's rows where
    those are more: a claim its rows belie is not believed; :meth:`LabelCount.at_most`)."""
    flagged = {a: Verdict(x, now[a], 1) for a, x in label_outliers(now, margin, significance).items()}
    held = {a: n for a, n in (images or {}).items() if n > 0}
    together = {a: LabelCount.total([*past[a], c]).at_most(max(held[a], c.rows) if a in held else 0)
                for a, c in now.items()
                if c.rows >= MIN_ROWS and past.get(a) and c.excess > SUSPICION * margin and not c.whole}
    # judged among all the devices, those without a past on this round's rows (the guard against
    # flagging most of them counts every device judged)
    for a, x in label_outliers({**now, **together}, margin, significance).items():
        if a in together:
            flagged.setdefault(a, Verdict(x, together[a], len(past[a]) + 1))
    return dict(sorted(flagged.items()))


def matched_selection(claimed: torch.Tensor, held: torch.Tensor, classes: int) -> torch.Tensor:
    """Indices into the held-out labels ``held`` whose mix of classes is the device's ``claimed``
    labels' (each class in proportion, as many as the scarcest allows, at least
    :data:`MATCHED_LEAST` of each); a class with fewer held-out samples is left out (not judged)."""
    claimed, held = claimed.long(), held.long()
    counts = torch.bincount(claimed[(claimed >= 0) & (claimed < classes)], minlength=classes)
    avail = {k: (held == k).nonzero().flatten() for k in range(classes) if counts[k] > 0}
    avail = {k: idx for k, idx in avail.items() if len(idx) >= MATCHED_LEAST}
    if not avail:
        return torch.zeros(0, dtype=torch.long)
    scale = min(len(idx) / int(counts[k]) for k, idx in avail.items())
    return torch.cat([idx[:max(MATCHED_LEAST, round(int(counts[k]) * scale))] for k, idx in avail.items()])


def count_far(rows: torch.Tensor, labels: torch.Tensor, ref_rows: torch.Tensor, ref_labels: torch.Tensor,
              quantile: float = QUANTILE) -> LabelCount:
    """A device's rows against held-out rows of its claimed classes run as one batch like its own
    (:func:`matched_selection`). Per claimed class ``k`` with at least 2 held-out rows: its centroid
    ``m_k``, and the ``quantile`` of its held-out rows' distances to it (each left out of it) as
    the bound; a device row of class ``k`` beyond the bound is a mismatch, and the expected
    number is the share of the held-out rows beyond it, per row."""
    f, labels = rows.detach().flatten(1).float(), labels.long()
    ref, ref_labels = ref_rows.detach().flatten(1).float(), ref_labels.long()
    out = LabelCount()
    for k in labels.unique().tolist():
        fk = ref[ref_labels == k]
        n = len(fk)
        if n < 2:
            continue
        m = fk.mean(0)
        loo = (fk - (n * m - fk) / (n - 1)).norm(dim=1)
        bound = torch.quantile(loo, quantile)
        mine = f[labels == k]
        p = float((loo > bound).float().mean())
        out.add(LabelCount(len(mine), int(((mine - m).norm(dim=1) > bound).sum()), len(mine) * p))
    return out
