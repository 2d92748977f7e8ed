"""S2FL data-balance grouping (SPEC §4, Eq. 2): pure functions.

Agents are partitioned into groups whose summed label distribution is as close to uniform
as possible; each group's activations then train one server copy together, so every server
copy sees a balanced mix even when each agent's data is skewed.

Objective: the sum over groups of Eq. 2's L2 distance. Exact search (all partitions into
the prescribed group sizes, with symmetry pruning) when the round is small; otherwise a
greedy construction — the most skewed remaining agent seeds a group, then the agent that
most reduces the group's distance joins, until the group is full — followed by local
improvement with pairwise swaps between groups until no swap helps (bounded passes).
"""

from __future__ import annotations

import math
import random
from typing import Mapping, Sequence

import numpy as np


def balance_distance(label_counts: Sequence[Sequence[int]]) -> float:
    """Eq. 2 for one group: L2 distance between the group's normalised label mix and uniform."""
    total = np.sum(np.asarray(label_counts, dtype=np.float64), axis=0)
    n = total.size
    s = total.sum()
    if s <= 0:
        raise ValueError("a group without any samples has no label distribution")
    return float(np.sqrt(np.sum((total / s - 1.0 / n) ** 2)))


def grouping_cost(groups: Sequence[Sequence[str]], label_counts: Mapping[str, Sequence[int]]) -> float:
    return sum(balance_distance([label_counts[a] for a in g]) for g in groups)


def group_sizes(n_agents: int, group_size: int) -> list[int]:
    """``ceil(n / group_size)`` groups with sizes differing by at most one."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if n_agents <= 0:
        return []
    k = math.ceil(n_agents / group_size)
    base, extra = divmod(n_agents, k)
    return [base + 1] * extra + [base] * (k - extra)


def _check(label_counts: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
    counts = {a: np.asarray(c, dtype=np.float64) for a, c in label_counts.items()}
    widths = {c.size for c in counts.values()}
    if len(widths) > 1:
        raise ValueError(f"agents report different numbers of classes: {sorted(widths)}")
    for a, c in counts.items():
        if c.sum() <= 0 or (c < 0).any():
            raise ValueError(f"agent {a!r} has no samples (or negative counts)")
    return counts


def _dist(total: np.ndarray) -> float:
    return float(np.sqrt(np.sum((total / total.sum() - 1.0 / total.size) ** 2)))


def _canonical(groups: list[list[str]]) -> list[list[str]]:
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def group_by_balance(label_counts: Mapping[str, Sequence[int]], group_size: int, *,
                     exact_max_agents: int = 10, seed: int = 0, max_passes: int = 20) -> list[list[str]]:
    """Partition agents into balanced groups (see module docstring). Deterministic."""
    counts = _check(label_counts)
    agents = sorted(counts)
    sizes = group_sizes(len(agents), group_size)
    if len(sizes) <= 1:
        return [agents] if agents else []
    if len(agents) <= exact_max_agents:
        return _exact(agents, counts, sizes)
    groups = _greedy(agents, counts, sizes, seed)
    return _canonical(_improve(groups, counts, max_passes))


def _exact(agents: list[str], counts: dict[str, np.ndarray], sizes: list[int]) -> list[list[str]]:
    """Branch and bound over set partitions: the first unplaced agent anchors the next group
    (so each partition is generated once), trying every remaining group size."""
    from itertools import combinations

    best: tuple[float, list[list[str]]] = (math.inf, [])

    def rec(remaining: list[str], sizes_left: list[int], acc: list[list[str]], cost: float) -> None:
        nonlocal best
        if cost >= best[0]:
            return
        if not remaining:
            best = (cost, [list(g) for g in acc])
            return
        first, rest = remaining[0], remaining[1:]
        for size in sorted(set(sizes_left), reverse=True):
            left_sizes = list(sizes_left)
            left_sizes.remove(size)
            for others in combinations(rest, size - 1):
                group = [first, *others]
                acc.append(group)
                rec([a for a in rest if a not in others], left_sizes, acc,
                    cost + _dist(sum(counts[a] for a in group)))
                acc.pop()

    rec(agents, list(sizes), [], 0.0)
    return _canonical(best[1])


def _greedy(agents: list[str], counts: dict[str, np.ndarray], sizes: list[int], seed: int) -> list[list[str]]:
    remaining = set(agents)
    skew = {a: _dist(counts[a]) for a in agents}
    rng = random.Random(seed)
    groups = []
    for size in sizes:
        seed_agent = max(sorted(remaining), key=lambda a: (skew[a], rng.random()))
        group = [seed_agent]
        remaining.discard(seed_agent)
        total = counts[seed_agent].copy()
        while len(group) < size:
            nxt = min(sorted(remaining), key=lambda a: _dist(total + counts[a]))
            group.append(nxt)
            remaining.discard(nxt)
            total += counts[nxt]
        groups.append(group)
    return groups


def _dists(totals: np.ndarray) -> np.ndarray:
    """Eq. 2 over the last axis, vectorised."""
    return np.sqrt(np.sum((totals / totals.sum(axis=-1, keepdims=True) - 1.0 / totals.shape[-1]) ** 2, axis=-1))


def _improve(groups: list[list[str]], counts: dict[str, np.ndarray], max_passes: int) -> list[list[str]]:
    """Apply the best improving swap between every pair of groups, pass after pass."""
    totals = [sum(counts[a] for a in g) for g in groups]
    dists = [_dist(t) for t in totals]
    for _ in range(max_passes):
        improved = False
        for i in range(len(groups)):
            ci = np.stack([counts[a] for a in groups[i]])
            for j in range(i + 1, len(groups)):
                cj = np.stack([counts[b] for b in groups[j]])
                delta = cj[None, :, :] - ci[:, None, :]              # swap a (row) with b (column)
                gain = dists[i] + dists[j] - _dists(totals[i] + delta) - _dists(totals[j] - delta)
                ai, bj = np.unravel_index(int(np.argmax(gain)), gain.shape)
                if gain[ai, bj] <= 1e-12:
                    continue
                a, b = groups[i][ai], groups[j][bj]
                groups[i][ai], groups[j][bj] = b, a
                totals[i], totals[j] = totals[i] + delta[ai, bj], totals[j] - delta[ai, bj]
                dists[i], dists[j] = _dist(totals[i]), _dist(totals[j])
                ci[ai] = counts[b]
                improved = True
        if not improved:
            break
    return groups


def random_groups(agents: Sequence[str], group_size: int, seed: int) -> list[list[str]]:
    """The +R baseline: groups of the same sizes, drawn at random."""
    order = sorted(agents)
    random.Random(seed).shuffle(order)
    out, pos = [], 0
    for size in group_sizes(len(order), group_size):
        out.append(order[pos:pos + size])
        pos += size
    return _canonical(out)
