"""HeteroSFL pure algorithms: grouping by link rate, widths, HetBL averaging, set R."""

from __future__ import annotations

import pytest
import torch

from sfl_core.hetero import group_by_link_rate, under_represented_classes, widths_for_groups


# ------------------------------------------------------------------ grouping
def test_quantile_groups_equal_count_slowest_first():
    rates = {"a": 5e3, "b": 1e6, "c": 2e3, "d": 8e5, "e": 1e3, "f": 9e5}
    assert group_by_link_rate(rates) == [["e", "c", "a"], ["d", "f", "b"]]
    g3 = group_by_link_rate(rates, groups=3)
    assert g3 == [["e", "c"], ["a", "d"], ["f", "b"]]
    # uneven counts: slower groups get the extra agent, sizes differ by at most one
    g = group_by_link_rate({f"x{i}": float(i + 1) for i in range(7)}, groups=3)
    assert [len(x) for x in g] == [3, 2, 2]
    assert g[0] == ["x0", "x1", "x2"]


def test_quantile_groups_deterministic_ties_and_dropped_empty():
    rates = {"b": 10.0, "a": 10.0, "c": 10.0}
    assert group_by_link_rate(rates, groups=2) == [["a", "b"], ["c"]]
    assert group_by_link_rate({"only": 3.0}, groups=4) == [["only"]]
    assert group_by_link_rate({}, groups=2) == []


def test_threshold_groups():
    rates = {"slow": 1e3, "mid": 5e4, "edge": 1e5, "fast": 1e7}
    # a rate equal to a threshold belongs to the faster group
    assert group_by_link_rate(rates, groups=3, thresholds=[1e4, 1e5]) == [["slow"], ["mid"], ["edge", "fast"]]
    # nobody between the thresholds: that group is dropped
    assert group_by_link_rate({"s": 1.0, "f": 1e9}, groups=3, thresholds=[10.0, 100.0]) == [["s"], ["f"]]


@pytest.mark.parametrize("kw", [dict(groups=0), dict(groups=3, thresholds=[5.0]),
                                dict(groups=3, thresholds=[10.0, 5.0]), dict(groups=2, thresholds=[-1.0])])
def test_grouping_rejects_bad_arguments(kw):
    with pytest.raises(ValueError):
        group_by_link_rate({"a": 1.0, "b": 2.0}, **kw)


def test_grouping_rejects_bad_rates():
    with pytest.raises(ValueError, match="link rate"):
        group_by_link_rate({"a": 0.0})
    with pytest.raises(ValueError, match="link rate"):
        group_by_link_rate({"a": float("nan")})


# ------------------------------------------------------------------ widths
def test_widths_proportional_to_rate_fastest_full():
    rates = [1e4, 6.25e4, 1.6e5]          # 16:1 fastest to slowest, as in the paper
    w = widths_for_groups(rates, 256)
    assert w == [16, 100, 256]
    assert w[-1] == 256
    # per-step transfer time width/rate equal to the fastest group's within one channel of rounding
    target = 256 / max(rates)
    for wi, r in zip(w, rates):
        assert 0 <= target - wi / r < 1 / r


def test_widths_rounding_clipping_and_monotone():
    rates = [1.0, 3.0, 7.0, 7.5]
    w = widths_for_groups(rates, 10)
    assert w == [1, 4, 9, 10]
    assert w == sorted(w)
    # a very slow group is clipped up to min_width rather than to 0
    assert widths_for_groups([1.0, 1e6], 64, min_width=4) == [4, 64]
    assert widths_for_groups([1.0, 1e6], 64) == [1, 64]
    # exact ratios do not floor one below
    assert widths_for_groups([0.5, 1.0], 256) == [128, 256]
    # order follows the rates given (fastest anywhere gets full)
    assert widths_for_groups([5.0, 5.0], 8) == [8, 8]


def test_fixed_widths_validated():
    assert widths_for_groups([1.0, 10.0], 16, fixed=[1, 16]) == [1, 16]
    with pytest.raises(ValueError, match="one per group"):
        widths_for_groups([1.0, 10.0], 16, fixed=[1, 4, 16])
    with pytest.raises(ValueError, match="integers in"):
        widths_for_groups([1.0, 10.0], 16, fixed=[0, 16])
    with pytest.raises(ValueError, match="integers in"):
        widths_for_groups([1.0, 10.0], 16, fixed=[4, 17])
    with pytest.raises(ValueError, match="non-decreasing"):
        widths_for_groups([1.0, 10.0], 16, fixed=[8, 4])
    with pytest.raises(ValueError):
        widths_for_groups([1.0, -2.0], 16)
    with pytest.raises(ValueError):
        widths_for_groups([], 16)
    with pytest.raises(ValueError):
        widths_for_groups([1.0], 16, min_width=17)


# ------------------------------------------------------------------ BDKS class set
def test_under_represented_classes_hand_example():
    global_counts = [1000, 1000, 500, 200, 0, 300]
    high = [600, 99, 50, 19, 0, 300]
    # n_high < 0.1 * n_global: class 1 (99 < 100) and 3 (19 < 20); class 2 sits exactly at 10 %,
    # class 4 is absent everywhere
    assert under_represented_classes(high, global_counts) == [1, 3]
    assert under_represented_classes(high, global_counts, theta=0.5) == [1, 2, 3]
    assert under_represented_classes(high, global_counts, theta=0.0) == []


def test_under_represented_classes_relative_variant():
    global_counts = [1000, 1000]
    high = [300, 25]       # 2.5 % of class 1's samples, but 25/325 = 7.7 % of the group vs 50 % global
    assert under_represented_classes(high, global_counts) == [1]
    assert under_represented_classes(high, global_counts, relative=True) == []
    assert under_represented_classes(high, global_counts, theta=0.2, relative=True) == [1]


def test_under_represented_classes_validation():
    with pytest.raises(ValueError):
        under_represented_classes([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="more samples"):
        under_represented_classes([5, 2], [4, 2])
    with pytest.raises(ValueError):
        under_represented_classes([1, 2], [1, 2], theta=1.5)
