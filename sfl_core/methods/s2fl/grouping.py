"""S2FL data-balance grouping (docs/methods/s2fl.md; S2FL paper, Yan et al. 2023, Eq. 2): pure functions.

Why: under label skew every agent's batches are lopsided. S2FL trains one server copy per
*group* of agents, on the union of the group's activations, so if the group's summed label
distribution is close to uniform each server copy sees balanced data even though no agent
does.

Objective (minimised): ``sum over groups G of Dist(G)``, with Eq. 2

    Dist(G) = sqrt( sum_i ( sum_{c in G} |D_c^(i)| / sum_{p in G} |D_p|  -  1/n )^2 )

Group sizes are fixed up front by :func:`group_sizes` (``ceil(N / group_size)`` groups whose
sizes differ by at most one), so the search only decides *who* goes where.

Search:

* **Exact** when ``N <= exact_max_agents`` (default 10): depth-first enumeration of the set
  partitions with those sizes. Symmetry pruning: the first unplaced agent (in sorted
  order) always anchors the next group, and only distinct remaining sizes are tried for it,
  so every partition is generated exactly once (945 for 10 agents in pairs, 2,100 for
  sizes 4+3+3). Branch and bound: distances are >= 0, so a partial sum already >= the best
  complete one is cut.
* **Heuristic** otherwise: greedy construction — each group is seeded with the most
  skewed remaining agent (largest single-agent Dist; ties broken by a ``seed``-driven
  random key), then repeatedly takes the remaining agent that minimises the group's Dist —
  followed by local improvement with pairwise swaps between groups: for each group in
  turn, the best swap of one of its members with any agent of another group is applied if
  it lowers the objective; passes repeat until none helps (at most ``max_passes``). Each
  group's scan is one vectorised numpy evaluation over all outside agents, so a pass costs
  O(N^2 · classes) arithmetic but only O(N / group_size) Python steps: ~10 ms for 100
  agents, well under a second per pass for 1,000.

Output is canonical — members sorted, groups sorted by first member — so plans, logs and
tests compare equal regardless of internal order. Everything is deterministic given the
input and ``seed``.
"""

from __future__ import annotations

import math
import random
from itertools import combinations
from typing import Mapping, Sequence

import numpy as np

__all__ = ["balance_distance", "grouping_cost", "group_sizes", "group_by_balance", "random_groups"]

_EPS = 1e-12  # improvements smaller than this are float noise, not progress


# ====================================================================== objective


def balance_distance(label_counts: Sequence[Sequence[int]]) -> float:
    """Eq. 2 for ONE group: sum the members' label counts, normalise, L2 distance to uniform ``1/n``.

    ``label_counts`` is one row of per-class counts per member. Raises ``ValueError`` for
    no members, rows of different lengths, negative counts or a group with no samples.
    """
    rows = [np.asarray(r, dtype=np.float64) for r in label_counts]
    if not rows:
        raise ValueError("balance_distance: a group needs at least one member")
    widths = {r.shape for r in rows}
    if len(widths) != 1 or rows[0].ndim != 1 or rows[0].size == 0:
        raise ValueError(f"balance_distance: members report inconsistent class counts (shapes {sorted(widths)})")
    total = np.sum(rows, axis=0)
    if not np.all(np.isfinite(total)) or (total < 0).any():
        raise ValueError("balance_distance: label counts must be finite and non-negative")
    if total.sum() <= 0:
        raise ValueError("balance_distance: a group without any samples has no label distribution")
    return _dist(total)


def grouping_cost(groups: Sequence[Sequence[str]], label_counts: Mapping[str, Sequence[int]]) -> float:
    """The objective: the sum of :func:`balance_distance` over the groups."""
    return float(sum(balance_distance([label_counts[a] for a in g]) for g in groups))


def _dist(total: np.ndarray) -> float:
    return float(np.sqrt(np.sum((total / total.sum() - 1.0 / total.size) ** 2)))


def _dists(totals: np.ndarray) -> np.ndarray:
    """Eq. 2 over the last axis, vectorised (totals must have positive sums)."""
    return np.sqrt(np.sum((totals / totals.sum(axis=-1, keepdims=True) - 1.0 / totals.shape[-1]) ** 2, axis=-1))


# ====================================================================== sizes and input


def group_sizes(n_agents: int, group_size: int) -> list[int]:
    """``ceil(n_agents / group_size)`` groups, sizes as equal as possible (larger first).

    E.g. 11 agents with ``group_size=5`` -> ``[4, 4, 3]`` rather than ``[5, 5, 1]``: a
    singleton group is no better than no grouping at all.
    """
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if n_agents < 0:
        raise ValueError(f"n_agents must be >= 0, got {n_agents!r}")
    if n_agents == 0:
        return []
    k = math.ceil(n_agents / int(group_size))
    base, extra = divmod(n_agents, k)
    return [base + 1] * extra + [base] * (k - extra)


def _check(label_counts: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
    counts: dict[str, np.ndarray] = {}
    for a, c in label_counts.items():
        arr = np.asarray(c, dtype=np.float64)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"agent {a!r}: label counts must be a non-empty list of per-class counts, got {c!r}")
        if not np.all(np.isfinite(arr)) or (arr < 0).any():
            raise ValueError(f"agent {a!r}: label counts must be finite and non-negative, got {c!r}")
        if arr.sum() <= 0:
            raise ValueError(f"agent {a!r} has no samples (all label counts are zero); it cannot be grouped")
        counts[a] = arr
    widths = {c.size for c in counts.values()}
    if len(widths) > 1:
        by_width = {w: sorted(a for a, c in counts.items() if c.size == w)[:3] for w in sorted(widths)}
        raise ValueError(f"agents report different numbers of classes: {by_width}")
    return counts


def _canonical(groups: Sequence[Sequence[str]]) -> list[list[str]]:
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


# ====================================================================== search


def group_by_balance(label_counts: Mapping[str, Sequence[int]], group_size: int, *,
                     exact_max_agents: int = 10, seed: int = 0, max_passes: int = 50) -> list[list[str]]:
    """Partition the agents into groups of sizes :func:`group_sizes` minimising :func:`grouping_cost`.

    Exact for ``len(label_counts) <= exact_max_agents``, greedy + pairwise swaps otherwise
    (see the module docstring). ``group_size >= N`` gives one group, ``group_size == 1``
    singletons. Raises ``ValueError`` for ``group_size < 1``, an agent without samples (named)
    or agents reporting different numbers of classes.
    """
    sizes = group_sizes(len(label_counts), group_size)  # validates group_size first
    counts = _check(label_counts)
    agents = sorted(counts)
    if len(sizes) <= 1:
        return [agents] if agents else []
    if sizes[0] == 1:
        return [[a] for a in agents]
    if len(agents) <= exact_max_agents:
        return _exact(agents, counts, sizes)
    groups = _greedy(agents, counts, sizes, seed)
    return _canonical(_improve(groups, counts, max_passes))


def _exact(agents: list[str], counts: dict[str, np.ndarray], sizes: list[int]) -> list[list[str]]:
    """Branch and bound over the set partitions with the given sizes (each generated once)."""
    best_cost = math.inf
    best: list[list[str]] = []

    def rec(remaining: list[str], sizes_left: list[int], acc: list[list[str]], cost: float) -> None:
        nonlocal best_cost, best
        if cost >= best_cost - _EPS:
            return
        if not remaining:
            best_cost, best = cost, [list(g) for g in acc]
            return
        first, rest = remaining[0], remaining[1:]
        for size in sorted(set(sizes_left), reverse=True):
            left_sizes = list(sizes_left)
            left_sizes.remove(size)
            for others in combinations(rest, size - 1):
                group = [first, *others]
                taken = set(others)
                acc.append(group)
                rec([a for a in rest if a not in taken], left_sizes, acc,
                    cost + _dist(np.sum([counts[a] for a in group], axis=0)))
                acc.pop()

    rec(agents, list(sizes), [], 0.0)
    return _canonical(best)


def _greedy(agents: list[str], counts: dict[str, np.ndarray], sizes: list[int], seed: int) -> list[list[str]]:
    """Most skewed remaining agent seeds a group; the agent that most reduces its Dist joins."""
    mat = np.stack([counts[a] for a in agents])                  # agents are sorted: stable indices
    rng = random.Random(seed)
    skew = _dists(mat)
    tiebreak = np.array([rng.random() for _ in agents])
    free = np.ones(len(agents), dtype=bool)
    groups: list[list[str]] = []
    for size in sizes:
        key = np.where(free, skew + 1e-9 * tiebreak, -np.inf)
        first = int(np.argmax(key))
        free[first] = False
        members, total = [first], mat[first].copy()
        while len(members) < size:
            idx = np.flatnonzero(free)
            nxt = int(idx[np.argmin(_dists(total + mat[idx]))])  # argmin: first (sorted) on ties
            free[nxt] = False
            members.append(nxt)
            total += mat[nxt]
        groups.append([agents[i] for i in members])
    return groups


def _improve(groups: list[list[str]], counts: dict[str, np.ndarray], max_passes: int) -> list[list[str]]:
    """Pairwise swaps between groups until no swap lowers the objective (at most ``max_passes``).

    Per group ``g`` and pass: evaluate swapping each member ``a`` of ``g`` with every agent
    ``b`` outside ``g`` in one numpy expression and apply the best improving swap.
    """
    agents = [a for g in groups for a in g]
    index = {a: i for i, a in enumerate(agents)}
    mat = np.stack([counts[a] for a in agents])
    member_of = np.empty(len(agents), dtype=np.int64)
    members: list[list[int]] = []
    for gi, g in enumerate(groups):
        ids = [index[a] for a in g]
        members.append(ids)
        member_of[ids] = gi
    totals = np.stack([mat[ids].sum(axis=0) for ids in members])
    dists = _dists(totals)
    for _ in range(max_passes):
        improved = False
        for gi in range(len(members)):
            inside = np.array(members[gi])
            outside = np.flatnonzero(member_of != gi)
            delta = mat[outside][None, :, :] - mat[inside][:, None, :]       # (|g|, |out|, C): b in, a out
            other = member_of[outside]                                       # group of each outside agent
            new_g = _dists(totals[gi] + delta)
            new_o = _dists(totals[other][None, :, :] - delta)
            gain = dists[gi] + dists[other][None, :] - new_g - new_o
            ai, bj = np.unravel_index(int(np.argmax(gain)), gain.shape)
            if gain[ai, bj] <= _EPS:
                continue
            a, b, go = int(inside[ai]), int(outside[bj]), int(other[bj])
            members[gi][ai] = b
            members[go][members[go].index(b)] = a
            member_of[a], member_of[b] = go, gi
            totals[gi] += mat[b] - mat[a]
            totals[go] += mat[a] - mat[b]
            dists[gi], dists[go] = _dist(totals[gi]), _dist(totals[go])
            improved = True
        if not improved:
            break
    return [[agents[i] for i in ids] for ids in members]


def random_groups(agents: Sequence[str], group_size: int, seed: int) -> list[list[str]]:
    """The +R ablation baseline: groups of the same sizes as :func:`group_by_balance`, drawn at random."""
    order = sorted(agents)
    if len(set(order)) != len(order):
        raise ValueError("random_groups: agent names must be unique")
    sizes = group_sizes(len(order), group_size)
    random.Random(seed).shuffle(order)
    out, pos = [], 0
    for size in sizes:
        out.append(order[pos:pos + size])
        pos += size
    return _canonical(out)
