"""HeteroSFL pure algorithms: grouping by link rate, widths, HetBL averaging, set R."""

from __future__ import annotations

import pytest
import torch

from sfl_core.losses import under_represented_classes
from sfl_core.methods.heterosfl.groups import group_by_link_rate, widths_for_groups


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
    """HeteroSFL §4.2: a class is under-represented when its share of the high group's data is
    below θ times its share of the global data (label proportions)."""
    global_counts = [400, 400, 100, 100, 0]                  # shares .4 .4 .1 .1 0
    high = [200, 193, 3, 4, 0]                               # shares .5 .4825 .0075 .01 0
    # 0.0075 < 0.1 * 0.1; class 3 sits exactly at 10 % of its global share; class 4 is absent everywhere
    assert under_represented_classes(high, global_counts) == [2]
    assert under_represented_classes(high, global_counts, theta=0.5) == [2, 3]
    assert under_represented_classes(high, global_counts, theta=0.0) == []
    assert under_represented_classes([0] * 5, global_counts) == [0, 1, 2, 3]   # a group without data lacks all


def test_under_represented_classes_compare_shares_not_counts():
    """The paper calls R "a subset of minority classes in high-end group": a group that holds
    a small part of all data but over-represents classes 0 and 1 must not have them in R, as the
    absolute reading (group count < θ x global count) would have it. Proportions do not change
    when the population grows around the group."""
    high = [200, 193, 3, 4]
    for scale in (1, 10, 100):
        assert under_represented_classes(high, [400 * scale, 400 * scale, 100 * scale, 100 * scale]) == [2]
    assert under_represented_classes(high, [4000, 4000, 1000, 1000], relative=False) == [0, 1, 2, 3]
    assert under_represented_classes(high, [400, 400, 100, 100], relative=False) == [2, 3]


def test_under_represented_classes_validation():
    with pytest.raises(ValueError):
        under_represented_classes([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="more samples"):
        under_represented_classes([5, 2], [4, 2])
    with pytest.raises(ValueError):
        under_represented_classes([1, 2], [1, 2], theta=1.5)
