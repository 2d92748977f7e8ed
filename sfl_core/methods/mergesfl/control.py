"""MergeSFL control module (MergeSFL paper, Liao et al. 2023, §IV-A, Alg. 1; docs/methods/mergesfl.md):
pure functions, no I/O, no torch.

Why: MergeSFL merges the features of several agents into one server batch per step. Two
things decide how good a round is: *how long* it takes (the slowest agent sets the pace)
and *how IID* the merged batch is (its label mix versus the population's). The control
module trades the two off before each round:

1. **State estimation** (Eq. 5-6): smooth each agent's per-sample compute time ``mu`` and
   transfer time ``beta`` with an exponential moving average, :func:`smooth`, :class:`AgentState`.
   The per-round cost that does not grow with the batch (the client portion's weights down
   and up, message latencies) is smoothed alongside as ``fixed``, :func:`split_transfer`.
2. **Batch regulation** (Eq. 7-9): give the fastest agent the maximum batch ``D`` and
   everyone else a batch that takes equally long, :func:`regulate_batches`; learning rates
   scale linearly with batch (Eq. 15, :func:`scale_lr`), aggregation weights are ``d_i / sum d``
   (Eq. 17: the method's ``aggregation_weight`` is the batch, and the average normalises).
3. **Bandwidth budget** (Eq. 10): ``sum_{i in S} d_i * c <= B``, kept by every selection and
   fill below (:func:`_sample_capacity`); ``B`` estimated from past rounds, :func:`observed_ingress`, :func:`estimate_budget`.
4. **Worker selection** (Eq. 11-13): choose the set ``S`` whose merged label mix
   ``Phi_h`` (Eq. 11) is closest in KL (Eq. 12) to the population's ``Phi_0`` under the
   budget, with a genetic algorithm seeded by participation priority, :func:`select_workers`.
5. **Fine-tuning** (Eq. 14): nudge the selected agents' batches until ``KL <= epsilon``
   while adding the least waiting time, :func:`tune_batches`; then scale all batches
   proportionally to use the budget, :func:`fill_budget`.

:func:`plan_merge_round` chains 2-5 (Alg. 1 lines 1-7).

Where the paper is ambiguous (each is repeated where it matters):

* Eq. 9 prints ``d_i = d_l * floor((mu_l+beta_l)/(mu_i+beta_i))``; with ``l`` the fastest
  agent the ratio is <= 1, so that floor is 0 for everyone slower — a typesetting slip.
  We floor the product (docs/methods/mergesfl.md) and keep every batch >= 1.
* Eq. 7 ``t_i = tau * d_i * (mu_i + beta_i)`` has no term for what a round costs whatever
  the batch (the client portion's weights travel down and up once per round). Folding that
  into ``beta`` makes a small batch look slow per sample, which shrinks its batch further:
  a feedback loop. We keep it apart as ``fixed_i`` and equalise
  ``tau * d_i * (mu_i + beta_i) + fixed_i`` (:func:`regulate_batches`); with ``fixed = 0``
  this is the paper's Eq. 9.
* ``B^h`` is "estimated from the statistical distribution of the ingress bandwidth in the
  previous rounds" without a formula; see :func:`observed_ingress` and :func:`estimate_budget`.
* ``Phi_0`` is printed as ``1/N sum_i V_i`` "if the data of all workers follows IID"; we
  pool label *counts* by default (the true population mix; equal to the paper's formula
  when agents hold equally many samples), ``pooled=False`` gives the literal formula.
* Eq. 14 "is solved as a Lagrange dual problem" without details; we implement a greedy
  Lagrangian descent (see :func:`tune_batches`) and charge ``|Delta d_i|`` (a smaller batch
  makes that agent wait, a larger one makes the others wait).
* The GA's operators, sizes and stopping rule are not given; see :func:`select_workers`.
  Up to 12 candidates we enumerate every subset instead (exact, and cheaper).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

import numpy as np

from sfl_core.estimates import AgentState, nonneg_float, positive_int, probability, scale_lr, smooth
from sfl_core.label_mix import (
    KL_EPS,
    batch_vector,
    dist_matrix,
    distribution,
    kl,
    kl_rows,
    mixed_distribution,
    population_distribution,
    priorities,
    selected_ids,
)
from sfl_core.timing import transfer_time

_TINY = 1e-15      # KL or score differences below this are float noise, not progress

__all__ = [
    "AgentState", "KL_EPS", "MergePlan", "Selection", "Tuning",
    "estimate_budget", "fill_budget", "fixed_transfer_time", "kl",
    "mixed_distribution", "observed_ingress", "plan_merge_round", "population_distribution", "priorities",
    "regulate_batches", "scale_lr", "select_workers", "smooth", "split_transfer", "tune_batches",
]


_FLOOR_SLACK = 1e-9  # d_l * ratio may land a hair under an integer it equals exactly


def _sample_capacity(bytes_per_sample: float, budget: float) -> int:
    """The largest integer ``n`` with ``n * c <= B``: Eq. 10's test, the sum taken in integers
    before the one multiplication, so every function here applies exactly the same test."""
    n = math.floor(budget / bytes_per_sample)
    while n > 0 and n * bytes_per_sample > budget:
        n -= 1
    while (n + 1) * bytes_per_sample <= budget:
        n += 1
    return n


# ====================================================================== 1. state estimation (Eq. 5-6)


def split_transfer(transfer_s: float, fixed_s: float, samples: int) -> tuple[float, float]:
    """One round's measured transfer seconds as ``(beta_hat, fixed_hat)``: per-sample and per-round.

    ``transfer_s`` is everything the agent spent on the link in the round; ``fixed_s`` the
    part that does not scale with the batch (weights down and up, latencies), as estimated
    by the caller; ``samples = tau * d``. Why: Eq. 7 charges transfer per sample, so a fixed
    cost divided by ``tau * d`` would make a small batch look slow per sample and shrink it
    further (Eq. 9) — a feedback loop. ``fixed_s`` is capped at ``transfer_s`` (a rate
    estimate can overshoot the measurement), so both parts stay >= 0.
    """
    t = nonneg_float("transfer_s", transfer_s)
    f = min(nonneg_float("fixed_s", fixed_s), t)
    n = positive_int("samples", samples)
    return (t - f) / n, f


def fixed_transfer_time(weights_bytes: float, uplink_bytes_per_s: float, downlink_bytes_per_s: float, *,
                        messages: int = 0, latency_s: float = 0.0) -> float:
    """Seconds a round spends on the link whatever the batch: the client portion's weights
    down (assignment) and up (upload), plus ``messages`` one-way latencies (the number of
    messages is fixed by ``tau``, not by the batch). Same time model as the virtual clock."""
    w = nonneg_float("weights_bytes", weights_bytes)
    up = nonneg_float("uplink_bytes_per_s", uplink_bytes_per_s, positive=True)
    down = nonneg_float("downlink_bytes_per_s", downlink_bytes_per_s, positive=True)
    if isinstance(messages, bool) or not isinstance(messages, (int, np.integer)) or messages < 0:
        raise ValueError(f"messages must be an integer >= 0, got {messages!r}")
    return transfer_time(w, w, up, down, messages=int(messages), latency_s=nonneg_float("latency_s", latency_s))


# ====================================================================== 2. batch regulation (Eq. 7-9, 15, 17)


def regulate_batches(states: Mapping[str, AgentState], max_batch: int, *, min_batch: int = 1,
                     tau: int = 1) -> dict[str, int]:
    """Eq. 9: equal round duration for everyone, the fastest agent at the maximum batch.

    Agent ``i``'s round takes ``t_i = tau * d_i * (mu_i+beta_i) + fixed_i`` (Eq. 7 plus the
    per-round fixed transfer, :class:`AgentState`). The fastest agent ``l`` (smallest ``t`` at
    ``d = max_batch``; ties to the smallest id) gets ``d_l = max_batch``, so
    ``T_l = tau * max_batch * (mu_l+beta_l) + fixed_l``; agent ``i`` gets
    ``floor((T_l - fixed_i) / (tau * (mu_i+beta_i)))``, clipped to ``[min_batch, max_batch]``.
    The floor keeps every agent at or under ``T_l``, within one sample's ``tau * (mu_i+beta_i)``,
    unless the ``min_batch`` floor applies (then the agent is the straggler; selection may
    leave it out). With every ``fixed = 0`` this is the paper's
    ``d_i = floor(d_l * (mu_l+beta_l) / (mu_i+beta_i))`` whatever ``tau``.

    The paper prints the floor around the ratio alone, which is 0 for every slower agent;
    we floor the product (docs/methods/mergesfl.md). Raises ``ValueError`` for no agents, a non-positive
    ``mu + beta`` (a free agent would get an infinite batch) or bad batch bounds.
    """
    d_max = positive_int("max_batch", max_batch)
    d_min = positive_int("min_batch", min_batch)
    n_iter = positive_int("tau", tau)
    if d_min > d_max:
        raise ValueError(f"min_batch ({d_min}) exceeds max_batch ({d_max})")
    if not states:
        raise ValueError("regulate_batches needs at least one agent state")
    for a, s in states.items():
        if not isinstance(s, AgentState):
            raise ValueError(f"agent {a!r}: expected an AgentState, got {type(s).__name__}")
        if s.per_sample <= 0:
            raise ValueError(f"agent {a!r}: mu + beta must be > 0 to regulate its batch, got {s.per_sample!r}")
    # per local iteration: d * (mu + beta) + fixed / tau (with fixed = 0, exactly the paper's terms)
    step = {a: d_max * s.per_sample + s.fixed / n_iter for a, s in states.items()}
    fastest = min(sorted(states), key=lambda a: step[a])
    t_l = step[fastest]
    out = {}
    for a in sorted(states):
        s = states[a]
        d = d_max if a == fastest else math.floor((t_l - s.fixed / n_iter) / s.per_sample + _FLOOR_SLACK)
        out[a] = int(min(d_max, max(d_min, d)))
    return out


# ====================================================================== 3. bandwidth budget (Eq. 10)


def observed_ingress(nominal: float, planned: float, received: float) -> float:
    """What one past round shows of the coordinator's ingress per local iteration, in Eq. 10's
    unit (activation bytes per step): ``nominal * min(received, planned) / planned``.

    ``planned`` is the round's planned load ``sum_{i in S} d_i * c``; ``received`` the part of
    it that arrived (the agents that finished the round, ``d_i * c`` each); ``nominal`` the
    budget assumed without measurements (configured capacity or its default).

    Why not the received bytes themselves: a round's load is capped by its budget, and often
    by demand too (the selection is chosen for its label mix, batches stop at ``D``), so
    feeding the load back could only lower the budget, round after round, for reasons that
    have nothing to do with bandwidth. What a round does tell about the ingress is whether
    the features planned for it arrived: ingress that cannot carry the plan shows up as
    agents whose activations miss the step timeout. A round where everything arrived
    confirms the nominal budget; one where a third did not arrive observes two thirds of it,
    so the budget recovers once rounds complete again. Raises ``ValueError`` for
    ``planned <= 0`` (such a round observes nothing) or negative inputs.
    """
    b = nonneg_float("nominal", nominal)
    p = nonneg_float("planned", planned, positive=True)
    r = nonneg_float("received", received)
    return b * (min(r, p) / p)


def estimate_budget(past_ingress_bytes: Sequence[float], *, window: int = 10, quantile: float = 0.5) -> float:
    """The ingress budget ``B^h`` from the last ``window`` rounds' measurements (paper §IV-A).

    The paper only says it "analyzes the statistical distribution of the ingress
    bandwidth ... in the previous rounds". We take the ``quantile`` (default: the median)
    of the last ``window`` (default 10) values: the median ignores a single congested or
    idle round, and 10 rounds track the MergeSFL testbed's mode changes every 20 rounds.
    Pass a lower ``quantile`` (e.g. 0.2) for a more conservative budget.

    The inputs must measure *available* ingress per step (:func:`observed_ingress`), not
    the bytes the previous budget allowed: usage is capped by the budget, so feeding usage
    back can only ratchet the budget down.
    Raises ``ValueError`` for no measurements (the caller must seed the first round).
    """
    w = positive_int("window", window)
    q = probability("quantile", quantile)
    xs = [nonneg_float("past ingress", x) for x in past_ingress_bytes]
    if not xs:
        raise ValueError("estimate_budget needs at least one past measurement; seed the first round's budget")
    return float(np.quantile(np.array(xs[-w:]), q))


# ====================================================================== 4. label mixing and KL (Eq. 11-12)


# ====================================================================== 5. worker selection: GA (Eq. 10-13)


@dataclass(frozen=True)
class Selection:
    """The GA's answer: ``agents`` (sorted ids), their ``kl`` = KL(Phi_h || Phi_0), the
    ingress ``load_bytes`` = ``sum d_i * c`` (always <= the budget) and the number of
    ``generations`` actually run (early stop included)."""

    agents: tuple[str, ...]
    kl: float
    load_bytes: float
    generations: int


def select_workers(label_dists: Mapping[str, Sequence[float]], batches: Mapping[str, int], bytes_per_sample: float,
                   budget: float, participation: Mapping[str, int], *, target: Sequence[float] | None = None,
                   population: int = 60, generations: int = 100, crossover: float = 0.9,
                   mutation: float | None = None, elite: int = 2, tournament: int = 3, patience: int = 30,
                   exact_max_agents: int = 12, min_agents: int = 1, max_agents: int | None = None,
                   seed: int = 0) -> Selection:
    """Alg. 1 lines 3-5: the agent set minimising ``KL(Phi_h || Phi_0)`` (Eq. 11-12) under Eq. 10.

    Candidates are the agents of ``batches`` (their regulated Eq. 9 sizes); ``label_dists``
    must cover them, and by default ``Phi_0`` is :func:`population_distribution` over all
    of ``label_dists`` (pass ``target`` to override). Agents whose batch alone exceeds the
    budget are never selected.

    With at most ``exact_max_agents`` (default 12) candidates that fit, all ``2^N - 1``
    subsets are scored in one vectorised pass (4,095 for 12; a few ms) and the optimum is
    returned with ``generations=0``: the GA is for fleets where enumeration is impossible.
    Pass ``exact_max_agents=0`` to force the GA.

    Genetic algorithm (the paper names it but gives no operators; ours are textbook):

    * **Genes**: one in/out bit per candidate (sorted ids); an individual is a row of a
      ``population x N`` boolean matrix and the whole population is evaluated at once
      (one product for ``Phi_h``, Eq. 11, then Eq. 12 row-wise).
    * **Initial population** (Eq. 13, "select m workers based on their priority, e.g.
      m = N/2"): each individual draws ``m = max(1, N // 2)`` agents without replacement
      with probability proportional to ``p_i`` (Efraimidis-Spirakis keys ``u^(1/p_i)``) and
      keeps the longest prefix of that draw order that fits the budget. Priority acts only
      here, as in the paper; the search itself minimises the KL alone.
    * **Selection**: tournaments of ``tournament`` (default 3); **crossover**: uniform,
      applied to a parent pair with probability ``crossover`` (default 0.9; gene order is
      arbitrary, so one-point crossover would be biased); **mutation**: each bit flips with
      probability ``mutation`` (default ``1/N``: one flip per child on average).
    * **Feasibility**: an over-budget child is *repaired* — its agents, in a random order,
      are kept while they fit — so every individual, hence the answer, meets Eq. 10. A
      child with no agent gets infinite fitness.
    * **Elitism**: the best ``elite`` (default 2) individuals survive unchanged, so the
      best KL never gets worse.
    * **Stop** after ``generations`` (default 100), after ``patience`` (default 30)
      generations without improvement, or at KL = 0.

    * **Size bounds** (not in the paper, which bounds only the bytes): at most
      ``max_agents`` agents (repair drops the surplus like an over-budget agent) and at
      least ``min_agents`` where the budget lets that many fit (smaller sets rank below
      every set that meets the bound, the closest to it first).

    Population 60 x 100 generations is at most 6,000 evaluations, each O(N * classes)
    (``tests/test_mergesfl.py`` compares the GA alone, ``exact_max_agents=0``, with the exact
    optimum on small instances).
    Deterministic for a given input and ``seed``. Raises ``ValueError`` when no candidate
    fits the budget on its own, or for bad parameters.
    """
    c = nonneg_float("bytes_per_sample", bytes_per_sample, positive=True)
    b = nonneg_float("budget", budget)
    pop = positive_int("population", population)
    gens = positive_int("generations", generations)
    if isinstance(exact_max_agents, bool) or not isinstance(exact_max_agents, (int, np.integer)) \
            or not 0 <= exact_max_agents <= 16:
        raise ValueError(f"exact_max_agents must be an integer in [0, 16], got {exact_max_agents!r}")
    if isinstance(elite, bool) or not isinstance(elite, (int, np.integer)) or not 0 <= elite < pop:
        raise ValueError(f"elite must be an integer in [0, population), got {elite!r}")
    n_elite = int(elite)
    k_tour = positive_int("tournament", tournament)
    wait = positive_int("patience", patience)
    p_cross = probability("crossover", crossover)
    if not batches:
        raise ValueError("select_workers needs at least one candidate agent")
    ids = sorted(batches)
    d_all = batch_vector(ids, batches)
    V_all = dist_matrix(ids, label_dists)
    q = population_distribution(label_dists) if target is None else distribution("target", target)
    if q.size != V_all.shape[1]:
        raise ValueError(f"target has {q.size} classes, label distributions have {V_all.shape[1]}")
    prio_all = priorities(participation, ids)

    cap = _sample_capacity(c, b)
    fits = d_all <= cap
    if not fits.any():
        raise ValueError(f"budget {b!r} B fits no agent: the smallest batch needs {int(d_all.min()) * c!r} B")
    cand = [a for a, f in zip(ids, fits) if f]
    d, V, prio = d_all[fits], V_all[fits], prio_all[fits]
    n = len(cand)
    lo = positive_int("min_agents", min_agents)
    hi = n if max_agents is None else positive_int("max_agents", max_agents)
    if hi < lo:
        raise ValueError(f"max_agents ({max_agents}) must be >= min_agents ({min_agents})")
    hi = min(hi, n)
    p_mut = 1.0 / n if mutation is None else probability("mutation", mutation)
    rng = np.random.default_rng(seed)

    def repair(X: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Keep, per row, the agents whose cumulative load in ``keys`` order fits ``cap``, and
        at most ``hi`` of them."""
        over = ((X.astype(np.int64) @ d) > cap) | (X.sum(axis=1) > hi)
        if not over.any():
            return X
        Xo = X[over]
        order = np.argsort(np.where(Xo, keys[over], np.inf), axis=1, kind="stable")
        load = np.cumsum(np.take_along_axis(Xo * d, order, axis=1), axis=1)
        count = np.cumsum(np.take_along_axis(Xo, order, axis=1), axis=1)
        keep = np.zeros_like(Xo)
        np.put_along_axis(keep, order, (load <= cap) & (count <= hi), axis=1)
        X = X.copy()
        X[over] = Xo & keep
        return X

    U = d[:, None] * V  # d_i * V_i: numerator rows of Eq. 11

    def fitness(X: np.ndarray) -> np.ndarray:
        f = _mix_kl(X, d, U, q)
        short = lo - X.sum(axis=1)
        return np.where((short > 0) & np.isfinite(f), _SHORT + short, f)   # below min_agents: ranked by how far

    if n <= exact_max_agents:  # every non-empty subset at once: exact, and cheaper than the GA
        masks = ((np.arange(1, 2 ** n)[:, None] >> np.arange(n)) & 1) == 1
        masks = masks[(masks.astype(np.int64) @ d <= cap) & (masks.sum(axis=1) <= hi)]
        return _selection(cand, masks[int(np.argmin(fitness(masks)))], d, c, batches, label_dists, q, 0)

    # initial population: m agents per individual drawn by priority, budget-fitting prefix kept
    m = min(max(1, n // 2, lo), hi)
    keys = np.log(rng.random((pop, n))) / prio  # log(u^(1/p)): larger key drawn earlier
    order = np.argsort(-keys, axis=1, kind="stable")[:, :m]
    X = np.zeros((pop, n), dtype=bool)
    np.put_along_axis(X, order, True, axis=1)
    X = repair(X, -keys)
    fit = fitness(X)

    best_x, best = X[int(np.argmin(fit))], float(fit.min())
    stale = 0
    ran = 0
    n_child = pop - n_elite
    for _ in range(gens):
        if best <= _TINY or stale >= wait:
            break
        ran += 1
        # tournament selection: two parents per child
        contenders = rng.integers(pop, size=(2, n_child, k_tour))
        parents = np.take_along_axis(contenders, np.argmin(fit[contenders], axis=2)[..., None], axis=2)[..., 0]
        pa, pb = X[parents[0]], X[parents[1]]
        # uniform crossover with probability p_cross per pair, then bit-flip mutation
        cross = (rng.random((n_child, 1)) < p_cross) & (rng.random((n_child, n)) < 0.5)
        children = np.where(cross, pb, pa) ^ (rng.random((n_child, n)) < p_mut)
        children = repair(children, rng.random((n_child, n)))
        child_fit = fitness(children)
        elite_idx = np.argsort(fit, kind="stable")[:n_elite]
        X = np.vstack([X[elite_idx], children])
        fit = np.concatenate([fit[elite_idx], child_fit])
        i = int(np.argmin(fit))
        if fit[i] < best - _TINY:
            best_x, best, stale = X[i], float(fit[i]), 0
        else:
            stale += 1

    return _selection(cand, best_x, d, c, batches, label_dists, q, ran)


_SHORT = 1e6
"""Fitness of a selection with fewer than ``min_agents`` agents (plus the shortfall): above any KL."""


def _mix_kl(X: np.ndarray, d: np.ndarray, U: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(Phi_h || q) (Eq. 11-12) for every row of the boolean selection matrix ``X``; inf for empty rows.

    ``einsum`` rather than ``@``: for these small products a multi-threaded BLAS spends
    more time waking its threads than multiplying (15 ms instead of 0.5 ms per generation
    measured on a busy 2-core host); einsum's single-threaded loop has no such cliff.
    """
    tot = X.astype(np.int64) @ d
    f = np.full(X.shape[0], np.inf)
    ok = tot > 0
    if ok.any():
        num = np.einsum("pn,nm->pm", X[ok].astype(np.float64), U)
        f[ok] = kl_rows(num / tot[ok, None], q)
    return f


def _selection(cand: Sequence[str], genes: np.ndarray, d: np.ndarray, c: float, batches: Mapping[str, int],
               label_dists: Mapping[str, Sequence[float]], q: np.ndarray, generations: int) -> Selection:
    chosen = tuple(a for a, g in zip(cand, genes) if g)
    return Selection(agents=chosen, kl=kl(mixed_distribution(chosen, batches, label_dists), q),
                     load_bytes=int(d[genes].sum()) * c, generations=generations)


# ====================================================================== 6. fine-tuning (Eq. 14), filling (Alg. 1 l. 7)


@dataclass(frozen=True)
class Tuning:
    """:func:`tune_batches`' answer: the new ``batches`` of the selected agents, their
    ``kl``, whether ``kl <= epsilon`` was ``reached``, the Eq. 14 ``added_wait`` (seconds
    per iteration, vs the input batches) and the number of unit ``steps`` taken."""

    batches: dict[str, int] = field(hash=False)
    kl: float
    reached: bool
    added_wait: float
    steps: int


def tune_batches(selected: Collection[str], batches: Mapping[str, int], label_dists: Mapping[str, Sequence[float]],
                 epsilon: float, states: Mapping[str, AgentState], *, target: Sequence[float] | None = None,
                 min_batch: int = 1, max_batch: int | None = None, max_steps: int = 10_000) -> Tuning:
    """Alg. 1 line 6: change the selected agents' batches until ``KL(Phi_h || Phi_0) <= epsilon``
    while adding the least waiting time ``Delta(S)`` (Eq. 14).

    The paper only says the problem "is formulated as a Lagrange dual problem" [56, 57].
    We approximate the path of its Lagrangian ``Delta(S) + lambda * (KL - epsilon)`` as
    ``lambda`` grows by greedy unit steps: every ``+1`` / ``-1`` change of one agent's
    batch is evaluated exactly (vectorised), and the one with the largest KL decrease per
    second of added waiting, ``dKL / ((mu_i+beta_i) * d|Delta d_i|)``, is taken (a step
    back toward an agent's starting batch costs nothing and goes first). It stops as soon
    as ``KL <= epsilon``, when no single step lowers the KL (``reached`` is then False and
    the batches are the closest found), or after ``max_steps``.

    Quality, against brute force over the batch grid: optimal on two-agent cases; on
    random three-agent cases optimal 3 times in 4, +2.4 % added waiting on average, +22 %
    at worst. Unit steps cannot resolve a mix finer than the batch lattice: an
    ``epsilon`` below what a single ``+-1`` change reaches may stop short (``reached``
    False) even where a joint change of several batches would get there.

    Batches stay within ``[min_batch, max_batch]`` (``max_batch=None``: no upper bound).
    The result ignores the budget; :func:`fill_budget` rescales proportionally afterwards,
    which keeps ``Phi_h`` up to rounding. ``Phi_0`` defaults to
    :func:`population_distribution` over ``label_dists``.
    """
    ids = selected_ids(selected)
    eps = nonneg_float("epsilon", epsilon)
    lo = positive_int("min_batch", min_batch)
    hi = math.inf if max_batch is None else positive_int("max_batch", max_batch)
    if lo > hi:
        raise ValueError(f"min_batch ({lo}) exceeds max_batch ({max_batch})")
    if isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)) or max_steps < 0:
        raise ValueError(f"max_steps must be an integer >= 0, got {max_steps!r}")
    limit = int(max_steps)
    missing = [a for a in ids if a not in states]
    if missing:
        raise ValueError(f"no state for agents {missing[:5]}")
    d0 = batch_vector(ids, batches)
    if (d0 < lo).any() or (d0 > hi).any():
        raise ValueError(f"input batches must lie in [{lo}, {max_batch}], got {dict(zip(ids, d0.tolist()))}")
    V = dist_matrix(ids, label_dists)
    q = population_distribution(label_dists) if target is None else distribution("target", target)
    if q.size != V.shape[1]:
        raise ValueError(f"target has {q.size} classes, label distributions have {V.shape[1]}")
    s = np.array([states[a].per_sample for a in ids])

    d = d0.copy()
    num = d.astype(np.float64) @ V
    cur = float(kl_rows((num / d.sum())[None, :], q)[0])
    steps = 0
    step = np.concatenate([np.ones(len(ids), dtype=np.int64), -np.ones(len(ids), dtype=np.int64)])
    who = np.concatenate([np.arange(len(ids)), np.arange(len(ids))])
    while cur > eps and steps < limit:
        new_d = d[who] + step
        valid = (new_d >= lo) & (new_d <= hi)
        P = (num[None, :] + step[:, None] * V[who]) / np.maximum(d.sum() + step, 1)[:, None]
        gain = cur - kl_rows(np.where(valid[:, None], P, 1.0 / q.size), q)
        cost = s[who] * (np.abs(new_d - d0[who]) - np.abs(d[who] - d0[who]))
        useful = valid & (gain > _TINY)
        if not useful.any():
            break
        # free steps (back toward the start) first, by gain; then gain per second of waiting
        score = np.where(cost <= 0, np.inf, gain / np.where(cost > 0, cost, 1.0))
        key = np.where(useful, score, -np.inf)
        top = np.flatnonzero(key == key.max())
        pick = int(top[np.argmax(gain[top])])
        d[who[pick]] += step[pick]
        num += step[pick] * V[who[pick]]
        cur = float(kl_rows((num / d.sum())[None, :], q)[0])  # recomputed, so no drift
        steps += 1
    out = {a: int(x) for a, x in zip(ids, d)}
    return Tuning(batches=out, kl=cur, reached=cur <= eps, added_wait=float(np.mean(np.abs(d - d0) * s)), steps=steps)


def fill_budget(batches: Mapping[str, int], bytes_per_sample: float, budget: float, *,
                min_batch: int = 1, max_batch: int | None = None) -> dict[str, int]:
    """Alg. 1 line 7: scale all batches by one factor to use the budget (Eq. 10) without exceeding it.

    Proportional scaling keeps both the label mix ``Phi_h`` and the aligned durations
    (up to rounding). The factor ``f`` is the largest for which
    ``clip(floor(f * d_i), min_batch, max_batch)`` fits (found by bisection; scales down
    too when the batches are over budget); the samples left over then go, one each, to the
    agents with the largest fractional parts ``f * d_i - floor(f * d_i)`` (largest-remainder
    rounding), so the total is the budget's sample capacity unless ``max_batch`` binds.
    ``max_batch=None`` lets batches grow past the Eq. 9 maximum; pass ``D`` to keep
    memory bounded. Raises ``ValueError`` when even ``min_batch`` per agent is over budget.
    """
    if not batches:
        raise ValueError("fill_budget needs at least one agent")
    c = nonneg_float("bytes_per_sample", bytes_per_sample, positive=True)
    b = nonneg_float("budget", budget)
    lo = positive_int("min_batch", min_batch)
    hi = math.inf if max_batch is None else positive_int("max_batch", max_batch)
    if lo > hi:
        raise ValueError(f"min_batch ({lo}) exceeds max_batch ({max_batch})")
    ids = sorted(batches)
    d = batch_vector(ids, batches).astype(np.float64)
    cap = _sample_capacity(c, b)
    if len(ids) * lo > cap:
        raise ValueError(f"budget {b!r} B cannot carry {len(ids)} agents at batch {lo} ({len(ids) * lo * c!r} B)")

    def alloc(f: float) -> np.ndarray:
        return np.clip(np.floor(f * d + _FLOOR_SLACK), lo, hi)

    if alloc(cap / d.min() + 1.0).sum() <= cap:  # max_batch binds everyone: take it all
        return {a: int(x) for a, x in zip(ids, alloc(cap / d.min() + 1.0))}
    f_lo, f_hi = 0.0, cap / d.min() + 1.0
    for _ in range(100):
        mid = 0.5 * (f_lo + f_hi)
        if alloc(mid).sum() <= cap:
            f_lo = mid
        else:
            f_hi = mid
    out = alloc(f_lo)
    room = cap - int(out.sum())
    floors = np.floor(f_lo * d + _FLOOR_SLACK)
    frac = f_lo * d - floors
    # agents held up at min_batch are already above their share: they come last
    for i in sorted(range(len(ids)), key=lambda i: (bool(floors[i] < lo), -frac[i], ids[i])):
        if room <= 0:
            break
        if out[i] + 1 <= hi:
            out[i] += 1
            room -= 1
    return {a: int(x) for a, x in zip(ids, out)}


# ====================================================================== Alg. 1 in one call


@dataclass(frozen=True)
class MergePlan:
    """One round's decision (Alg. 1 output): the selected ``agents``, their final
    ``batches``, the final ``kl``, whether ``epsilon`` was ``reached`` by fine-tuning, the
    ingress ``load_bytes`` (<= budget) and the GA's ``selection`` for logging."""

    agents: tuple[str, ...]
    batches: dict[str, int] = field(hash=False)
    kl: float
    reached: bool
    load_bytes: float
    selection: Selection


def plan_merge_round(states: Mapping[str, AgentState], label_dists: Mapping[str, Sequence[float]],
               participation: Mapping[str, int], *, max_batch: int, bytes_per_sample: float, budget: float,
               epsilon: float = 0.01, batch_cap: int | None = None, target: Sequence[float] | None = None,
               seed: int = 0, tau: int = 1, min_batch: int = 1, **ga: object) -> MergePlan:
    """Alg. 1: regulate (Eq. 9) -> select (GA, Eq. 10-13) -> fine-tune (Eq. 14) -> fill the budget.

    The candidates are the agents of ``states``. ``epsilon`` defaults to 0.01 nats ("close
    to zero" in the paper, which gives no value): about the KL of a 10-class mix whose
    shares are off by ±15 % relative. ``batch_cap`` bounds batches in fine-tuning and
    filling (``None``: unbounded, as in the paper). ``ga`` passes through to
    :func:`select_workers`. Filling rescales after tuning, so the final ``kl`` can differ
    from the tuned one by rounding; it is recomputed. ``tau`` (local iterations per round)
    weighs the states' fixed per-round time against the per-sample time in regulation.
    ``min_batch`` is every step's floor (batch-norm layers need at least 2 samples).
    """
    if batch_cap is not None and positive_int("batch_cap", batch_cap) < max_batch:
        raise ValueError(f"batch_cap ({batch_cap}) must be >= max_batch ({max_batch}): Eq. 9 already gives D")
    regulated = regulate_batches(states, max_batch, tau=tau, min_batch=min_batch)
    q = population_distribution(label_dists) if target is None else distribution("target", target)
    sel = select_workers(label_dists, regulated, bytes_per_sample, budget, participation, target=q,  # type: ignore[arg-type]
                         seed=seed, **ga)  # type: ignore[arg-type]
    tuned = tune_batches(sel.agents, regulated, label_dists, epsilon, states, target=q, max_batch=batch_cap,  # type: ignore[arg-type]
                         min_batch=min_batch)
    final = fill_budget(tuned.batches, bytes_per_sample, budget, max_batch=batch_cap, min_batch=min_batch)
    k = kl(mixed_distribution(sel.agents, final, label_dists), q)
    load = sum(final.values()) * float(bytes_per_sample)
    return MergePlan(agents=sel.agents, batches=final, kl=k, reached=k <= epsilon, load_bytes=load, selection=sel)
