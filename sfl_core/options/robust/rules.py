"""Robust aggregation rules over the round's model states, pure functions of tensors.

Each rule reads the states the round's participants delivered (an agent's client portion and,
for the layers it did not hold, the server copy that trained on its rows: the participants of
the layer-wise average, :func:`sfl_core.aggregation.participants`) and the model the round
began from. States need not hold the same keys (mixed cuts) nor whole tensors (a narrow
HeteroSFL bottleneck holds the first channels of a layer): every rule works element by element
over the states that hold the element, as the plain weighted average does.

* :func:`change_sizes` — the size of each state's change against the round's typical change
  (layer by layer against the median of the layer's holders, combined weighted by elements, per
  unit of each state's rate: for ``clip``, its learning rate over the root of its batch), for
  a norm bound with an adaptive bound (the ``clip`` rule: a change over ``factor`` times the
  typical one is left out). The bound adapts to the round, so honest updates, whose sizes are
  alike, pass, and grows at most threefold from one round to the next, so a round where most
  devices lie does not set it (:func:`typical_changes`). Norm bounding:
  Sun et al., "Can You Really Backdoor Federated Learning?", 2019; the median makes the bound
  need no tuning.
* :func:`relative_changes` — each state's change against the size of the weights it started
  from. An honest round of SGD moves the weights by a fraction of their size; a change as large
  as the weights themselves replaces them (random or zeroed weights) rather than trains them.
  Unlike the typical change, this bound does not move with the round: where the fleet is stuck
  and honest changes grow, the typical change grows with them, and a replacement that was ten
  times it on the first rounds passes under it later.
* :func:`coordinate_median` and :func:`trimmed_mean` — coordinate-wise median and β-trimmed
  mean (Yin et al., "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
  Rates", ICML 2018). Both ignore the weights: a weight is what a device claims.
* :func:`multi_krum` — Multi-Krum (Blanchard et al., "Machine Learning with Adversaries:
  Byzantine Tolerant Gradient Descent", NeurIPS 2017): the ``n − f`` states whose changes lie
  closest to their ``n − f − 2`` nearest neighbours; the others are left out of the average.
  Distances are mean squared differences over the elements both states hold, so states cut at
  different depths compare on their common layers.

Cost: the sizes read every state once per layer (:func:`measure_changes`: one pass serves every
bound of a round), Krum pairwise (``n²`` layer differences); the coordinate-wise rules sort ``n``
values per element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

__all__ = ["GROWTH", "Changes", "change_sizes", "coordinate_median", "measure_changes", "multi_krum",
           "relative_changes", "relative_of", "sizes_of", "trimmed_mean", "typical_changes", "typical_of"]

State = Mapping[str, torch.Tensor]

GROWTH = 3.0
"""How much a layer's typical change may grow from one round to the next (:func:`typical_changes`)."""


def _prefix(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The first ``shape`` elements of ``t`` along every dimension (what a narrow holder holds)."""
    return t[tuple(slice(0, n) for n in shape)]


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point()


def _holds(start: State, key: str, t: torch.Tensor) -> bool:
    """Whether ``t``, a state's value of ``key``, is a floating-point layer that ``start`` has too."""
    ref = start.get(key)
    return ref is not None and _floating(t) and t.dim() == ref.dim() and t.numel() > 0


def _stack_float64(flat: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 1-D tensors ``flat`` stacked as rows, in float64 (converted once where they share a dtype)."""
    if len({t.dtype for t in flat}) == 1:
        return torch.stack(list(flat)).to(torch.float64)
    return torch.stack([t.to(torch.float64) for t in flat])


STACK_ELEMENTS = 1 << 22
"""Elements of one layer stacked over states at a time (:func:`measure_changes`): 32 MiB in
float64, however large the portion or the round."""


@dataclass(frozen=True)
class Changes:
    """The round's states' changes from the model it began from, measured in one pass over their
    layers (:func:`measure_changes`): every bound of the ``clip`` rule reads them from here."""

    layers: dict[str, dict[int, tuple[float, int]]]
    """Per layer, per state holding it: its RMS change per element per unit of learning rate,
    and its elements."""
    moved: list[float]
    """Per state: the sum of its squared changes."""
    size: list[float]
    """Per state: the sum of the squares of the start's values it holds."""

    def subset(self, indices: Sequence[int]) -> "Changes":
        """The changes of the states at ``indices``, numbered 0.. in that order."""
        at = {i: j for j, i in enumerate(indices)}
        layers = {key: {at[i]: v for i, v in holders.items() if i in at} for key, holders in self.layers.items()}
        return Changes({k: h for k, h in layers.items() if h}, [self.moved[i] for i in indices],
                       [self.size[i] for i in indices])


def measure_changes(start: State, states: Sequence[State], rates: Optional[Sequence[float]] = None) -> Changes:
    """Each state's change from ``start``, per layer (per unit of its learning rate ``rates``)
    and in all (see :class:`Changes`). Why one pass: the layers are read in float64, and the
    clip rule's bounds (:func:`typical_of`, :func:`sizes_of`, :func:`relative_of`, and the
    same among peers) would otherwise each read every state again."""
    rate = list(rates) if rates is not None else [1.0] * len(states)
    if len(rate) != len(states) or any(not r > 0 for r in rate):
        raise ValueError("need one positive rate per state")
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}   # a layer's holders of one shape
    for i, s in enumerate(states):
        for key, t in s.items():
            if _holds(start, key, t):
                holders.setdefault((key, tuple(t.shape)), []).append(i)
    layers: dict[str, dict[int, tuple[float, int]]] = {}
    moved, size = [0.0] * len(states), [0.0] * len(states)
    for (key, shape), held in holders.items():
        ref = _prefix(start[key].detach(), shape).to(torch.float64).reshape(-1)
        n, own = ref.numel(), float((ref * ref).sum())
        step = max(1, STACK_ELEMENTS // n)
        for at in range(0, len(held), step):   # the layer's holders stacked: one pass, not one per state
            chunk = held[at:at + step]
            d = _stack_float64([states[i][key].detach().reshape(-1) for i in chunk]) - ref
            for i, squared in zip(chunk, (d * d).sum(1).tolist()):
                layers.setdefault(key, {})[i] = (math.sqrt(squared / n) / rate[i], n)
                moved[i] += squared
                size[i] += own
    return Changes(layers, moved, size)


def typical_of(changes: Changes, past: Optional[Mapping[str, float]] = None, growth: float = GROWTH) -> dict[str, float]:
    """:func:`typical_changes` of measured ``changes``."""
    out: dict[str, float] = {}
    for key, holders in changes.layers.items():
        typical = float(torch.tensor(sorted(v for v, _ in holders.values())).median())
        if past is not None and past.get(key, 0) > 0:
            typical = min(typical, growth * past[key])
        if len(holders) >= 3 and typical > 0:
            out[key] = typical
    return out


def sizes_of(changes: Changes, typical: Optional[Mapping[str, float]] = None) -> list[float]:
    """:func:`change_sizes` of measured ``changes`` (``typical`` by default their own)."""
    typical = typical_of(changes) if typical is None else typical
    states = len(changes.moved)
    total = [0.0] * states
    count = [0] * states
    for key, holders in changes.layers.items():
        if key not in typical:   # no typical change to compare with: the layer says nothing
            continue
        for i, (v, n) in holders.items():
            total[i] += n * (v / typical[key]) ** 2
            count[i] += n
    return [math.sqrt(total[i] / count[i]) if count[i] else 0.0 for i in range(states)]


def relative_of(changes: Changes) -> list[float]:
    """:func:`relative_changes` of measured ``changes``."""
    return [math.sqrt(m / z) if z > 0 else 0.0 for m, z in zip(changes.moved, changes.size)]


def typical_changes(start: State, states: Sequence[State], rates: Optional[Sequence[float]] = None,
                    past: Optional[Mapping[str, float]] = None, growth: float = GROWTH) -> dict[str, float]:
    """Per layer, the round's typical change: the median of its holders' (:func:`change_sizes`),
    at most ``growth`` times the layer's typical change of the round before (``past``), where
    there is one. The median is an honest change while fewer than half of a layer's holders
    lie; in a round where more do (a round that happened to select most of a fleet's
    attackers), the bound from the round before keeps the typical change an honest one. Honest
    changes shrink as a run converges, or grow slowly. A layer fewer than three states hold, or
    that most did not change, has none (it is not compared)."""
    return typical_of(measure_changes(start, states, rates), past, growth)


def change_sizes(start: State, states: Sequence[State], rates: Optional[Sequence[float]] = None,
                 typical: Optional[Mapping[str, float]] = None) -> list[float]:
    """How large each state's change from ``start`` is against the round's, a number near 1 for
    an ordinary change: per layer, the root mean square change per element over the layer's
    typical change (``typical``, by default :func:`typical_changes` of these states: the median
    of that layer's holders), combined over the state's layers weighted by their elements
    (``sqrt(sum_k n_k r_k^2 / sum_k n_k)``). Per layer, because devices cut at different depths
    or training the whole model change their layers by different amounts; weighted by
    elements, because a small layer's change (a bias) varies between honest devices more than
    any bound that still stops an attack. Per unit of each state's learning rate ``rates``
    (batch regulation scales a device's rate with its batch, and its change with it). A narrow
    HeteroSFL bottleneck's prefix of a layer counts for the elements it holds. A layer without
    a typical change is not compared (0: nothing compared)."""
    return sizes_of(measure_changes(start, states, rates), typical)


def relative_changes(start: State, states: Sequence[State]) -> list[float]:
    """Each state's change from ``start`` over the size of what it changed: ``||x - s|| / ||s||``
    over the floating-point elements it holds (a narrow HeteroSFL bottleneck: its prefix of a
    layer); 0 where it holds none, or where they were all zero."""
    return relative_of(measure_changes(start, states))


def _stacked(key: str, states: Sequence[State], default: Optional[torch.Tensor]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The states' values of ``key`` stacked along a new first dimension, NaN where a state does
    not hold the element (not the key, or past its prefix); and the full shape."""
    held = [s[key] for s in states if key in s]
    full = tuple(max(t.shape[d] for t in held) for d in range(held[0].dim()))
    if default is not None and default.dim() == len(full):
        full = tuple(max(a, b) for a, b in zip(full, default.shape))
    x = torch.full((len(held), *full), math.nan, dtype=torch.float64)
    for i, t in enumerate(held):
        region: tuple[Any, ...] = (i, *(slice(0, n) for n in t.shape))
        x[region] = t.detach().to(torch.float64).cpu()
    return x, full


def _coordinatewise(states: Sequence[State], defaults: Optional[State], trim: Optional[float]) -> dict[str, torch.Tensor]:
    """Median (``trim`` None) or ``trim``-trimmed mean of every element over its holders."""
    keys: list[str] = []
    for s in states:
        keys.extend(k for k in s if k not in keys)
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        ref = next(s[key] for s in states if key in s)
        default = defaults.get(key) if defaults is not None else None
        x, full = _stacked(key, states, default)
        count = (~torch.isnan(x)).sum(dim=0)
        ordered, _ = torch.sort(x, dim=0)             # NaN sorts last
        if trim is None:
            lo = ((count - 1).clamp(min=0) // 2).unsqueeze(0)
            hi = (count // 2).clamp(max=x.shape[0] - 1).unsqueeze(0)
            value = (ordered.gather(0, lo) + ordered.gather(0, hi)).squeeze(0) / 2
        else:
            k = torch.floor(trim * count.to(torch.float64)).to(torch.long)
            rank = torch.arange(x.shape[0]).view(-1, *([1] * len(full)))
            keep = (rank >= k) & (rank < count - k)
            value = torch.where(keep, ordered, torch.zeros_like(ordered)).sum(dim=0) / keep.sum(dim=0).clamp(min=1)
        uncovered = count == 0
        if uncovered.any():
            if default is None or tuple(default.shape) != full:
                raise ValueError(f"{key}: some elements are held by no state and no default was given")
            value = torch.where(uncovered, default.detach().to(torch.float64).cpu(), value)
        out[key] = value.round().to(ref.dtype) if not ref.is_floating_point() else value.to(ref.dtype)
    return out


def coordinate_median(states: Sequence[State], defaults: Optional[State] = None) -> dict[str, torch.Tensor]:
    """Every element the median of its holders' values (the mean of the two middle ones for an
    even count); elements no state holds take ``defaults``' value."""
    if not states:
        raise ValueError("need at least one state")
    return _coordinatewise(states, defaults, None)


def trimmed_mean(states: Sequence[State], trim: float, defaults: Optional[State] = None) -> dict[str, torch.Tensor]:
    """Every element the mean of its holders' values after the ``floor(trim · n)`` largest and
    smallest are dropped (``n``: the element's holders); ``0 <= trim < 0.5``."""
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    if not states:
        raise ValueError("need at least one state")
    return _coordinatewise(states, defaults, trim)


def _distance(a: State, b: State) -> float:
    """Mean squared difference of two states' changes over the elements both hold."""
    total, count = 0.0, 0
    for key in a.keys() & b.keys():
        ta, tb = a[key], b[key]
        if not _floating(ta) or ta.dim() != tb.dim():
            continue
        shape = tuple(min(x, y) for x, y in zip(ta.shape, tb.shape))
        diff = _prefix(ta, shape).detach().to(torch.float64) - _prefix(tb, shape).detach().to(torch.float64)
        total += float((diff * diff).sum())
        count += diff.numel()
    return total / count if count else math.inf


def multi_krum(states: Sequence[State], f: int) -> tuple[list[int], list[float]]:
    """The indices of the ``n − f`` states Multi-Krum keeps (ascending score), and every
    state's score: the sum of its ``n − f − 2`` smallest distances (at least one) to the others.
    Distances between the states are those between their changes (the round's start cancels)."""
    n = len(states)
    if not 0 <= f < n:
        raise ValueError(f"f must be in [0, {n}), got {f}")
    d = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            d[i][j] = d[j][i] = _distance(states[i], states[j])
    near = max(1, n - f - 2)
    scores = [sum(sorted(d[i][j] for j in range(n) if j != i)[:near]) if n > 1 else 0.0 for i in range(n)]
    keep = sorted(range(n), key=lambda i: (scores[i], i))[:n - f]
    return sorted(keep), scores
