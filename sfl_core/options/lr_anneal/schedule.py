"""The annealed learning rate's factor for a round: a pure function of the round and the horizon."""

from __future__ import annotations

__all__ = ["anneal_factor"]


def anneal_factor(r: int, rounds: int, share: float, floor: float = 0.1) -> float:
    """What round ``r`` (from 1) of ``rounds`` multiplies the learning rate by.

    .. math::
        f(r) = 1 \\quad (r \\le s_0), \\qquad
        f(r) = 1 - (1 - \\text{floor}) \\, \\frac{r - s_0}{R - s_0} \\quad (r > s_0),
        \\qquad s_0 = (1 - \\text{share}) R

    so the rate holds until the last ``share`` of the run and falls linearly to ``floor`` at the
    last round (a round past the horizon keeps the floor). Linear rather than stepped: a step
    moves every device's rate at once, where the last rounds' swings come from; the tail-only
    decay keeps the whole rate for the climb, which a decay from round 1 slowed at the hard end.

    Args:
        r: the round, from 1.
        rounds: the run's horizon ``R``.
        share: the share of ``R`` the rate falls over, in [0, 1); 0 gives 1 everywhere.
        floor: the factor at the last round.
    """
    start = (1.0 - share) * rounds
    if share <= 0 or r <= start:
        return 1.0
    return 1.0 - (1.0 - floor) * min(1.0, (r - start) / (rounds - start))
