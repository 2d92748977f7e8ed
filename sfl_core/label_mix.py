"""Label mixes (MergeSFL, Liao et al., 2023, Eq. 11-12): how far a round's merged batch is from
an IID batch of the whole population.

``Phi_0`` (:func:`population_distribution`) is the population's label mix, ``Phi_h``
(:func:`mixed_distribution`) the merged batch's for a set of agents and their batch sizes, and
:func:`kl` the distance between them. Pure functions, no I/O, no torch: MergeSFL's worker
selection and the joint planner's label-mix selection both score candidates with them.
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

import numpy as np

from sfl_core.estimates import positive_int

KL_EPS = 1e-12
"""Floor for ``Phi_0`` entries inside :func:`kl`: a class the target lacks but the mix has
would make the KL infinite; with the floor it costs ``p_j * ln(p_j / 1e-12)`` (about
``27.6 * p_j`` nats), large enough that any mix covering the target's support wins."""


def batch_vector(ids: Sequence[str], batches: Mapping[str, int]) -> np.ndarray:
    missing = [a for a in ids if a not in batches]
    if missing:
        raise ValueError(f"no batch size for agents {missing[:5]}")
    return np.array([positive_int(f"batch of agent {a!r}", batches[a]) for a in ids], dtype=np.int64)


def selected_ids(selected: Collection[str]) -> list[str]:
    if isinstance(selected, str):
        raise ValueError("selected must be a collection of agent ids, not one string")
    ids = list(selected)
    if not ids:
        raise ValueError("selected is empty: a round needs at least one agent")
    if len(set(ids)) != len(ids):
        raise ValueError(f"selected lists an agent twice: {ids}")
    return sorted(ids)


def dist_matrix(ids: Sequence[str], label_dists: Mapping[str, Sequence[float]]) -> np.ndarray:
    """Rows ``V_i`` (normalised, so raw label counts work too) for ``ids``, validated."""
    missing = [a for a in ids if a not in label_dists]
    if missing:
        raise ValueError(f"no label distribution for agents {missing[:5]}")
    rows = []
    for a in ids:
        v = np.asarray(label_dists[a], dtype=np.float64)
        if v.ndim != 1 or v.size == 0:
            raise ValueError(f"agent {a!r}: label distribution must be a non-empty 1-D sequence, "
                             f"got {label_dists[a]!r}")
        if not np.all(np.isfinite(v)) or (v < 0).any() or v.sum() <= 0:
            raise ValueError(f"agent {a!r}: label distribution must be finite, non-negative and not all zero")
        rows.append(v)
    widths = {r.size for r in rows}
    if len(widths) > 1:
        raise ValueError(f"agents report different numbers of classes: {sorted(widths)}")
    m = np.vstack(rows)
    return m / m.sum(axis=1, keepdims=True)


def distribution(name: str, p: Sequence[float] | np.ndarray) -> np.ndarray:
    v = np.asarray(p, dtype=np.float64)
    if v.ndim != 1 or v.size == 0 or not np.all(np.isfinite(v)) or (v < 0).any() or v.sum() <= 0:
        raise ValueError(f"{name} must be a non-empty 1-D vector, finite, non-negative, not all zero")
    return v / v.sum()


def population_distribution(label_counts: Mapping[str, Sequence[float]], *, pooled: bool = True) -> np.ndarray:
    """``Phi_0``, the target label mix: what an IID batch from the whole population looks like.

    ``pooled=True`` (default) sums the agents' label counts and normalises — the true
    population distribution when the rows are counts. ``pooled=False`` is the paper's
    literal ``Phi_0 = 1/N sum_i V_i`` (each row normalised first), which equals the pooled
    one when every agent holds equally many samples. Rows that are already distributions
    give the paper's formula either way.
    """
    if not label_counts:
        raise ValueError("population_distribution needs at least one agent")
    ids = sorted(label_counts)
    if pooled:
        raw = dist_matrix(ids, label_counts)  # validates; rows normalised ...
        sizes = np.array([float(np.sum(np.asarray(label_counts[a], dtype=np.float64))) for a in ids])
        total = (raw * sizes[:, None]).sum(axis=0)  # ... so undo it to pool the counts
    else:
        total = dist_matrix(ids, label_counts).mean(axis=0)
    return total / total.sum()


def mixed_distribution(selected: Collection[str], batches: Mapping[str, int],
                       label_dists: Mapping[str, Sequence[float]]) -> np.ndarray:
    """Eq. 11: ``Phi_h = sum_{i in S} d_i V_i / sum_{i in S} d_i``.

    The expected label mix of one merged server batch: agent ``i`` contributes ``d_i``
    samples drawn from its label distribution ``V_i`` (rows are normalised, so label counts
    work as well). Raises ``ValueError`` for an empty selection or a missing agent.
    """
    ids = selected_ids(selected)
    d = batch_vector(ids, batches).astype(np.float64)
    return d @ dist_matrix(ids, label_dists) / d.sum()


def kl(p: Sequence[float] | np.ndarray, q: Sequence[float] | np.ndarray, eps: float = KL_EPS) -> float:
    """Eq. 12: ``KL(p || q) = sum_j p_j ln(p_j / q_j)`` in nats.

    Both vectors are normalised first. Terms with ``p_j = 0`` are 0 (the limit of
    ``x ln x``); ``q_j`` is floored at ``eps`` (:data:`KL_EPS`) so a class the target lacks
    costs a large finite amount instead of infinity, keeping GA fitnesses comparable.
    """
    pp = distribution("p", p)
    qq = distribution("q", q)
    if pp.shape != qq.shape:
        raise ValueError(f"p and q must have the same length, got {pp.size} and {qq.size}")
    return float(kl_rows(pp[None, :], qq, eps)[0])


def kl_rows(P: np.ndarray, q: np.ndarray, eps: float = KL_EPS) -> np.ndarray:
    """KL of each row of ``P`` (rows are distributions) against ``q``; vectorised Eq. 12."""
    logq = np.log(np.maximum(q, eps))
    safe = np.where(P > 0, P, 1.0)
    return np.sum(np.where(P > 0, P * (np.log(safe) - logq), 0.0), axis=-1)


def priorities(participation: Mapping[str, int], agents: Sequence[str]) -> np.ndarray:
    """Eq. 13: ``p_i = sum_j (K_j + 1) / (K_i + 1)`` for ``agents``, in their order.

    ``K_i`` counts the rounds agent ``i`` took part in; agents missing from
    ``participation`` have never taken part (``K_i = 0``). Rarely chosen agents get a
    large priority, so every agent's data is seen over time. (The numerator is common to
    all agents; only the ratio ``1 / (K_i + 1)`` matters for sampling.)
    """
    counts = [participation.get(a, 0) for a in agents]
    for a, x in zip(agents, counts):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
            raise ValueError(f"participation of agent {a!r} must be an integer >= 0, got {x!r}")
    k1 = np.array(counts, dtype=np.float64) + 1.0
    return k1.sum() / k1
