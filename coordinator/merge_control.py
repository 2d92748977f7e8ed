"""MergeSFL's control loop on the coordinator (MergeSFL paper, Liao et al. 2023, Alg. 1; docs/methods.md §7).

The algorithms are pure functions in :mod:`sfl_core.mergesfl`; this class holds what they
need between rounds — each agent's smoothed compute and transfer seconds per sample (μ, β)
— and turns a round's candidates into the selected agents and their batch sizes. Wall and
virtual clocks feed it the same way (:meth:`observe`), so deployment and simulation share it.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from sfl_core import mergesfl
from sfl_core.accounting import SplitCost
from sfl_core.config import RunConfig
from sfl_core.mergesfl import AgentState

from coordinator.registry import AgentInfo, uplink_rate

log = logging.getLogger("sfl.coord.merge")


class MergeControl:
    def __init__(self, cfg: RunConfig, cost: SplitCost):
        """``cost`` is the split the agents train at: its activation bytes are the ``c`` of Eq. 10."""
        self.cfg = cfg
        self.m = cfg.mergesfl
        self.cost = cost
        self.states: dict[str, AgentState] = {}
        self.last: dict[str, Any] = {}
        """What the last :meth:`choose` decided (KL, budget, load), for the round's metrics."""

    @property
    def active(self) -> bool:
        return self.m.regulate or self.m.select

    @property
    def max_batch(self) -> int:
        return self.m.max_batch or self.cfg.batch_size

    def budget(self, pool: int) -> float:
        """Ingress bytes per step: configured, or what ``per_round`` agents at ``batch_size`` would send."""
        if self.m.budget_bytes is not None:
            return self.m.budget_bytes
        return (self.cfg.per_round or pool) * self.cfg.batch_size * self.cost.activation_bytes

    def state(self, agent_id: str, info: AgentInfo) -> AgentState:
        """The smoothed (μ, β), or a first estimate from the profile and registration measurements."""
        if agent_id in self.states:
            return self.states[agent_id]
        measured = info.measured.get("compute_s_per_sample", {}) if isinstance(info.measured, dict) else {}
        per_sample = measured.get(str(self.cost.split)) if isinstance(measured, dict) else None
        mu = float(per_sample) if isinstance(per_sample, (int, float)) and per_sample > 0 else \
            self.cost.client_flops / float(info.profile["compute_flops"])
        down = float(info.profile.get("downlink_bytes_per_s") or info.profile["link_bytes_per_s"])
        beta = self.cost.activation_bytes / uplink_rate(info) + self.cost.activation_bytes / down
        return AgentState(mu=mu, beta=beta)

    def choose(self, r: int, candidates: Sequence[str], agents: Mapping[str, AgentInfo],
               default: Sequence[str]) -> tuple[list[str], dict[str, int]]:
        """The round's agents and batch sizes. With ``select`` the GA picks among ``candidates``
        (Alg. 1: regulate, select under the budget, fine-tune towards KL <= ε, fill the budget);
        otherwise the ``default`` selection is kept and, with ``regulate``, its batches follow Eq. 9."""
        if self.m.select:
            states = {a: self.state(a, agents[a]) for a in candidates}
            budget = self.budget(len(candidates))
            plan = mergesfl.plan_round(
                states, {a: agents[a].label_counts for a in candidates}, {a: agents[a].rounds for a in candidates},
                max_batch=self.max_batch, bytes_per_sample=self.cost.activation_bytes, budget=budget,
                epsilon=self.m.epsilon, batch_cap=self.max_batch, seed=self.cfg.seed * 100_003 + r,
                population=self.m.ga_population, generations=self.m.ga_generations,
                crossover=self.m.ga_crossover, mutation=self.m.ga_mutation)
            self.last = {"kl": round(plan.kl, 6), "kl_reached": plan.reached, "budget_bytes": budget,
                         "load_bytes": plan.load_bytes}
            return sorted(plan.agents), dict(plan.batches)
        selected = list(default)
        if not self.m.regulate:
            return selected, {}
        batches = mergesfl.regulate_batches({a: self.state(a, agents[a]) for a in selected}, self.max_batch)
        target = mergesfl.population_distribution({a: agents[a].label_counts for a in candidates})
        k = mergesfl.kl(mergesfl.mixed_distribution(selected, batches, {a: agents[a].label_counts
                                                                         for a in selected}), target)
        self.last = {"kl": round(k, 6)}
        return selected, batches

    def lr(self, batch: int) -> float:
        """Eq. 15: learning rate scaled linearly with the agent's batch."""
        return mergesfl.scale_lr(self.cfg.lr, batch, self.cfg.batch_size)

    def observe(self, agent_id: str, *, compute_s: float, transfer_s: float, samples: int) -> None:
        """Eq. 5-6: fold one round's measured per-sample compute and transfer into the estimate."""
        if samples <= 0:
            return
        new = (compute_s / samples, transfer_s / samples)
        old = self.states.get(agent_id)
        self.states[agent_id] = AgentState(*new) if old is None else old.update(*new, alpha=self.m.smoothing)

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict[str, list[float]]:
        return {a: [s.mu, s.beta] for a, s in self.states.items()}

    def load_json(self, d: Mapping[str, Sequence[float]]) -> None:
        self.states = {a: AgentState(float(v[0]), float(v[1])) for a, v in d.items()}
