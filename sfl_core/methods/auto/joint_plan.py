"""The joint planner behind ``strategy: auto``: split, codec and batch per agent, chosen together.

Each paper tunes one knob (S2FL the split, HeteroSFL the compression, MergeSFL the batch);
a real fleet differs in all of them at once. This module is the pure algorithm: given, per
agent, every way it could train this round (an :class:`Option`: a cut and a codec, with the
time model's round time as a line in the batch size), it returns the assignment whose
slowest agent finishes first while the round keeps its merged batch.

The problem. Agent ``i`` with option ``o`` and batch ``b`` takes
``t_i(o, b) = fixed_i(o) + per_sample_i(o) · b`` seconds (the time model of
docs/methods/time-model.md: compute, transfer and latency; the virtual clock charges the same) and
needs ``mem_i(o, b) = mem_fixed(o) + mem_per_sample(o) · b`` bytes. Choose ``(o_i, b_i)``
for every selected agent to minimise the round time ``max_i t_i`` subject to
``sum_i b_i = B`` (the merged batch the server trains on keeps its size),
``lo <= b_i <= hi`` and ``mem_i <= M_i``.

The algorithm (:func:`plan_round`). For a deadline ``T`` each agent's best response is the
option that lets it train the largest batch by ``T`` within its memory,
``cap_i(T) = max_o min(hi, floor((T - fixed_i(o)) / per_sample_i(o)), memory bound)``.
``cap_i`` never decreases in ``T``, so "every agent can take ``lo`` and
``sum_i cap_i(T) >= B``" is monotone in ``T`` and bisection finds the smallest feasible
deadline ``T*`` to any precision. Every agent then trains at most ``cap_i(T*)``; the
batches are the caps trimmed, largest first, until they sum to ``B``, and each agent takes
the option that is fastest at its batch (no slower than ``T*``, because the capacity option
already fits); an agent whose fastest option is a bottleneck then takes the widest one that
still finishes within the round (the same round time, less information dropped). Since no
assignment can finish before the smallest deadline at which the batches fit, the plan is
optimal up to the bisection's tolerance and integer batches.
Per round the cost is ``O(agents · options · log(1/tol))``: tens of milliseconds for a
thousand agents (``bench/planner.py``).

Without batch regulation (``B`` is then ``len(agents) · batch``, every ``b_i = batch``)
the same code picks, per agent, the option fastest at that batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from sfl_core import timing
from sfl_core.timing import Option

__all__ = ["AgentPlan", "JointPlan", "plan_round", "with_batches", "label_skew", "limit_skew"]


@dataclass(frozen=True)
class AgentPlan:
    option: Option
    batch: int

    @property
    def time_s(self) -> float:
        return self.option.time(self.batch)


@dataclass(frozen=True)
class JointPlan:
    agents: dict[str, AgentPlan]
    deadline_s: float
    """The smallest deadline at which the batches fit (the bisection's answer)."""
    infeasible: list[str] = field(default_factory=list)
    """Agents no option fits at the smallest batch (memory): left out of the round."""

    @property
    def round_s(self) -> float:
        return timing.round_time(p.time_s for p in self.agents.values())

    @property
    def waiting_s(self) -> float:
        return timing.waiting_time(p.time_s for p in self.agents.values())


def _caps(options: Mapping[str, Sequence[Option]], memory: Mapping[str, float | None], deadline: float,
          hi: int) -> dict[str, int]:
    return {a: max((o.largest_batch(deadline, memory.get(a), hi) for o in opts), default=-1)
            for a, opts in options.items()}


def _in_memory(opts: Sequence[Option], batch: int, mem: float | None) -> list[Option]:
    return [o for o in opts if mem is None or o.memory(batch) <= mem]


def _fastest(opts: Sequence[Option], batch: int, mem: float | None) -> Option | None:
    fits = _in_memory(opts, batch, mem)
    return min(fits, key=lambda o: (o.time(batch), -o.split)) if fits else None


def _squeeze(o: Option) -> float:
    """How hard the option's bottleneck squeezes (0: none; a narrower width squeezes harder)."""
    return 1.0 / o.width if o.width else 0.0


def _assign(options: Mapping[str, Sequence[Option]], batches: Mapping[str, int],
            memory: Mapping[str, float | None]) -> dict[str, Option | None]:
    """Each agent's option at its batch: its fastest, except that an agent whose fastest option
    sends a bottleneck takes the widest one that still finishes within the round (the slowest
    agent's time). A learned bottleneck drops information the server never sees, so it is spent
    only where the round needs it; the round time does not change."""
    fastest = {a: _fastest(options[a], b, memory.get(a)) for a, b in batches.items()}
    bound = max((o.time(batches[a]) for a, o in fastest.items() if o is not None), default=0.0)
    out = dict(fastest)
    for a, o in fastest.items():
        if o is not None and o.width:
            b = batches[a]
            fits = [x for x in _in_memory(options[a], b, memory.get(a)) if x.time(b) <= bound * (1 + 1e-9)]
            out[a] = min(fits, key=lambda x: (_squeeze(x), x.time(b), -x.split))
    return out


def plan_round(options: Mapping[str, Sequence[Option]], memory: Mapping[str, float | None], *, total: int,
               lo: int, hi: int, regulate: bool = True, tol: float = 1e-4) -> JointPlan:
    """The minimal-deadline assignment of docs above: per agent an option and a batch.

    ``total``: the round's merged batch ``B``; ``lo``/``hi``: each agent's batch bounds;
    ``regulate=False`` keeps every batch at ``total // len(options)`` and only picks options.
    Agents whose every option overflows their memory at ``lo`` are returned as ``infeasible``.
    """
    if lo < 1 or hi < lo:
        raise ValueError(f"plan_round: batch bounds must satisfy 1 <= lo <= hi, got {lo}..{hi}")
    infeasible = sorted(a for a, opts in options.items()
                        if _fastest(opts, lo, memory.get(a)) is None)
    live = {a: opts for a, opts in options.items() if a not in infeasible}
    if not live:
        return JointPlan({}, 0.0, infeasible)
    if not regulate:
        batch = max(lo, min(hi, total // max(len(options), 1)))
        # the run's batch, or the largest one that fits the agent's memory (at least lo: it is live)
        sizes = {a: min(batch, max(x.largest_batch(math.inf, memory.get(a), batch) for x in opts))
                 for a, opts in live.items()}
        plans = {a: AgentPlan(o, sizes[a]) for a, o in _assign(live, sizes, memory).items()}  # type: ignore[arg-type]
        return JointPlan(plans, timing.round_time(p.time_s for p in plans.values()), infeasible)

    total = max(total, lo * len(live))
    # the deadline lies between "everyone trains lo on its fastest option" and "everyone trains hi"
    low = max(min(o.time(lo) for o in opts) for opts in live.values())
    high = max(max(o.time(hi) for o in opts) for opts in live.values())

    def feasible(t: float) -> bool:
        caps = _caps(live, memory, t, hi)
        return min(caps.values()) >= lo and sum(caps.values()) >= total

    if not feasible(high):   # memory or hi caps the fleet below B: take what fits
        caps = _caps(live, memory, high, hi)
        deadline = high
    else:
        if feasible(low):
            high = low
        while high - low > tol * max(high, 1e-9):
            mid = (low + high) / 2
            if feasible(mid):
                high = mid
            else:
                low = mid
        deadline = high
        caps = _caps(live, memory, deadline, hi)
    batches = _trim(caps, total, lo)
    plans = {a: AgentPlan(o, batches[a]) for a, o in _assign(live, batches, memory).items()}  # type: ignore[arg-type]
    return JointPlan(plans, deadline, infeasible)


def with_batches(plan: JointPlan, batches: Mapping[str, int], options: Mapping[str, Sequence[Option]],
                 memory: Mapping[str, float | None]) -> JointPlan:
    """``plan`` with new batches, each agent on its fastest option at its new batch (or its
    least-squeezing bottleneck that keeps the round's time, as in :func:`plan_round`)."""
    out = {a: AgentPlan(o or plan.agents[a].option, batches[a])
           for a, o in _assign(options, batches, memory).items()}
    return JointPlan(out, timing.round_time(p.time_s for p in out.values()), plan.infeasible)


def _trim(caps: Mapping[str, int], total: int, lo: int) -> dict[str, int]:
    """Caps lowered to sum to ``total``: largest first, one sample at a time in bulk (never below ``lo``)."""
    out = {a: max(c, lo) for a, c in caps.items()}
    excess = sum(out.values()) - total
    if excess <= 0:
        return out
    # lower the largest batches towards a common level: water-filling from the top
    values = np.array(sorted(out.values(), reverse=True), dtype=float)
    level_hi, level_lo = float(values[0]), float(lo)
    while level_hi - level_lo > 0.5:
        level = (level_hi + level_lo) / 2
        if np.minimum(values, level).sum() >= total:
            level_hi = level
        else:
            level_lo = level
    level = math.floor(level_hi)
    trimmed = {a: min(b, level) for a, b in out.items()}
    short = total - sum(trimmed.values())
    for a in sorted(out, key=lambda a: (-out[a], a)):   # the remainder, one each to the largest caps
        if short <= 0:
            break
        if trimmed[a] < out[a]:
            trimmed[a] += 1
            short -= 1
    return trimmed


# ---------------------------------------------------------------- label mix of the merged batch

def label_skew(batches: Mapping[str, float], label_counts: Mapping[str, Sequence[float]],
               target: np.ndarray) -> float:
    """KL divergence (nats) of the merged batch's expected label mix from ``target``."""
    mix = np.zeros_like(target, dtype=float)
    for a, b in batches.items():
        c = np.asarray(label_counts[a], dtype=float)
        mix += b * c / max(c.sum(), 1e-12)
    mix = mix / max(mix.sum(), 1e-12)
    eps = 1e-12
    return float(np.sum(mix * np.log((mix + eps) / (target + eps))))


def limit_skew(batches: Mapping[str, int], equal: Mapping[str, int], label_counts: Mapping[str, Sequence[float]],
               target: np.ndarray, epsilon: float) -> dict[str, int]:
    """Batches moved back towards ``equal`` until the merged label mix is at most ``epsilon`` nats
    further from ``target`` than equal batches would be (regulating batches re-weights the
    agents' labels; this bounds what that may cost). Returns ``batches`` unchanged when it fits."""
    limit = label_skew(equal, label_counts, target) + epsilon
    if label_skew(batches, label_counts, target) <= limit:
        return dict(batches)
    lo_t, hi_t = 0.0, 1.0   # share of the way back to equal
    for _ in range(30):
        mid = (lo_t + hi_t) / 2
        mixed = {a: (1 - mid) * batches[a] + mid * equal[a] for a in batches}
        if label_skew(mixed, label_counts, target) <= limit:
            hi_t = mid
        else:
            lo_t = mid
    total = sum(batches.values())
    blended = {a: (1 - hi_t) * batches[a] + hi_t * equal[a] for a in batches}
    out = {a: max(1, int(round(v))) for a, v in blended.items()}
    rounding = total - sum(out.values())
    for a in sorted(out, key=lambda a: -blended[a])[:abs(rounding)]:
        out[a] += 1 if rounding > 0 else -1 if out[a] > 1 else 0
    return out
