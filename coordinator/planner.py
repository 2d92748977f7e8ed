"""Per-round plan: which split point each selected agent trains, and how agents are grouped
on the server. Strategies differ here and only here; the round engine executes any plan."""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from sfl_core.accounting import SplitCost
from sfl_core.config import RunConfig
from sfl_core.grouping import group_by_balance
from sfl_core.hetero import group_by_link_rate, widths_for_groups
from sfl_core.models import SplitModel
from sfl_core.sliding_split import ClientTimeTable, candidate_splits, estimate_round_time, median_rule, warmup_split

from coordinator.registry import AgentInfo, uplink_rate

log = logging.getLogger("sfl.coord.plan")


@dataclass(frozen=True)
class RoundPlan:
    splits: dict[str, int]
    groups: list[list[str]]
    phase: str = ""
    """How the splits were chosen: fixed, warm-up, median rule."""
    widths: dict[str, int] = field(default_factory=dict)
    """Bottleneck width per agent (absent or 0 = no bottleneck)."""
    codecs: dict[str, str] = field(default_factory=dict)
    """Wire codec per agent (absent = the run's codec)."""
    sequential: bool = False
    """SplitFed v2: each group's server copy trains on its members one after another."""
    server_once: bool = False
    """FedFC Alg. 3: a group's server copy counts once in the layer-wise average, not once per member."""


class Planner:
    def __init__(self, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]):
        self.cfg = cfg
        self.model = model
        self.costs = costs
        self.time_table = ClientTimeTable()
        self.wire_ratio: dict[str, float] = {}
        """Measured wire bytes / fp32 bytes per ``"<split>/<codec>"`` (smoothed): the clock charges
        the real encoded bytes, so the estimates must use the same compression."""
        if cfg.strategy == "s2fl":
            cands = cfg.s2fl.candidates or candidate_splits(cfg.model)
            for s in cands:
                model.check_split(s)
            self.candidates: tuple[int, ...] = tuple(cands)
        else:
            self.candidates = ()

    @property
    def configured_splits(self) -> tuple[int, ...]:
        """The cuts the run was told to train at (none where a method picks them, or for FedAvg),
        for the start-of-run check that none of them sends far more bytes than it needs to."""
        if self.cfg.strategy == "sfl":
            return tuple(sorted({self.cfg.split or self.model.default_split, *(self.cfg.profile_splits or {}).values()}))
        return ()

    # ----------------------------------------------------------------- plans
    def selects_everyone(self, r: int) -> bool:
        """S2FL's warm-up sends each candidate split to every device (not only the round's
        selection), so the time table holds a measurement for every agent and split."""
        return bool(self.candidates) and self.cfg.s2fl.sliding and warmup_split(r, self.candidates) is not None

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        plan = self._plan_splits(r, selected, agents)
        h = self.cfg.hetero
        if h.width is not None or h.codecs is not None:
            groups, indices = self.link_groups(selected, agents)
            if h.width is not None:
                plan = replace(plan, widths=self.widths(groups, indices, agents))
            if h.codecs is not None:
                plan = replace(plan, codecs={a: h.codecs[i] for g, i in zip(groups, indices) for a in g})
        return plan

    def _plan_splits(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        cfg = self.cfg
        if cfg.strategy == "fedavg":
            return RoundPlan({a: self.model.num_blocks for a in selected}, [list(selected)], "fedavg")
        if cfg.strategy == "sfl":
            split = cfg.split or self.model.default_split
            groups = [[a] for a in selected] if cfg.server_mode == "per_agent" else [list(selected)]
            by_profile = cfg.profile_splits or {}   # FedFC: mixed cut layers by device class
            return RoundPlan({a: by_profile.get(agents[a].profile.get("name"), split) for a in selected},
                             groups, "fixed" if not by_profile else "per profile",
                             sequential=cfg.server_mode == "sequential", server_once=cfg.server_weight == "once")
        return self._plan_s2fl(r, selected, agents)

    def _plan_s2fl(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        s2 = self.cfg.s2fl
        if not s2.sliding:
            splits, phase = {a: self.candidates[-1] for a in selected}, "fixed (largest candidate)"
        else:
            warm = warmup_split(r, self.candidates)
            if warm is not None:
                splits, phase = {a: warm for a in selected}, f"warm-up {r}/{len(self.candidates)}"
            else:
                self.fill_estimates(selected, agents)
                splits, phase = median_rule(self.time_table, selected, self.candidates), "median rule"
        if s2.balance:
            groups = group_by_balance({a: agents[a].label_counts for a in selected}, s2.group_size,
                                      seed=self.cfg.seed + r)
        else:
            groups = [[a] for a in selected]
        return RoundPlan(splits, groups, phase)

    # ----------------------------------------------------------------- HeteroSFL link groups
    def link_groups(self, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> tuple[list[list[str]], list[int]]:
        """The round's agents by uplink rate, slowest group first, with each group's index into
        the configured per-group lists (empty groups are dropped, so indices can skip)."""
        h = self.cfg.hetero
        rates = {a: uplink_rate(agents[a]) for a in selected}
        groups = group_by_link_rate(rates, groups=h.groups, thresholds=h.thresholds)
        if h.thresholds:   # a group's index is the threshold interval its members' rates fall in
            indices = [bisect.bisect_right(h.thresholds, rates[g[0]]) for g in groups]
        else:              # quantile groups are empty only when agents < groups: the few take the fastest slots
            indices = list(range(h.groups - len(groups), h.groups))
        return groups, indices

    def widths(self, groups: list[list[str]], indices: list[int], agents: Mapping[str, AgentInfo]) -> dict[str, int]:
        """Bottleneck width per agent: the configured width of its group, or widths proportional to
        the groups' rates (the slowest member sets a group's pace), the fastest at full width."""
        h = self.cfg.hetero
        assert h.width is not None
        group_rates = [min(uplink_rate(agents[a]) for a in g) for g in groups]
        fixed = [h.widths[i] for i in indices] if h.widths else None
        widths = widths_for_groups(group_rates, h.width, fixed=fixed)
        return {a: w for g, w in zip(groups, widths) for a in g}

    # ----------------------------------------------------------------- time table
    def fill_estimates(self, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> None:
        """Time-model estimates (docs/methods.md §3) for (agent, split) pairs never measured, from profile and measurements."""
        samples = self.cfg.batch_size * self.cfg.local_iters
        for a in selected:
            info = agents[a]
            measured = info.measured.get("compute_s_per_sample", {}) if isinstance(info.measured, dict) else {}
            up = info.measured.get("up_bytes_per_s") or info.profile["link_bytes_per_s"]
            down = info.measured.get("down_bytes_per_s") or info.profile["downlink_bytes_per_s"]
            for s in self.candidates:
                entry = self.time_table.get(a, s)
                if entry is not None and not entry.estimated:
                    continue
                per_sample = measured.get(str(s))
                ratio = self.wire_ratio.get(f"{s}/{self.cfg.codec}", 1.0)
                self.time_table.set_estimate(a, s, estimate_round_time(
                    self.costs[s], samples=samples, compute_flops=info.profile["compute_flops"],
                    uplink_bytes_per_s=float(up), downlink_bytes_per_s=float(down),
                    server_flops_per_s=self.cfg.server_flops, latency_s=info.profile.get("latency_s", 0.0),
                    messages=2 * self.cfg.local_iters + 2, wire_ratio=ratio,
                    measured_compute_s_per_sample=float(per_sample) if isinstance(per_sample, (int, float)) else None))

    def record_bytes(self, split: int, codec: str, wire_bytes: float, fp32_bytes: float) -> None:
        """Fold one agent-round's measured traffic into the compression ratio of its split and codec."""
        if fp32_bytes <= 0 or wire_bytes <= 0:
            return
        key, ratio = f"{split}/{codec}", wire_bytes / fp32_bytes
        old = self.wire_ratio.get(key)
        self.wire_ratio[key] = ratio if old is None else 0.8 * old + 0.2 * ratio

    def record(self, r: int, times: Mapping[str, float], splits: Mapping[str, int]) -> None:
        """Measured round times of this round's agents go into the table (S2FL updates it every round)."""
        if self.cfg.strategy != "s2fl":
            return
        for a, t in times.items():
            if splits.get(a) in self.candidates:
                self.time_table.record(a, splits[a], t, r)
