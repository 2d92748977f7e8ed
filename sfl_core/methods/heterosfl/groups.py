"""HeteroSFL (docs/methods/heterosfl.md; HeteroSFL paper, Chen et al.): grouping by link rate,
per-group bottleneck widths and the under-represented class set of BDKS. Pure functions, no I/O. (HetBL aggregation is the
prefix-aware average of :mod:`sfl_core.aggregation`; the losses are in :mod:`sfl_core.losses`.)

Why these pieces: in SFL the round lasts as long as the slowest agent's transfer (paper
Eq. 2-3, ``comm_k = 2·|f^c(x)|·batch / r_k``). A bottleneck (BL) of ``p`` channels makes the
bytes per sample proportional to ``p``, so giving each link-rate group a width proportional
to its rate makes every group's transfer take about as long as the fastest group's at full
width. The narrow BL is the *prefix* (first ``p_N`` channels) of the wide one, which is what
lets them be averaged together (HetBL, Eq. 4-5).
"""

from __future__ import annotations

import bisect
import math
from typing import Mapping, Sequence


def _check_rate(name: str, r: float) -> None:
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r) or r <= 0:
        raise ValueError(f"{name}: link rate must be a finite positive number of bytes/s, got {r!r}")


def group_by_link_rate(rates: Mapping[str, float], *, groups: int = 2,
                       thresholds: Sequence[float] | None = None) -> list[list[str]]:
    """Split agents into link-rate groups, slowest group first.

    ``rates`` are measured uplink rates in bytes/s. Without ``thresholds`` the split is by
    quantiles: agents sorted by (rate, id) are cut into ``groups`` contiguous runs whose sizes
    differ by at most one (the slower groups get the extra agent). With ``thresholds``
    (strictly ascending, ``len == groups - 1``) an agent goes to the group whose interval holds
    its rate; a rate equal to a threshold belongs to the faster group. Empty groups are
    dropped, so fewer than ``groups`` lists can come back. Deterministic: ties are broken
    by agent id and members are listed in (rate, id) order.
    """
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"groups must be an integer >= 1, got {groups!r}")
    for a, r in rates.items():
        _check_rate(str(a), r)
    order = sorted(rates, key=lambda a: (rates[a], a))
    if thresholds is not None:
        ts = [float(t) for t in thresholds]
        if len(ts) != groups - 1:
            raise ValueError(f"thresholds: expected {groups - 1} values for {groups} groups, got {len(ts)}")
        if any(not math.isfinite(t) or t <= 0 for t in ts) or any(b <= a for a, b in zip(ts, ts[1:])):
            raise ValueError(f"thresholds must be finite, positive and strictly ascending, got {list(thresholds)}")
        out: list[list[str]] = [[] for _ in range(groups)]
        for a in order:
            out[bisect.bisect_right(ts, rates[a])].append(a)
    else:
        n = len(order)
        base, extra = divmod(n, groups)
        out, start = [], 0
        for g in range(groups):
            size = base + (1 if g < extra else 0)
            out.append(order[start:start + size])
            start += size
    return [g for g in out if g]


def widths_for_groups(group_rates: Sequence[float], full_width: int, *, min_width: int = 1,
                      fixed: Sequence[int] | None = None) -> list[int]:
    """One bottleneck width per group (same order as ``group_rates``, slowest first).

    Transfer time per step is ∝ ``width / rate`` (paper Eq. 3), so equal times need
    ``width_g ∝ rate_g``: ``width_g = floor(full_width · rate_g / max(rates))``, clipped to
    ``[min_width, full_width]``. The fastest group gets ``full_width``; widths never decrease
    with rate. Pass each group's *minimum* member rate: the round waits for the group's
    straggler, so that is the rate the width must fit (a median would leave the slowest
    members of each group late).

    ``fixed`` overrides the computation (configured widths): it must have one entry per
    group, each in ``[min_width, full_width]``, non-decreasing from the slowest group.
    """
    if not isinstance(full_width, int) or isinstance(full_width, bool) or full_width < 1:
        raise ValueError(f"full_width must be an integer >= 1, got {full_width!r}")
    if not isinstance(min_width, int) or isinstance(min_width, bool) or not 1 <= min_width <= full_width:
        raise ValueError(f"min_width must be an integer in [1, {full_width}], got {min_width!r}")
    if not group_rates:
        raise ValueError("need at least one group rate")
    for i, r in enumerate(group_rates):
        _check_rate(f"group {i}", r)
    if fixed is not None:
        ws = list(fixed)
        if len(ws) != len(group_rates):
            raise ValueError(f"fixed widths: expected {len(group_rates)} (one per group), got {len(ws)}")
        if any(not isinstance(w, int) or isinstance(w, bool) or not min_width <= w <= full_width for w in ws):
            raise ValueError(f"fixed widths must be integers in [{min_width}, {full_width}], got {ws}")
        if any(b < a for a, b in zip(ws, ws[1:])):
            raise ValueError(f"fixed widths must be non-decreasing from the slowest group, got {ws}")
        return ws
    fastest = max(group_rates)
    # the 1e-9 guard keeps exact ratios (rate = fastest/2 -> full/2) from flooring one below
    return [min(full_width, max(min_width, math.floor(full_width * r / fastest + 1e-9))) for r in group_rates]


