"""What the coordinator knows of a run's fleet and of how the run is learning: the evidence
the training options' recommendations (:meth:`sfl_core.options.base.RoundOption.recommend`)
read when ``strategy: auto`` decides them.

Known before round 1: each registered device's label histogram (the skew between devices), the
fleet and round sizes, whether the model normalises with batch statistics. Known as the run
goes: the validation accuracy of every scored round. All of it is computed here by pure
functions, so each decision rule is a test of a few numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from sfl_core.label_mix import dist_matrix, kl_rows, population_distribution

__all__ = ["Evidence", "label_skew", "absent_classes", "swing", "climb", "above_chance"]


@dataclass(frozen=True)
class Evidence:
    agents: int
    """Registered devices."""
    per_round: int
    """Devices a round trains."""
    classes: int
    label_skew: float
    """Mean KL divergence (nats) of each device's label mix from the fleet's: 0 for identical
    mixes; a Dirichlet(0.3) split of ten classes gives about 1."""
    absent: float
    """Mean fraction of the classes a device holds no sample of."""
    batch_norm: bool
    """The model normalises with batch statistics (BatchNorm layers)."""
    accuracy: tuple[float, ...] = ()
    """Validation accuracy of the scored rounds so far, oldest first."""
    round: int = 0
    """The round about to be trained (0: before the run)."""

    @property
    def skewed(self) -> bool:
        """The devices' label mixes differ: a mean KL of 0.25 nats (ten classes split by a
        Dirichlet of about 1), or a fifth of the classes absent on the average device."""
        return self.label_skew >= 0.25 or self.absent >= 0.2

    @property
    def strongly_skewed(self) -> bool:
        """They differ enough for the skew remedies to pay for what they cost: a mean KL of
        0.75 nats (ten classes split by a Dirichlet of about 0.3 over tens of devices), or two
        fifths of the classes absent. Milder skew (the demo's Dirichlet 0.5 over four devices,
        0.43 nats) trained as well or better without them on the benches."""
        return self.label_skew >= 0.75 or self.absent >= 0.4

    @property
    def partial(self) -> bool:
        """A round trains a sample of the fleet, not all of it."""
        return self.per_round < self.agents

    @property
    def stopped_climbing(self) -> bool:
        """The scored accuracy has stopped climbing: over the last 5 scored rounds, all clearly
        above chance (:func:`above_chance`), it falls back (:func:`swing`) at least as much as it
        gains net (:func:`climb`). From there a round only moves the model around where it has
        got to; a run stuck at chance has not started climbing, so it has not stopped either."""
        s, c = swing(self.accuracy), climb(self.accuracy)
        return s is not None and c is not None and above_chance(self.accuracy, self.classes) and 0 < s and c <= s


def label_skew(histograms: Iterable[Sequence[int]]) -> float:
    """Mean over devices of KL(device mix ‖ fleet mix), in nats (MergeSFL's Eq. 12 against the
    pooled population, :mod:`sfl_core.label_mix`); devices with no samples are left out."""
    hists = [list(h) for h in histograms if sum(h) > 0]
    if not hists:
        return 0.0
    width = max(len(h) for h in hists)
    rows = {str(i): h + [0] * (width - len(h)) for i, h in enumerate(hists)}
    return float(kl_rows(dist_matrix(sorted(rows), rows), population_distribution(rows)).mean())


def absent_classes(histograms: Iterable[Sequence[int]], classes: int) -> float:
    """Mean fraction of the ``classes`` each device (with samples) holds none of."""
    hists = [list(h) for h in histograms if sum(h) > 0]
    if not hists or classes <= 0:
        return 0.0
    return sum(1 - sum(1 for c in h[:classes] if c > 0) / classes for h in hists) / len(hists)


def swing(accuracy: Sequence[float], last: int = 5) -> Optional[float]:
    """How far the validation accuracy falls back, on average, from one of the ``last`` scored
    rounds to the next (None before there are that many): a run that only improves does not
    swing; one whose rounds pull the model towards different devices' classes does."""
    tail = list(accuracy)[-last:]
    if len(tail) < last:
        return None
    return sum(max(0.0, a - b) for a, b in zip(tail, tail[1:])) / (len(tail) - 1)


def climb(accuracy: Sequence[float], last: int = 5) -> Optional[float]:
    """How much the validation accuracy gains a round, net, over the ``last`` scored rounds (the
    last one's less the first one's, over the rounds between; None before there are that many).
    A run whose :func:`swing` matches or exceeds its climb has stopped improving on the whole: its
    rounds only move the model around where it has got to."""
    tail = list(accuracy)[-last:]
    if len(tail) < last:
        return None
    return (tail[-1] - tail[0]) / (len(tail) - 1)


def above_chance(accuracy: Sequence[float], classes: int, last: int = 5) -> bool:
    """Whether each of the ``last`` scored rounds lies clearly above chance (twice it, for
    ``classes`` classes): a run stuck at chance for tens of rounds has not started climbing, so
    it has not stopped climbing either."""
    tail = list(accuracy)[-last:]
    return len(tail) == last and classes > 0 and min(tail) >= 2 / classes


def evidence_of(*, histograms: Mapping[str, Sequence[int]], classes: int, per_round: int,
                batch_norm: bool, accuracy: Sequence[float] = (), round: int = 0) -> Evidence:
    """The evidence from the registered devices' label histograms and the run so far."""
    hists = list(histograms.values())
    return Evidence(agents=len(hists), per_round=min(per_round, len(hists)) if hists else per_round,
                    classes=classes, label_skew=label_skew(hists),
                    absent=absent_classes(hists, classes), batch_norm=batch_norm, accuracy=tuple(accuracy),
                    round=round)
