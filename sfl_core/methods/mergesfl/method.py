"""MergeSFL (Liao et al., 2023): KL-divergence selection and batch-size regulation, as a layer over any split method.

Feature merging is the server trainer's merged step (``server_mode: merged``); this module
holds the other two mechanisms (paper Alg. 1; docs/methods/mergesfl.md).

The algorithms are pure functions in :mod:`sfl_core.methods.mergesfl.control`; this class holds what they
need between rounds — each agent's smoothed compute and transfer seconds per sample (μ, β)
and fixed transfer seconds per round, and the ingress the past rounds observed (for the
budget ``B`` of Eq. 10) — and turns a round's candidates into the selected agents and their
batch sizes. Wall and virtual clocks feed it the same way (:meth:`observe`), so deployment
and simulation share it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Mapping, Sequence

from sfl_core.config.run import DeviceProfile, RunConfig
from sfl_core.estimates import AgentState
from sfl_core.fleet import AgentInfo, uplink_rate
from sfl_core.methods.base import AgentRound, Layer, Method, resolved_split
from sfl_core.methods.mergesfl import control as mergesfl
from sfl_core.methods.mergesfl.config import MergeSflConfig
from sfl_core.model.accounting import SplitCost
from sfl_core.model.zoo import SplitModel
from sfl_core.timing import transfer_time

log = logging.getLogger("sfl.method.mergesfl")

BUDGET_WINDOW = 10
"""Past rounds the ingress budget is estimated from (:func:`sfl_core.methods.mergesfl.control.estimate_budget`)."""


class MergeControl:
    def __init__(self, cfg: RunConfig, cost: SplitCost, states: dict[str, AgentState] | None = None):
        """``cost`` is the split the agents train at: its activation bytes are the ``c`` of Eq. 10.
        ``states``: where the per-agent (μ, β) live (the run's :class:`~sfl_core.fleet.FleetEstimates`
        ``rates``; updated in place)."""
        self.cfg = cfg
        self.m = MergeSflConfig.of(cfg)
        self.cost = cost
        self.states: dict[str, AgentState] = {} if states is None else states
        self.ingress: list[list[int]] = []
        """``[planned, received]`` activation bytes per local iteration of the last rounds, oldest first."""
        self._planned: dict[str, int] = {}
        """This round's planned batches of the agents not yet observed: what counts as received."""
        self.last: dict[str, Any] = {}
        """What the last :meth:`choose` decided (KL, budget, load), for the round's metrics."""

    @property
    def max_batch(self) -> int:
        return self.m.max_batch or self.cfg.batch_size

    def nominal_budget(self, pool: int) -> float:
        """Ingress bytes per step before any measurement: configured, or what ``per_round`` agents
        (else the whole ``pool``) at ``batch_size`` would send."""
        if self.m.budget_bytes is not None:
            return self.m.budget_bytes
        return (self.cfg.per_round or pool) * self.cfg.batch_size * self.cost.activation_bytes

    def budget(self, pool: int) -> float:
        """Eq. 10's ``B`` for the coming round, in activation bytes per local iteration.

        A configured ``mergesfl.budget_bytes`` is a fixed override. Otherwise the paper's
        estimate from past rounds: the median over the last :data:`BUDGET_WINDOW` rounds of
        the ingress each observed (:func:`sfl_core.methods.mergesfl.control.observed_ingress`: the nominal
        budget times the share of the planned activation bytes that arrived); the first round
        has no past and takes the nominal budget. Never below one agent at the maximum batch,
        so rounds that all failed still leave a round to recover in.
        """
        nominal = self.nominal_budget(pool)
        past = [(p, r) for p, r in self.ingress if p > 0]
        if self.m.budget_bytes is not None or not past:
            return nominal
        seen = [mergesfl.observed_ingress(nominal, p, r) for p, r in past]
        floor = min(nominal, self.max_batch * self.cost.activation_bytes)
        return max(mergesfl.estimate_budget(seen, window=BUDGET_WINDOW), floor)

    def describe(self, pool: int) -> str:
        """The one line a run starts with when selection decides how many agents train: a user
        who set ``per_round`` must learn that it is not used, and what bounds the count."""
        if not self.m.select:
            return ""
        budget = self.nominal_budget(pool)
        bounds = f"{self.m.min_agents}..{self.m.max_agents or pool}"
        how = "fixed by mergesfl.budget_bytes" if self.m.budget_bytes is not None else \
            "first round; then estimated from what arrived"
        return (f"MergeSFL selection: agents chosen by KL to the population's label mix under an ingress budget "
                f"of {budget / 1e6:.3g} MB per step ({budget / self.cost.activation_bytes:.0f} samples; {how}); "
                f"per_round is not used; agents per round {bounds} (mergesfl.min_agents/max_agents), "
                f"batches {self.m.min_batch}..{self.max_batch}")

    def state(self, agent_id: str, info: AgentInfo) -> AgentState:
        """The smoothed (μ, β), or a first estimate from the profile and registration measurements."""
        if agent_id in self.states:
            return self.states[agent_id]
        measured = info.measured.get("compute_s_per_sample", {}) if isinstance(info.measured, dict) else {}
        per_sample = measured.get(str(self.cost.split)) if isinstance(measured, dict) else None
        mu = float(per_sample) if isinstance(per_sample, (int, float)) and per_sample > 0 else \
            self.cost.client_flops / info.profile.compute_flops
        down = info.profile.downlink
        beta = transfer_time(self.cost.activation_bytes, self.cost.activation_bytes, uplink_rate(info), down)
        # assignment, tau activations, tau gradients, weights: 2 tau + 2 messages
        fixed = mergesfl.fixed_transfer_time(self.cost.client_param_bytes, uplink_rate(info), down,
                                             messages=2 * self.cfg.local_iters + 2,
                                             latency_s=info.profile.latency_s)
        return AgentState(mu=mu, beta=beta, fixed=fixed)

    def choose(self, r: int, candidates: Sequence[str], agents: Mapping[str, AgentInfo],
               default: Sequence[str]) -> tuple[list[str], dict[str, int]]:
        """The round's agents and batch sizes. With ``select`` the GA picks among ``candidates``
        (Alg. 1: regulate, select under the budget, fine-tune towards KL <= ε, fill the budget);
        otherwise the ``default`` selection is kept and, with ``regulate``, its batches follow Eq. 9."""
        if self.m.select:
            states = {a: self.state(a, agents[a]) for a in candidates}
            budget = self.budget(len(candidates))
            plan = mergesfl.plan_merge_round(
                states, {a: agents[a].label_counts for a in candidates}, {a: agents[a].rounds for a in candidates},
                max_batch=self.max_batch, bytes_per_sample=self.cost.activation_bytes, budget=budget,
                epsilon=self.m.epsilon, batch_cap=self.max_batch, seed=self.cfg.seed * 100_003 + r,
                tau=self.cfg.local_iters, population=self.m.ga_population, generations=self.m.ga_generations,
                crossover=self.m.ga_crossover, mutation=self.m.ga_mutation, min_batch=self.m.min_batch,
                min_agents=self.m.min_agents, max_agents=self.m.max_agents)
            self.last = {"kl": round(plan.kl, 6), "kl_reached": plan.reached, "budget_bytes": budget,
                         "load_bytes": plan.load_bytes, "agents": len(plan.agents)}
            self._plan_ingress(plan.batches)
            return sorted(plan.agents), dict(plan.batches)
        selected = list(default)
        if not self.m.regulate:
            return selected, {}
        batches = mergesfl.regulate_batches({a: self.state(a, agents[a]) for a in selected}, self.max_batch,
                                            tau=self.cfg.local_iters, min_batch=self.m.min_batch)
        target = mergesfl.population_distribution({a: agents[a].label_counts for a in candidates})
        k = mergesfl.kl(mergesfl.mixed_distribution(selected, batches, {a: agents[a].label_counts
                                                                         for a in selected}), target)
        self.last = {"kl": round(k, 6)}
        self._plan_ingress(batches)
        return selected, batches

    def _plan_ingress(self, batches: Mapping[str, int]) -> None:
        """Open this round's ingress record: the planned bytes per step now, the received ones as
        the agents' rounds are observed (:meth:`observe`)."""
        self._planned = dict(batches)
        self.ingress = (self.ingress + [[sum(batches.values()) * self.cost.activation_bytes, 0]])[-BUDGET_WINDOW:]

    def lr(self, batch: int) -> float:
        """Eq. 15: learning rate scaled linearly with the agent's batch."""
        return mergesfl.scale_lr(self.cfg.lr, batch, self.cfg.batch_size)

    def fixed_transfer_s(self, profile: DeviceProfile, weights_bytes: float, messages: int) -> float:
        """The link seconds of one agent's round that do not grow with its batch, for :meth:`observe`:
        the client portion's weights down and up, plus one latency per message, at the rates of
        ``profile`` (the agent's profile at that round, ``DeviceProfile.at_round``) — the rates the
        virtual clock charged, so in simulation the split of the measured transfer is exact.

        ``weights_bytes`` is the encoded size of the agent's weights upload. It stands for the
        download too: the assignment carries the same encoded client state (plus a few hundred
        bytes of settings), and the engine keeps no separate count of it. Encoded sizes, not
        the fp32 ``SplitCost.client_param_bytes``, because compression makes the wire smaller
        and overstating the fixed part would understate ``beta``.
        """
        up = profile.link_bytes_per_s
        down = profile.downlink
        return mergesfl.fixed_transfer_time(weights_bytes, up, down, messages=messages,
                                            latency_s=profile.latency_s)

    def observe(self, agent_id: str, *, compute_s: float, transfer_s: float, samples: int,
                fixed_transfer_s: float = 0.0) -> None:
        """Eq. 5-6: fold one round's measurements into the agent's estimates.

        ``transfer_s`` is all of the agent's link time in the round, ``fixed_transfer_s`` the
        part that does not scale with the batch (:meth:`fixed_transfer_s`): ``beta`` gets only
        the rest, per sample (``samples = tau * batch``), and the fixed part is smoothed on its
        own — folded into ``beta`` it would make small batches look slow and shrink them further
        (:func:`sfl_core.methods.mergesfl.control.split_transfer`). The agent's planned activations also count
        as received for the ingress budget."""
        if samples <= 0:
            return
        beta, fixed = mergesfl.split_transfer(transfer_s, fixed_transfer_s, samples)
        mu = compute_s / samples
        old = self.states.get(agent_id)
        self.states[agent_id] = AgentState(mu, beta, fixed) if old is None else \
            old.update(mu, beta, alpha=self.m.smoothing, fixed=fixed)
        batch = self._planned.pop(agent_id, None)
        if batch is not None and self.ingress:
            self.ingress[-1][1] += batch * self.cost.activation_bytes

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict[str, Any]:
        """``{"agents": {id: [mu, beta, fixed]}, "ingress": [[planned, received], ...]}``."""
        return {"agents": {a: [s.mu, s.beta, s.fixed] for a, s in self.states.items()},
                "ingress": [list(x) for x in self.ingress]}

    def load_json(self, d: Mapping[str, Any]) -> None:
        """The :meth:`to_json` format, or the older ``{id: [mu, beta]}`` (no fixed part, no ingress history)."""
        agents = d.get("agents")
        if isinstance(agents, Mapping):
            ingress = [[int(p), int(r)] for p, r in d.get("ingress", [])]
        else:
            agents, ingress = d, []
        self.states.clear()     # in place: the dict is the fleet estimates' rates
        self.states.update({a: AgentState(float(v[0]), float(v[1]), float(v[2]) if len(v) > 2 else 0.0)
                            for a, v in agents.items()})
        self.ingress = ingress[-BUDGET_WINDOW:]


class MergeSFL(Layer):
    """Selection (``mergesfl.select``) and/or batch regulation (``mergesfl.regulate``) on top of
    the inner method's plan; weights are averaged by batch size (paper Eq. 17)."""

    @classmethod
    def preview_variants(cls, base: RunConfig, model: SplitModel,
                         costs: Mapping[int, SplitCost]) -> dict[str, RunConfig]:
        return {"MergeSFL": MergeSflConfig.of(base).replace_in(replace(base, strategy="sfl"), regulate=True, select=True)}

    def __init__(self, inner: Method):
        super().__init__(inner)
        self.control = MergeControl(self.cfg, self.costs[resolved_split(self.cfg, self.model)],
                                    states=self.fleet.rates)

    @staticmethod
    def wanted(cfg: RunConfig) -> bool:
        return MergeSflConfig.of(cfg).regulate or MergeSflConfig.of(cfg).select

    def notes(self, pool: int) -> list[str]:
        return [self.control.describe(pool), *self.inner.notes(pool)]

    def select(self, r: int, online: Sequence[str], agents: Mapping[str, AgentInfo],
               default: Sequence[str]) -> tuple[list[str], dict[str, int]]:
        selected, _ = self.inner.select(r, online, agents, default)
        return self.control.choose(r, online, agents, selected)

    def lr(self, batch: int | None) -> float:
        return self.control.lr(batch) if batch else self.inner.lr(batch)

    def aggregation_weight(self, info: AgentInfo, batch_size: int) -> float:
        return float(batch_size)

    def round_metrics(self) -> dict[str, Any]:
        return {**self.inner.round_metrics(), "mergesfl": dict(self.control.last)}

    def observe(self, rounds: Sequence[AgentRound]) -> None:
        self.inner.observe(rounds)
        for a in rounds:
            fixed = self.control.fixed_transfer_s(a.profile, a.weights_bytes, a.messages)
            self.control.observe(a.agent_id, compute_s=a.compute_s, transfer_s=a.transfer_s, samples=a.samples,
                                 fixed_transfer_s=fixed)

    def to_json(self) -> dict[str, Any]:
        return {**self.inner.to_json(), "merge_states": self.control.to_json()}

    def load_json(self, st: Mapping[str, Any]) -> None:
        self.inner.load_json(st)
        self.control.load_json(st.get("merge_states", {}))
