"""``strategy: auto``: split, codec, bottleneck width and batch per agent, planned jointly every round.

The base method that chooses for the user. Each round it builds, for every selected agent,
the options the run allows (each candidate split × each codec within ``auto.max_compression``,
and with bottleneck widths each width at the run's split within ``auto.max_bottleneck``),
prices them with the time model (docs/methods/time-model.md, the function the virtual clock charges)
from the agent's profile, its registration measurements and what its past rounds showed,
and lets :func:`sfl_core.methods.auto.joint_plan.plan_round` pick the assignment whose slowest agent
finishes first while the merged batch keeps its size. Agents whose memory cannot hold any
client portion at the smallest batch sit the round out.

Bottleneck widths (``auto.widths``) are fixed for the run: listed, none, or with ``"auto"`` (the
default) decided once from the run's fleet (:func:`decide_widths`). A learned bottleneck changes the
model and stops the cuts at its split; each agent whose fastest option sends one takes the
widest width that still meets the round's deadline.

It adapts: after each round the measured client compute and link seconds (by the run's
clock) over the predicted ones update two smoothed factors per agent (Eq. 5-6 of MergeSFL),
so a device that slows down is handed a lighter cut, a stronger codec or a smaller batch
within a few rounds. What no agent's compute or link explains — the round's duration by the
run's clock beyond its slowest agent — is predicted where a wall clock measured it: lock-step
phases (:meth:`Auto._phases_excess`), step jitter (:func:`sfl_core.timing.lockstep_slack_s`), and
the coordinator's own work per split agent per step (receiving, decoding, stepping, encoding
and publishing, one agent after another), measured as the rest and smoothed the same way
(:func:`sfl_core.timing.step_overhead_s`). So a deployment predicts its wall-clock round, not
only its agents'. Each round's metrics carry the assignment and the predicted against the
measured round time (the planner's error).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from sfl_core.config.run import RunConfig
from sfl_core.estimates import scale_lr
from sfl_core.evidence import Evidence, evidence_of
from sfl_core.fleet import AgentInfo, fleet_of
from sfl_core.label_mix import dist_matrix, kl_rows, population_distribution, priorities
from sfl_core.methods.auto.config import AutoConfig
from sfl_core.methods.auto.joint_plan import JointPlan, limit_skew, plan_round, with_batches
from sfl_core.methods.auto.learning import Decision, LearningOptions
from sfl_core.methods.auto.structure import depth_reason, selection_for, server_mode_for, shallow_cuts
from sfl_core.methods.base import AgentRound, Method, RoundPlan, split_plan, resolved_split
from sfl_core.model.accounting import SplitCost
from sfl_core.model.norm_layers import batch_norm_layers
from sfl_core.model.zoo import SplitModel, candidate_splits
from sfl_core.timing import Option, lockstep_phases_s, lockstep_slack_s, price_option
from sfl_core.wire.codec import nominal_ratio

log = logging.getLogger(__name__)


class Auto(Method):
    @classmethod
    def plan_notes(cls, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost],
                   rows: Sequence[Any]) -> list[tuple[str, str]]:
        """The bottleneck widths auto decided for this fleet, and where another method's round is
        predicted shorter, by how much (and, when that method's edge is a bottleneck, which key
        gives auto one too)."""
        from sfl_core.methods.preview import variants

        notes = []
        mine = next((r for r in rows if r.strategy == "auto"), None)
        auto_cfg = variants(cfg, model, costs)["auto"]
        widths = decide_widths(auto_cfg, model, costs)
        if AutoConfig.of(auto_cfg).widths:      # what auto decided (widths: auto), or the widths listed
            notes.append((widths.why or f"bottleneck: widths {list(AutoConfig.of(auto_cfg).widths or ())}", "red"))
        rival = min((r for r in rows if r is not mine), key=lambda r: r.round_s, default=None)
        if mine is not None and rival is not None and rival.round_s < mine.round_s:
            hint = ""
            if any(x.width for x in rival.agents.values()) and not widths.widths:
                how = ("list widths in auto.widths, or lower auto.min_bottleneck_values"
                       if AutoConfig.of(auto_cfg).widths == "auto" else "set auto.widths (auto, or a list)")
                hint = f" Its bottleneck is one of auto's options: {how} (docs/methods/auto.md)."
            notes.append((f"{rival.method}'s round is predicted {mine.round_s / rival.round_s:.2f}x shorter "
                          f"than auto's.{hint}", "yellow"))
        return notes

    @classmethod
    def prepare_model(cls, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> None:
        """The bottleneck at the run's split where auto trains widths (:func:`decide_widths`): as
        wide as the widest, running at the narrowest auto may assign (the engine widens it as
        agents train wider ones)."""
        widths = decide_widths(cfg, model, costs).widths
        if widths:
            pair = model.add_bottleneck(resolved_split(cfg, model), max(widths))
            channels = pair.activation_shape[0]
            pair.infer_width = min((w for w in widths if within_bottleneck(w, channels, AutoConfig.of(cfg).max_bottleneck)),
                                   default=pair.width)

    @classmethod
    def preview_variants(cls, base: RunConfig, model: SplitModel,
                         costs: Mapping[int, SplitCost]) -> dict[str, RunConfig]:
        return {"auto": dataclasses.replace(base, strategy="auto")}

    @classmethod
    def one_split_conflict(cls, cfg: RunConfig) -> Optional[str]:
        return ("link-rate groups with a bottleneck (hetero.width) need one fixed split; strategy auto "
                "(the default) plans widths itself from auto.widths")

    def __init__(self, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]):
        super().__init__(cfg, model, costs)
        a = AutoConfig.of(cfg)
        cands = tuple(a.candidates or _default_candidates(cfg, model))
        for s in cands:
            model.check_split(s)
        self.codecs = tuple(c for c in a.codecs if 1 / nominal_ratio(c) <= a.max_compression) or (cfg.codec,)
        self.decision = decide_widths(cfg, model, costs)
        self.widths: tuple[int, ...] = self.decision.widths
        self.bottleneck_at: int | None = None
        """The cut holding the bottleneck pair (the run's split) when it has widths."""
        if self.widths:
            cands = self._cuts_before_bottleneck(cands, explicit=a.candidates is not None and a.widths != "auto")
        elif a.whole_model is not False and model.num_blocks not in cands:   # "auto": until the fleet has said
            cands += (model.num_blocks,)
        self._candidates: tuple[int, ...] = cands
        if not self.choices():
            raise ValueError(f"auto.widths: no width of {list(self.widths)} compresses within "
                             f"auto.max_bottleneck {a.max_bottleneck:g}")
        self.max_batch = a.max_batch or 2 * cfg.batch_size
        self.learner = LearningOptions(cfg)
        """The training options the run leaves to auto, decided from the fleet and the run's accuracy."""
        self.structure: dict[str, Decision] = {}
        """The server mode, the cuts and the selection, where the run leaves them to auto (:mod:`.structure`)."""
        self.scales: dict[str, list[float]] = {}
        """Per agent the smoothed [compute, link] factor: measured seconds over predicted."""
        self.current: JointPlan | None = None
        self.unscaled: dict[str, tuple[float, float, float, float]] = {}
        """Per agent of the last observed round: predicted compute, link, server and client-portion
        transfer (down and up) seconds before the factors (:meth:`_unscaled`)."""
        self.weight_scales: dict[str, float] = {}
        """Per agent the smoothed factor on its client portion's transfer (measured over predicted):
        apart from the link factor, which the per-message costs of the steps inflate."""
        self.overhead_s = cfg.agent_step_overhead_s
        """The coordinator's seconds per split agent per step (:func:`sfl_core.timing.step_overhead_s`):
        the run's ``agent_step_overhead_s`` until a round measures it, then smoothed."""
        self.measured: dict[str, tuple[float, float, float]] = {}
        """Per agent of the last round: its measured compute and link seconds and step jitter."""
        self.jitter: dict[str, float] = {}
        """Per agent the smoothed standard deviation of its step response (a wall clock's)."""
        self.predicted_s: float | None = None
        """The current plan's round as the run's clock will see it (:meth:`_predicted`)."""
        self.last: dict[str, Any] = {}
        self.by_mix = False
        """Whether label-mix selection chose this round's agents out of more online ones."""

    def _cuts_before_bottleneck(self, cands: tuple[int, ...], *, explicit: bool) -> tuple[int, ...]:
        """The candidate cuts with a bottleneck at the run's split: that cut and the earlier ones.
        (An agent cut later would have to run the pair inside its own portion; agents hold a
        bottleneck only where they cut. The whole model is then never an option either.)"""
        b = self.bottleneck_at = resolved_split(self.cfg, self.model)
        channels = self.costs[b].activation_shape[0]
        if self.widths[-1] > channels:
            raise ValueError(f"auto.widths: {self.widths[-1]} is wider than the {channels} channels at split {b}")
        beyond = [s for s in cands if s > b]
        if explicit and beyond:
            raise ValueError(f"auto.candidates: cuts {beyond} lie beyond the bottleneck at split {b} "
                             f"(auto.widths); list cuts up to {b}, or set split")
        return tuple(sorted({s for s in cands if s <= b} | {b}))

    @property
    def candidates(self) -> tuple[int, ...]:
        return self._candidates

    def notes(self, pool: int) -> list[str]:
        cuts = [s for s in self.candidates if s != self.model.num_blocks]
        whole = " (or the whole model)" if self.model.num_blocks in self.candidates else ""
        widths = f", bottleneck width {list(self.widths)} at split {self.bottleneck_at}" if self.widths else ""
        return [f"auto: plans split {cuts}{whole}, codec {list(self.codecs)}{widths} and batch "
                f"{AutoConfig.of(self.cfg).min_batch}..{self.max_batch} per agent each round; "
                f"selection: {AutoConfig.of(self.cfg).selection}"] + ([self.decision.why] if self.decision.why else [])

    # ----------------------------------------------------------------- the round
    def choices(self) -> list[tuple[int, str, int]]:
        """Every (split, codec, bottleneck width) an agent may be given. The whole model sends no
        activations, so it takes the run's codec only; at the bottleneck's cut every width whose
        compression (channels / width) stays within ``auto.max_bottleneck``."""
        out = []
        for s in self.candidates:
            if s == self.model.num_blocks:
                out.append((s, self.cfg.codec, 0))
            elif s != self.bottleneck_at:
                out += [(s, codec, 0) for codec in self.codecs]
            else:
                channels = self.costs[s].activation_shape[0]
                out += [(s, codec, w) for codec in self.codecs for w in self.widths
                        if within_bottleneck(w, channels, AutoConfig.of(self.cfg).max_bottleneck)]
        return out

    def options(self, agent_id: str, info: AgentInfo, *, scaled: bool = True, split_agents: int = 1) -> list[Option]:
        """Every choice this agent may train, priced by the time model (in :meth:`choices` order),
        in a round of ``split_agents`` agents (the coordinator's step overhead grows with them);
        ``scaled=False``: the model before the measured factors and overhead."""
        return [self._price(agent_id, info, c, scaled=scaled, split_agents=split_agents) for c in self.choices()]

    def _price(self, agent_id: str, info: AgentInfo, choice: tuple[int, str, int], *, scaled: bool = True,
               split_agents: int = 1) -> Option:
        """One (split, codec, width) of :meth:`choices` for this agent, at the compression ratio
        and upload share learned so far (see :meth:`options`)."""
        s, codec, w = choice
        cs, ls = self.scales.get(agent_id, (1.0, 1.0)) if scaled else (1.0, 1.0)
        return price_option(self.cfg, self.costs[s], codec, info,
                            ratio=self.wire_ratio.get(f"{s}/{codec}") or nominal_ratio(codec),
                            compute_scale=cs, link_scale=ls, width=w, split_agents=split_agents,
                            per_agent_step_s=self.overhead_s if scaled else 0.0,
                            up_share=self.up_share.get(f"{s}/{codec}", 0.5))

    def _unscaled(self, agent_id: str, info: AgentInfo, p: Any) -> tuple[float, float, float, float]:
        """Agent plan ``p``'s compute, link, server and client-portion transfer seconds before the
        factors, at the compression ratio learned so far: what the factors divide, and what they
        will multiply in the next plan."""
        o = p.option
        raw = self._price(agent_id, info, (o.split, o.codec, o.width), scaled=False)
        compute = raw.compute_per_sample_s * p.batch
        server = self.costs[raw.split].server_flops * self.cfg.local_iters * p.batch / self.cfg.server_flops
        return compute, raw.serial_time(p.batch) - compute - server, server, raw.weights_down_s + raw.weights_up_s

    def _priced(self, selected: Sequence[str], agents: Mapping[str, AgentInfo], *, scaled: bool = True
                ) -> tuple[dict[str, list[Option]], dict[str, float | None]]:
        """Per agent of ``selected`` its priced options and its memory limit (the planner's input)."""
        return ({x: self.options(x, agents[x], scaled=scaled, split_agents=len(selected)) for x in selected},
                {x: agents[x].profile.memory_bytes for x in selected})

    def joint_plan(self, selected: Sequence[str], agents: Mapping[str, AgentInfo], *,
                   by_mix: bool = False) -> JointPlan:
        """The round's assignment for ``selected`` (no side effects: ``sfl-coord plan`` calls it too).
        ``by_mix``: label-mix selection chose ``selected`` out of more online agents."""
        a = AutoConfig.of(self.cfg)
        epsilon = label_mix_bound(a.epsilon, by_mix)
        options, memory = self._priced(selected, agents)
        total = len(selected) * self.cfg.batch_size
        plan = plan_round(options, memory, total=total, lo=a.min_batch, hi=self.max_batch, regulate=a.regulate)
        if a.regulate and plan.agents and epsilon is not None:
            counts = {x: agents[x].label_counts for x in plan.agents}
            target = population_distribution({x: i.label_counts for x, i in agents.items()})
            batches = {x: p.batch for x, p in plan.agents.items()}
            equal = _equal(batches)
            fair = limit_skew(batches, equal, counts, target, epsilon)
            if fair != batches:
                fair = {x: min(self.max_batch, max(a.min_batch, b)) for x, b in fair.items()}
                plan = with_batches(plan, fair, options, memory)
        return plan

    def equal_batch_round_s(self, agents: Mapping[str, AgentInfo]) -> float:
        """The predicted round with every one of ``agents`` training the run's batch on its fastest
        option (before any measurement): how slow the fleet's slowest agent is, whatever batch
        regulation could later move away from it."""
        options, memory = self._priced(list(agents), agents, scaled=False)
        return plan_round(options, memory, total=len(agents) * self.cfg.batch_size, lo=AutoConfig.of(self.cfg).min_batch,
                          hi=self.max_batch, regulate=False).round_s

    @property
    def selection(self) -> str:
        """How the round's agents are chosen: the run's ``auto.selection``, or where it says auto,
        the decision on the registered fleet (:func:`~sfl_core.methods.auto.structure.selection_for`;
        label mix until the fleet has registered)."""
        chosen = AutoConfig.of(self.cfg).selection
        if chosen != "auto":
            return chosen
        d = self.structure.get("selection")
        return d.changes["selection"] if d is not None and d.changes else "kl"

    def select(self, r: int, online: Sequence[str], agents: Mapping[str, AgentInfo],
               default: Sequence[str]) -> tuple[list[str], dict[str, int]]:
        chosen = default
        self.by_mix = self.selection == "kl" and len(default) < len(online)
        if self.by_mix:
            chosen = select_by_label_mix(online, agents, len(default), seed=self.cfg.seed * 100_003 + r)
        plan = self.joint_plan(chosen, agents, by_mix=self.by_mix)
        if plan.infeasible:
            log.warning("round %d: %s cannot hold any client portion in memory; left out", r, ", ".join(plan.infeasible))
        self.current = plan
        self.predicted_s = self._predicted(plan)
        return list(plan.agents), {x: p.batch for x, p in plan.agents.items()}

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        plan = self.current
        if plan is None or set(plan.agents) != set(selected):
            plan = self.current = self.joint_plan(selected, agents, by_mix=self.by_mix)
            self.predicted_s = self._predicted(plan)
        splits = {x: p.option.split for x, p in plan.agents.items()}
        codecs = {x: p.option.codec for x, p in plan.agents.items()}
        widths = {x: p.option.width for x, p in plan.agents.items() if p.option.width}
        windows = {x: p.option.window for x, p in plan.agents.items()}
        return split_plan(self.cfg, splits, "joint plan", codecs=codecs, widths=widths, windows=windows)

    def lr(self, batch: int | None) -> float:
        """MergeSFL's Eq. 15: the learning rate scales with the agent's batch."""
        return self.cfg.lr if batch is None else scale_lr(self.cfg.lr, batch, self.cfg.batch_size)

    def aggregation_weight(self, info: AgentInfo, batch_size: int) -> float:
        return float(batch_size)

    # ----------------------------------------------------------------- what comes back
    def observe(self, rounds: Sequence[AgentRound]) -> None:
        super().observe(rounds)
        alpha = AutoConfig.of(self.cfg).smoothing
        self.measured = {a.agent_id: (a.compute_s, a.transfer_s, a.step_jitter_s) for a in rounds}
        for a in rounds:
            if a.step_jitter_s > 0:
                old_j = self.jitter.get(a.agent_id)
                self.jitter[a.agent_id] = a.step_jitter_s if old_j is None else \
                    alpha * old_j + (1 - alpha) * a.step_jitter_s
        # the plan's agents priced at the ratio this round's wire taught (super().observe): each
        # factor then holds what the ratio does not explain, and not the ratio twice
        plan = self.current.agents if self.current is not None else {}
        self.unscaled = {a.agent_id: self._unscaled(a.agent_id, a.info, plan[a.agent_id]) for a in rounds
                         if a.agent_id in plan}
        for a in rounds:
            if a.agent_id not in self.unscaled:
                continue
            compute, link, _, weights = self.unscaled[a.agent_id]
            if a.weights_phase_s > 0 and weights > 0:
                w_old = self.weight_scales.get(a.agent_id)
                w_new = a.weights_phase_s / weights
                self.weight_scales[a.agent_id] = w_new if w_old is None else alpha * w_old + (1 - alpha) * w_new
            old = self.scales.get(a.agent_id)
            new = [a.compute_s / compute if compute > 0 else 1.0, a.transfer_s / link if link > 0 else 1.0]
            self.scales[a.agent_id] = new if old is None else [alpha * o + (1 - alpha) * n for o, n in zip(old, new)]

    def record(self, r: int, times: Mapping[str, float], splits: Mapping[str, int],
               round_s: float | None = None) -> None:
        super().record(r, times, splits, round_s)
        plan = self.current
        if plan is None:
            return
        predicted = plan.round_s if self.predicted_s is None else self.predicted_s
        measured = max((times[a] for a in plan.agents if a in times), default=0.0)
        if round_s is not None and times:   # the round by the run's clock: a deployment's wall seconds
            measured = round_s
            self._measure_overhead(plan, round_s)
        self.last = {
            "predicted_round_s": round(predicted, 4), "measured_round_s": round(measured, 4),
            "error": round((predicted - measured) / measured, 4) if measured > 0 else None,
            "assign": {a: {"split": p.option.split, "codec": p.option.codec, "width": p.option.width, "batch": p.batch,
                           **({"window": p.option.window} if p.option.window > 1 else {}),
                           "predicted_s": round(p.time_s, 4)} for a, p in sorted(plan.agents.items())},
        }
        if self.overhead_s:
            self.last["overhead_s"] = round(self.overhead_s, 6)
        for a in plan.agents:
            if a in times:
                self.time_table.record(a, plan.agents[a].option.split, times[a], r)

    def _measure_overhead(self, plan: JointPlan, round_s: float) -> None:
        """Fold the round's coordinator overhead per split agent per step into :attr:`overhead_s`:
        ``round_s`` beyond the slowest of its agents' measured compute and link plus the server
        compute the model charges them, less what lock-step explains (the phases and the jitter
        slack), over ``tau`` times the round's split agents (rounded to the microsecond: a
        virtual clock's own arithmetic leaves nothing to learn)."""
        split = list(self._cut(plan))
        agents = [a for a in plan.agents if a in self.measured and a in self.unscaled]
        if not split or not agents:
            return
        explained = {a: self.measured[a][0] + self.measured[a][1] + self.unscaled[a][2] for a in agents}
        slack = self._slack({a: explained[a] for a in split if a in explained},
                            {a: self.measured[a][2] for a in split if a in self.measured})
        beyond = round_s - max(explained.values()) - slack - self._phases_excess(plan)
        seen = max(0.0, round(beyond / (self.cfg.local_iters * len(split)), 6))
        alpha = AutoConfig.of(self.cfg).smoothing
        self.overhead_s = alpha * self.overhead_s + (1 - alpha) * seen

    def _cut(self, plan: JointPlan) -> dict[str, Any]:
        """The plan's agents given a cut (not the whole model): those that step in lock-step."""
        return {a: p for a, p in plan.agents.items() if p.option.split != self.model.num_blocks}

    def _slack(self, times: Mapping[str, float], jitter: Mapping[str, float]) -> float:
        """:func:`sfl_core.timing.lockstep_slack_s` of split agents with these round ``times`` and
        step ``jitter`` (an agent not yet measured: the median of those that were)."""
        known = sorted(j for j in jitter.values() if j > 0)
        if not known:
            return 0.0
        typical = known[len(known) // 2]
        tau = self.cfg.local_iters
        ids = list(times)
        return lockstep_slack_s([times[a] / tau for a in ids], [jitter.get(a) or typical for a in ids], steps=tau)

    def _phases_excess(self, plan: JointPlan) -> float:
        """What lock-step adds to the plan's round where its split agents divide their time
        differently (:func:`sfl_core.timing.lockstep_phases_s`), their client portions' transfers
        at the factors measured for them. Only where a wall clock measured step jitter: a
        virtual clock charges each agent's sum."""
        if not self.jitter:
            return 0.0
        split = self._cut(plan)
        if not split:
            return 0.0
        w = {a: self.weight_scales.get(a, 1.0) for a in split}
        return lockstep_phases_s([p.option.weights_down_s * w[a] for a, p in split.items()],
                                 [p.option.weights_up_s * w[a] for a, p in split.items()],
                                 [p.time_s for p in split.values()], steps=self.cfg.local_iters)

    def _predicted(self, plan: JointPlan) -> float:
        """The plan's round as a wall clock will see it: its slowest agent, plus what lock-step adds
        (:meth:`_phases_excess`, and the slack of its split agents' step jitter, each at its
        smoothed value; none measured: 0, the time model's)."""
        split = {a: p.time_s for a, p in self._cut(plan).items()}
        return plan.round_s + self._phases_excess(plan) + self._slack(split, self.jitter)

    def round_metrics(self) -> dict[str, Any]:
        out = {"auto": dict(self.last)} if self.last else {}
        if self.learner.decisions or self.structure:
            out["learning"] = {**self.learner.summary(), **{k: dict(d.changes or {}) for k, d in self.structure.items()}}
        return out

    def learning(self, r: int, agents: Optional[Mapping[str, AgentInfo]],
                 accuracy: Sequence[float], *, shared_server: bool = False) -> tuple[RunConfig, list[str]]:
        """The training options the run leaves to auto, decided before each round from the
        registered devices' label histograms, the model and the scored accuracy so far
        (:mod:`sfl_core.methods.auto.learning`); and the server mode and the cuts' depth where
        the run leaves them to auto (:mod:`sfl_core.methods.auto.structure`)."""
        lines: list[str] = []
        if agents:
            hists = {a: info.label_counts for a, info in agents.items() if sum(info.label_counts or []) > 0}
            evidence = evidence_of(histograms=hists, classes=max((len(h) for h in hists.values()), default=0),
                                   per_round=self.cfg.per_round or len(agents),
                                   batch_norm=bool(batch_norm_layers(self.model)), accuracy=accuracy, round=r)
            lines = [d.line() for d in self.learner.decide(r, evidence)]
            whole = self.model.num_blocks
            if AutoConfig.of(self.cfg).whole_model == "auto" and evidence.skewed and whole in self._candidates:
                self._candidates = tuple(s for s in self._candidates if s != whole)
                lines.append(f"auto: whole model: off (round {r}: label-skewed devices, mean KL "
                             f"{evidence.label_skew:.2f} nats: a cut's server part trains on every device's rows)")
            lines += [d.line() for d in self._decide_structure(r, evidence, agents, shared_server)]
        cfg = self.learner.config()
        server = self.structure.get("server")
        if server is not None and server.changes:
            cfg = dataclasses.replace(cfg, server_mode=server.changes["server_mode"])
        return cfg, lines

    def _decide_structure(self, r: int, evidence: Evidence, agents: Mapping[str, AgentInfo],
                          shared_server: bool) -> list[Decision]:
        """The server mode and the cuts' depth where the run leaves them to auto
        (:mod:`sfl_core.methods.auto.structure`); the decisions that changed."""
        changed = []
        whole = self.model.num_blocks
        cuts = tuple(s for s in self._candidates if s != whole)
        if self.learner.cfg.server_mode == "auto":
            mode, why = server_mode_for(evidence, server_blocks=whole - min(cuts, default=0), shared=shared_server)
            now = self.structure.get("server")
            if now is None or now.changes != {"server_mode": mode}:
                changed.append(Decision("server", {"server_mode": mode}, why, r))
        if AutoConfig.of(self.cfg).selection == "auto":
            mode, why = selection_for(evidence)
            now = self.structure.get("selection")
            if now is None or now.changes != {"selection": mode}:
                changed.append(Decision("selection", {"selection": mode}, why, r))
        if (AutoConfig.of(self.cfg).candidates is None and "cut" not in self.structure
                and evidence.strongly_skewed and len(cuts) > 1):
            kept, t, every = shallow_cuts(cuts, lambda c: self._round_over(c, agents))
            self._candidates = tuple(s for s in self._candidates if s in kept or s == whole)
            changed.append(Decision("cut", {"candidates": list(kept)}, depth_reason(evidence, kept, cuts, t, every), r))
        self.structure.update((d.key, d) for d in changed)
        return changed

    def _round_over(self, cuts: tuple[int, ...], agents: Mapping[str, AgentInfo]) -> float:
        """The fleet's predicted round at equal batches with the planner's cuts limited to ``cuts``."""
        kept = self._candidates
        try:
            self._candidates = cuts
            return self.equal_batch_round_s(agents)
        finally:
            self._candidates = kept

    def to_json(self) -> dict[str, Any]:
        out = {**super().to_json(), "auto_scales": {a: list(v) for a, v in self.scales.items()}}
        if self.learner.decisions:
            out["auto_learning"] = self.learner.to_json()
        if self.structure:
            out["auto_structure"] = {k: d.to_json() for k, d in self.structure.items()}
        if self.overhead_s:
            out["auto_overhead_s"] = self.overhead_s
        if self.jitter:
            out["auto_jitter_s"] = dict(self.jitter)
        if self.weight_scales:
            out["auto_weight_scales"] = dict(self.weight_scales)
        return out

    def load_json(self, st: Mapping[str, Any]) -> None:
        super().load_json(st)
        self.learner.load_json(st.get("auto_learning") or {})
        self._load_structure(st.get("auto_structure") or {})
        self.scales = {str(a): [float(x) for x in v][:2] for a, v in (st.get("auto_scales") or {}).items()}
        self.overhead_s = float(st.get("auto_overhead_s", self.cfg.agent_step_overhead_s))
        self.jitter = {str(a): float(v) for a, v in (st.get("auto_jitter_s") or {}).items()}
        self.weight_scales = {str(a): float(v) for a, v in (st.get("auto_weight_scales") or {}).items()}

    def _load_structure(self, doc: Mapping[str, Any]) -> None:
        """The server mode and cuts a resumed run had decided (an entry that no longer applies
        or does not read is dropped: the next round decides it again)."""
        self.structure = {}
        for key, v in doc.items():
            try:
                d = Decision.from_json(key, v)
                if key == "server" and self.learner.cfg.server_mode == "auto" \
                        and (d.changes or {}).get("server_mode") in ("merged", "sequential"):
                    self.structure[key] = d
                elif key == "selection" and AutoConfig.of(self.cfg).selection == "auto" \
                        and (d.changes or {}).get("selection") in ("kl", "uniform"):
                    self.structure[key] = d
                elif key == "cut" and AutoConfig.of(self.cfg).candidates is None:
                    kept = [int(c) for c in (d.changes or {}).get("candidates", []) if int(c) in self._candidates]
                    if kept:
                        self._candidates = tuple(s for s in self._candidates if s in kept or s == self.model.num_blocks)
                        self.structure[key] = dataclasses.replace(d, changes={"candidates": kept})
            except (KeyError, TypeError, ValueError):
                continue


LABEL_MIX_BOUND = 0.05
"""``auto.epsilon: auto`` where the round's agents were not chosen by their label mix (nats)."""


def label_mix_bound(epsilon: float | str, by_mix: bool) -> float | None:
    """``auto.epsilon`` as a round applies it (None: no bound). ``auto``: none where label-mix
    selection chose the round's agents out of more (a set picked for a merged mix close to the
    population's stays close under regulated batches: in the mixed-fleet, S2FL and MergeSFL
    benches dropping the bound then cost no accuracy and shortened the rounds), else
    :data:`LABEL_MIX_BOUND` (a uniform sample, or every agent: there the bound bought 2.4
    points on the mixed fleet)."""
    if epsilon != "auto":
        return float(epsilon)
    return None if by_mix else LABEL_MIX_BOUND


def within_bottleneck(width: int, channels: int, max_bottleneck: float) -> bool:
    """Whether a bottleneck of ``width`` of the cut's ``channels`` compresses at most ``auto.max_bottleneck``."""
    return channels / width <= max_bottleneck + 1e-9


# ----------------------------------------------------------------- bottleneck widths: on or off

WIDTHS_PAY = 2.5
"""``auto.widths: auto`` (the default) switches the bottleneck on where it makes the fleet's
predicted round at the run's batch size (every agent on its fastest option) at least this many
times shorter. At equal batches, because batch regulation can hide a slow link only by moving
samples off it, which the label-mix bound (``auto.epsilon``) limits. The threshold sits between
the fleets where the bottleneck paid on the benches and those where it did not (the figures are
in docs/results.md). How much a bottleneck slows learning is the model's and the data's, which
the time model cannot see; the ladder's floor of values per sample (``auto.min_bottleneck_values``)
keeps out the widths that stalled learning (docs/methods/auto.md)."""


@dataclass(frozen=True)
class WidthsDecision:
    widths: tuple[int, ...]
    """What the run trains: () = no bottleneck."""
    why: str = ""
    """One line for the run's notes ("" where the user listed the widths or switched them off)."""


def width_ladder(channels: int, max_bottleneck: float, positions: int = 1, min_values: int = 1) -> tuple[int, ...]:
    """The widths ``auto.widths: auto`` offers: the cut's full width and each quarter of it down to
    one channel (HeteroSFL's 4x steps), within ``auto.max_bottleneck`` and sending at least
    ``min_values`` values per sample (``width x positions``, the map's positions per channel;
    ``auto.min_bottleneck_values``). The full width is always offered."""
    widths, w = {channels}, channels
    while w > 1:
        w = max(1, w // 4)
        widths.add(w)
    return tuple(sorted(w for w in widths if w == channels or (
        within_bottleneck(w, channels, max_bottleneck) and w * positions >= min_values)))


def decide_widths(cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> WidthsDecision:
    """The bottleneck widths a run under strategy auto trains: the listed ones, none, or for
    ``"auto"`` the :func:`width_ladder` where it pays :data:`WIDTHS_PAY` by the time model,
    judged on the run config's fleet (its profiles; a run whose agents bring their own profiles
    has none to judge, and gets no bottleneck). A pure function of the config, so the model
    builder, the engine and ``sfl-coord plan`` agree, and a resumed run decides the same."""
    a = AutoConfig.of(cfg)
    if cfg.strategy != "auto" or not a.widths:
        return WidthsDecision(())
    if not isinstance(a.widths, str):   # a list of widths, not "auto"
        return WidthsDecision(tuple(sorted(set(a.widths))))
    agents = fleet_of(cfg)
    if not agents:
        return WidthsDecision((), "bottleneck: off (no fleet in the run config to judge it on)")
    b = resolved_split(cfg, model)
    if b >= model.num_blocks:
        return WidthsDecision(())
    shape = costs[b].activation_shape
    widths = width_ladder(shape[0], a.max_bottleneck, math.prod(shape[1:]), a.min_bottleneck_values)
    if len(widths) < 2:
        return WidthsDecision((), f"bottleneck: off (at split {b} no width narrower than the {shape[0]} channels "
                                  f"sends the {a.min_bottleneck_values} values per sample of auto.min_bottleneck_values)")
    cuts = tuple(s for s in (a.candidates or ()) if s <= b) or None
    without = Auto(a.replace_in(cfg, widths=None), model, costs)
    with_ = Auto(a.replace_in(cfg, widths=widths, candidates=cuts), model, costs)
    t0, t1 = (m.equal_batch_round_s(agents) for m in (without, with_))
    gain = t0 / t1 if t1 > 0 else 1.0
    if gain >= WIDTHS_PAY:
        return WidthsDecision(widths, f"bottleneck: widths {list(widths)} at split {b}: the fleet's predicted "
                                      f"round at equal batches {t0:.3g} s -> {t1:.3g} s ({gain:.2f}x >= {WIDTHS_PAY:g}x)")
    return WidthsDecision((), f"bottleneck: off (widths {list(widths)} at split {b} would shorten the fleet's "
                              f"predicted round at equal batches {gain:.2f}x, under the {WIDTHS_PAY:g}x that switches them on)")


def _default_candidates(cfg: RunConfig, model: SplitModel) -> tuple[int, ...]:
    try:
        return candidate_splits(cfg.model)
    except ValueError:
        return (resolved_split(cfg, model),)


def select_by_label_mix(online: Sequence[str], agents: Mapping[str, AgentInfo], k: int, *, seed: int) -> list[str]:
    """``k`` of the ``online`` agents whose merged label mix (equal batches) is close to the whole
    population's (MergeSFL's objective, Eq. 11-12), taking rarely chosen agents first.

    Every agent gets a random key weighted by MergeSFL's priority (Eq. 13: the fewer rounds it
    took part in, the larger); a pool of the ``1.5 k`` largest keys is then filled greedily,
    each time with the agent that brings the mix closest to the population's, ties going to
    the larger key. The pool and the tie-break keep it fair (an agent the label mix never
    needs enters the pool more often the longer it sits out); greedy keeps it linear in the
    fleet (MergeSFL's genetic search is :func:`sfl_core.methods.mergesfl.control.select_workers`)."""
    ids = sorted(online)
    rng = np.random.default_rng(seed)
    weights = priorities({a: agents[a].rounds for a in ids}, ids)
    keys = rng.random(len(ids)) ** (1.0 / weights)          # Efraimidis-Spirakis: weighted, no replacement
    pool = [ids[i] for i in np.argsort(-keys)[:min(len(ids), k + max(1, k // 2))]]   # largest key first
    target = population_distribution({a: i.label_counts for a, i in agents.items()})
    rows = dist_matrix(pool, {a: agents[a].label_counts for a in pool})
    chosen: list[int] = []
    mix = np.zeros_like(target)
    for n in range(1, min(k, len(pool)) + 1):
        trial = (mix * (n - 1) + rows) / n                   # the mix with each candidate added
        score = kl_rows(trial, target)
        score[chosen] = np.inf
        best = int(np.flatnonzero(score <= score.min() + 1e-9)[0])   # pool order: the larger key wins ties
        chosen.append(best)
        mix = trial[best]
    return sorted(pool[i] for i in chosen)


def _equal(batches: Mapping[str, int]) -> dict[str, int]:
    n, total = len(batches), sum(batches.values())
    return {a: total // n + (1 if i < total % n else 0) for i, a in enumerate(sorted(batches))}
