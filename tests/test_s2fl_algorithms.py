"""S2FL pure algorithms: grouping against brute force, the warm-up, the median rule, the table."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from sfl_core.accounting import model_costs
from sfl_core.grouping import (balance_distance, group_by_balance, group_sizes, grouping_cost,
                               random_groups)
from sfl_core.models import build_model
from sfl_core.sliding_split import (CANDIDATE_SPLITS, ClientTimeTable, candidate_splits, estimate_round_time,
                                    median_rule, warmup_split)
from sfl_core.timing import agent_round_time


def _counts(n, seed, classes=10, alpha=0.3):
    rng = np.random.default_rng(seed)
    return {f"a{i:03d}": [int(v) for v in rng.dirichlet([alpha] * classes) * 200 + (rng.random(classes) < 0.1)]
            for i in range(n)}


def _brute_force(counts, sizes):
    agents = sorted(counts)
    best = math.inf
    for perm in itertools.permutations(agents):
        groups, pos = [], 0
        for s in sizes:
            groups.append(perm[pos:pos + s])
            pos += s
        best = min(best, grouping_cost(groups, counts))
    return best


def test_balance_distance_by_hand():
    # two agents, 2 classes: summed [3, 1] -> [0.75, 0.25] vs [0.5, 0.5]: sqrt(2 * 0.25^2)
    assert balance_distance([[2, 1], [1, 0]]) == pytest.approx(math.sqrt(2 * 0.25 ** 2))
    assert balance_distance([[5, 5]]) == 0.0


def test_group_sizes():
    assert group_sizes(10, 5) == [5, 5]
    assert group_sizes(11, 5) == [4, 4, 3]
    assert group_sizes(3, 5) == [3]
    with pytest.raises(ValueError):
        group_sizes(4, 0)


@pytest.mark.parametrize("n,size,seed", [(4, 2, 0), (5, 2, 1), (6, 3, 2), (6, 2, 3), (7, 3, 4), (8, 4, 5)])
def test_exact_grouping_equals_brute_force(n, size, seed):
    counts = _counts(n, seed)
    groups = group_by_balance(counts, size)
    assert sorted(len(g) for g in groups) == sorted(group_sizes(n, size))
    assert sorted(a for g in groups for a in g) == sorted(counts)
    assert grouping_cost(groups, counts) == pytest.approx(_brute_force(counts, group_sizes(n, size)))


@pytest.mark.parametrize("seed", range(4))
def test_heuristic_close_to_brute_force_and_better_than_random(seed):
    counts = _counts(8, seed)
    heuristic = group_by_balance(counts, 2, exact_max_agents=0)   # force the heuristic
    best = _brute_force(counts, group_sizes(8, 2))
    assert grouping_cost(heuristic, counts) <= 1.25 * best + 1e-9
    rnd = np.mean([grouping_cost(random_groups(list(counts), 2, s), counts) for s in range(20)])
    assert grouping_cost(heuristic, counts) < rnd


def test_grouping_100_agents_under_a_second_and_deterministic():
    counts = _counts(100, 7)
    t0 = time.perf_counter()
    groups = group_by_balance(counts, 5)
    assert time.perf_counter() - t0 < 1.0
    assert groups == group_by_balance(counts, 5)
    rnd = np.mean([grouping_cost(random_groups(list(counts), 5, s), counts) for s in range(10)])
    assert grouping_cost(groups, counts) < 0.6 * rnd


def test_grouping_errors():
    with pytest.raises(ValueError, match="a1"):
        group_by_balance({"a0": [1, 2], "a1": [0, 0]}, 2)
    with pytest.raises(ValueError, match="classes"):
        group_by_balance({"a0": [1, 2], "a1": [1, 2, 3]}, 2)


def test_warmup_sequence():
    assert [warmup_split(r, (2, 3, 4)) for r in range(1, 6)] == [2, 3, 4, None, None]


def test_median_rule_by_hand():
    t = ClientTimeTable()
    # agent: times at splits 1,2,3
    rows = {"slow": (9.0, 6.0, 3.0), "mid": (5.0, 4.0, 2.5), "fast": (3.0, 2.0, 1.0)}
    for a, ts in rows.items():
        for s, v in zip((1, 2, 3), ts):
            t.record(a, s, v, round=s)
    # the 9 times sorted: 1, 2, 2.5, 3, 3, 4, 5, 6, 9 -> median 3
    assert median_rule(t, list(rows), (1, 2, 3)) == {"slow": 3, "mid": 3, "fast": 1}
    # only the selected agents' times count: without 'slow' the median is (2.5+3)/2 = 2.75
    assert median_rule(t, ["mid", "fast"], (1, 2, 3)) == {"mid": 3, "fast": 1}


def test_measurements_override_estimates_not_the_reverse_and_json_round_trip():
    t = ClientTimeTable()
    t.set_estimate("a", 2, 10.0)
    assert t.get("a", 2).estimated
    t.record("a", 2, 4.0, round=3)
    t.set_estimate("a", 2, 99.0)
    assert (t.get("a", 2).seconds, t.get("a", 2).estimated, t.get("a", 2).round) == (4.0, False, 3)
    t2 = ClientTimeTable.from_json(t.to_json())
    assert t2.get("a", 2) == t.get("a", 2)
    assert "4.000" in t2.format([1, 2]) and "-" in t2.format([1, 2])
    with pytest.raises(ValueError):
        median_rule(ClientTimeTable(), ["x"], (1, 2))


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_candidate_splits_valid_and_meaningfully_different(shape):
    for name in CANDIDATE_SPLITS:
        if name == "cnn1d":
            continue
        cands = candidate_splits(name)
        assert len(cands) >= 3
        model = build_model(name, shape, 10)
        for s in cands:
            model.check_split(s)
        costs = model_costs(name, shape, 10)
        flops = [costs[s].client_flops for s in cands]
        acts = [costs[s].activation_bytes for s in cands]
        assert all(b > a for a, b in zip(flops, flops[1:])), (name, flops)
        for i in range(len(cands) - 1):  # each step changes the work or the traffic substantially
            assert flops[i + 1] > 1.3 * flops[i] or max(acts[i], acts[i + 1]) > 1.5 * min(acts[i], acts[i + 1]), \
                (name, cands[i], flops, acts)


def test_estimate_round_time_matches_eq1_by_hand():
    costs = model_costs("small_cnn", (1, 28, 28), 10)
    c = costs[2]
    samples = 320
    got = estimate_round_time(c, samples=samples, compute_flops=1e10, uplink_bytes_per_s=2e6,
                              downlink_bytes_per_s=2e6, server_flops_per_s=5e10)
    # Eq. 1: (2|Wc| + 2 p q) / R + F_c / Comp_c + F_s / Comp_s
    by_hand = ((2 * c.client_param_bytes + 2 * samples * c.activation_bytes) / 2e6
               + c.client_flops * samples / 1e10 + c.server_flops * samples / 5e10)
    assert got == pytest.approx(by_hand)
    assert got == pytest.approx(agent_round_time(
        client_flops=c.client_flops * samples, server_flops=c.server_flops * samples,
        bytes_up=c.client_param_bytes + samples * c.activation_bytes,
        bytes_down=c.client_param_bytes + samples * c.activation_bytes, client_flops_per_s=1e10,
        server_flops_per_s=5e10, uplink_bytes_per_s=2e6, downlink_bytes_per_s=2e6).total_s)
