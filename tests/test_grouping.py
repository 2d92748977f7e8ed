"""S2FL data-balance grouping (Eq. 2): by hand, against brute force, speed, determinism, errors."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from sfl_core.methods.s2fl.grouping import balance_distance, group_by_balance, group_sizes, grouping_cost, random_groups


def _counts(n: int, seed: int, classes: int = 10, alpha: float = 0.3) -> dict[str, list[int]]:
    """Dirichlet label skew like the S2FL experiments (every agent keeps >= 1 sample)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        c = (rng.dirichlet([alpha] * classes) * 200).astype(int)
        c[rng.integers(classes)] += 1
        out[f"a{i:03d}"] = [int(v) for v in c]
    return out


def _partitions(agents: list[str], sizes: list[int]):
    """Every partition of ``agents`` into groups with the size multiset ``sizes`` (no pruning)."""
    if not agents:
        yield []
        return
    first, rest = agents[0], agents[1:]
    for size in sorted(set(sizes)):
        left = list(sizes)
        left.remove(size)
        for others in itertools.combinations(rest, size - 1):
            remaining = [a for a in rest if a not in others]
            for tail in _partitions(remaining, left):
                yield [[first, *others], *tail]


def _brute_force(counts: dict[str, list[int]], sizes: list[int]) -> float:
    return min(grouping_cost(p, counts) for p in _partitions(sorted(counts), sizes))


def _check_partition(groups, counts, group_size):
    assert sorted(a for g in groups for a in g) == sorted(counts)
    assert sorted(len(g) for g in groups) == sorted(group_sizes(len(counts), group_size))
    assert all(g == sorted(g) for g in groups)
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)


# ---------------------------------------------------------------- objective by hand


def test_balance_distance_by_hand():
    # [2,1] + [1,0] = [3,1] -> [0.75, 0.25]; uniform [0.5, 0.5]: sqrt(0.25^2 + 0.25^2)
    assert balance_distance([[2, 1], [1, 0]]) == pytest.approx(math.sqrt(2 * 0.25 ** 2))
    # complementary one-class agents sum to uniform
    assert balance_distance([[7, 0, 0], [0, 7, 0], [0, 0, 7]]) == pytest.approx(0.0)
    # a single one-class agent over 4 classes: (1 - 1/4)^2 + 3 (1/4)^2 = 0.75
    assert balance_distance([[0, 9, 0, 0]]) == pytest.approx(math.sqrt(0.75))
    # normalisation is by the group's total, not the per-agent mean: [10,0] + [0,30] -> [0.25, 0.75]
    assert balance_distance([[10, 0], [0, 30]]) == pytest.approx(math.sqrt(2 * 0.25 ** 2))


def test_grouping_cost_sums_groups():
    counts = {"a": [1, 0], "b": [0, 1], "c": [3, 1], "d": [1, 0]}
    assert grouping_cost([["a", "b"], ["c", "d"]], counts) == pytest.approx(
        0.0 + balance_distance([[3, 1], [1, 0]]))


def test_balance_distance_errors():
    with pytest.raises(ValueError, match="member"):
        balance_distance([])
    with pytest.raises(ValueError, match="inconsistent"):
        balance_distance([[1, 2], [1, 2, 3]])
    with pytest.raises(ValueError, match="no label distribution"):
        balance_distance([[0, 0], [0, 0]])
    with pytest.raises(ValueError, match="non-negative"):
        balance_distance([[3, -1]])


def test_group_sizes():
    assert group_sizes(10, 5) == [5, 5]
    assert group_sizes(11, 5) == [4, 4, 3]
    assert group_sizes(12, 5) == [4, 4, 4]
    assert group_sizes(3, 5) == [3]
    assert group_sizes(7, 1) == [1] * 7
    assert group_sizes(0, 3) == []
    for n in range(1, 40):
        for g in range(1, 12):
            s = group_sizes(n, g)
            assert sum(s) == n and len(s) == math.ceil(n / g) and max(s) - min(s) <= 1 and max(s) <= g
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="group_size"):
            group_sizes(4, bad)


# ---------------------------------------------------------------- exact search


@pytest.mark.parametrize("n,size,seed", [
    (4, 2, 0), (4, 3, 1), (5, 2, 2), (5, 3, 3), (6, 2, 4), (6, 3, 5), (6, 4, 6), (7, 2, 7), (7, 3, 8),
    (7, 4, 9), (8, 2, 10), (8, 3, 11), (8, 4, 12),
])
def test_exact_equals_brute_force(n, size, seed):
    counts = _counts(n, seed)
    groups = group_by_balance(counts, size)
    _check_partition(groups, counts, size)
    assert grouping_cost(groups, counts) == pytest.approx(_brute_force(counts, group_sizes(n, size)), abs=1e-12)


def test_brute_force_enumerator_is_complete():
    # the reference itself must be right: 6 agents in pairs -> 5*3*1 = 15 partitions, sizes 3+2 of 5 -> 10
    assert len(list(_partitions(list("abcdef"), [2, 2, 2]))) == 15
    assert len(list(_partitions(list("abcde"), [3, 2]))) == 10
    assert len({tuple(map(tuple, p)) for p in _partitions(list("abcdefg"), [3, 2, 2])}) == 105


def test_exact_finds_the_perfect_pairing():
    # one-class agents: the only zero-cost grouping pairs class 0 with class 1 each time
    counts = {"a": [5, 0], "b": [5, 0], "c": [5, 0], "x": [0, 5], "y": [0, 5], "z": [0, 5]}
    groups = group_by_balance(counts, 2)
    assert grouping_cost(groups, counts) == pytest.approx(0.0)
    assert all({counts[g[0]].index(5), counts[g[1]].index(5)} == {0, 1} for g in groups)


# ---------------------------------------------------------------- heuristic


@pytest.mark.parametrize("n", [8, 9, 10])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_heuristic_near_optimal_and_better_than_random(n, size):
    ratios, wins = [], 0
    for seed in range(3):
        counts = _counts(n, 1000 * n + 10 * size + seed)
        heur = group_by_balance(counts, size, exact_max_agents=0)   # force the heuristic
        _check_partition(heur, counts, size)
        best = _brute_force(counts, group_sizes(n, size))
        h = grouping_cost(heur, counts)
        assert h >= best - 1e-9
        ratios.append(h / best)
        rnd = np.mean([grouping_cost(random_groups(list(counts), size, s), counts) for s in range(20)])
        wins += h <= rnd
    assert max(ratios) <= 1.5, ratios
    assert wins == 3


def test_heuristic_swaps_improve_on_greedy_alone():
    from sfl_core.methods.s2fl import grouping as G
    counts = _counts(60, 3)
    checked = G._check(counts)
    greedy = G._greedy(sorted(counts), checked, group_sizes(60, 4), 0)
    improved = group_by_balance(counts, 4)
    assert grouping_cost(improved, counts) < grouping_cost(greedy, counts)


def test_100_agents_fast_deterministic_and_much_better_than_random():
    counts = _counts(100, 7)
    t0 = time.perf_counter()
    groups = group_by_balance(counts, 5)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, elapsed
    _check_partition(groups, counts, 5)
    assert groups == group_by_balance(dict(reversed(list(counts.items()))), 5)   # input order irrelevant
    assert groups == group_by_balance(counts, 5, seed=0)
    rnd = np.mean([grouping_cost(random_groups(list(counts), 5, s), counts) for s in range(10)])
    assert grouping_cost(groups, counts) < 0.6 * rnd


def test_1000_agents_reasonable():
    counts = _counts(1000, 11)
    t0 = time.perf_counter()
    groups = group_by_balance(counts, 10)
    assert time.perf_counter() - t0 < 20.0
    _check_partition(groups, counts, 10)
    rnd = grouping_cost(random_groups(list(counts), 10, 0), counts)
    assert grouping_cost(groups, counts) < 0.5 * rnd


# ---------------------------------------------------------------- edge cases and errors


def test_edge_cases():
    counts = _counts(5, 1)
    assert group_by_balance(counts, 5) == [sorted(counts)]
    assert group_by_balance(counts, 99) == [sorted(counts)]
    assert group_by_balance(counts, 1) == [[a] for a in sorted(counts)]
    assert group_by_balance({}, 3) == []
    assert group_by_balance({"solo": [1, 2]}, 3) == [["solo"]]
    # numpy rows are accepted
    assert group_by_balance({k: np.array(v) for k, v in counts.items()}, 2) == group_by_balance(counts, 2)


def test_errors():
    with pytest.raises(ValueError, match="'a1'"):
        group_by_balance({"a0": [1, 2], "a1": [0, 0]}, 2)
    with pytest.raises(ValueError, match="classes"):
        group_by_balance({"a0": [1, 2], "a1": [1, 2, 3]}, 2)
    with pytest.raises(ValueError, match="group_size"):
        group_by_balance({"a0": [1, 2], "a1": [2, 1]}, 0)
    with pytest.raises(ValueError, match="'a0'"):
        group_by_balance({"a0": [1, -2], "a1": [2, 1]}, 2)
    with pytest.raises(ValueError, match="'a0'"):
        group_by_balance({"a0": [], "a1": [2, 1]}, 2)
    with pytest.raises(ValueError, match="group_size"):
        random_groups(["a", "b"], 0, seed=0)
    with pytest.raises(ValueError, match="unique"):
        random_groups(["a", "a"], 1, seed=0)


def test_random_groups_sizes_and_seeds():
    agents = [f"x{i}" for i in range(11)]
    g0 = random_groups(agents, 5, seed=0)
    assert sorted(len(g) for g in g0) == [3, 4, 4]
    assert sorted(a for g in g0 for a in g) == sorted(agents)
    assert g0 == random_groups(list(reversed(agents)), 5, seed=0)
    assert any(random_groups(agents, 5, seed=s) != g0 for s in range(1, 5))
