"""Reference formulas of MergeSFL (Eq. 7-8, 10, 14) that the tests check the product's algorithms
against. They are written out here, apart from ``sfl_core.methods.mergesfl.control``, because the product never
needs them in this form: its algorithms fold them into their own loops. A plain module (not a
test module), so test modules import it instead of importing each other."""

from __future__ import annotations

from typing import Collection, Mapping

from sfl_core import timing
from sfl_core.estimates import AgentState


def _batches(ids: list[str], batches: Mapping[str, int]) -> list[int]:
    missing = [a for a in ids if a not in batches]
    if missing:
        raise ValueError(f"no batch size for agents {missing[:5]}")
    return [int(batches[a]) for a in ids]


def waiting_time(states: Mapping[str, AgentState], batches: Mapping[str, int], tau: int = 1) -> float:
    """Eq. 7-8: mean over the agents of ``max_j t_j - t_i``, ``t_i = tau * d_i * (mu_i + beta_i) + fixed_i``."""
    ids = sorted(batches)
    return timing.waiting_time(states[a].round_time(d, tau) for a, d in zip(ids, _batches(ids, batches)))


def added_wait(states: Mapping[str, AgentState], before: Mapping[str, int], after: Mapping[str, int]) -> float:
    """Eq. 14: ``1/R * sum_i |Delta d_i| * (mu_i + beta_i)`` over the agents of ``after``."""
    ids = sorted(after)
    deltas = [abs(x - y) for x, y in zip(_batches(ids, after), _batches(ids, before))]
    return sum(d * states[a].per_sample for a, d in zip(ids, deltas)) / len(ids)


def within_budget(selected: Collection[str], batches: Mapping[str, int], bytes_per_sample: float,
                  budget: float) -> bool:
    """Eq. 10: ``sum_{i in S} d_i * c <= B`` (the sum in integers, then one multiplication)."""
    return sum(_batches(list(selected), batches)) * bytes_per_sample <= budget
