"""Per-round plan: which split point each selected agent trains, and how agents are grouped
on the server. Strategies differ here and only here; the round engine executes any plan."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

from sfl_core.accounting import SplitCost
from sfl_core.config import RunConfig
from sfl_core.grouping import group_by_balance
from sfl_core.models import SplitModel
from sfl_core.sliding_split import ClientTimeTable, candidate_splits, estimate_round_time, median_rule, warmup_split

from coordinator.registry import AgentInfo

log = logging.getLogger("sfl.coord.plan")


@dataclass(frozen=True)
class RoundPlan:
    splits: dict[str, int]
    groups: list[list[str]]
    phase: str = ""
    """How the splits were chosen: fixed, warm-up, median rule."""


class Planner:
    def __init__(self, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]):
        self.cfg = cfg
        self.model = model
        self.costs = costs
        self.time_table = ClientTimeTable()
        if cfg.strategy == "s2fl":
            cands = cfg.s2fl.candidates or candidate_splits(cfg.model)
            for s in cands:
                model.check_split(s)
            self.candidates: tuple[int, ...] = tuple(cands)
        else:
            self.candidates = ()

    # ----------------------------------------------------------------- plans
    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        cfg = self.cfg
        if cfg.strategy == "fedavg":
            return RoundPlan({a: self.model.num_blocks for a in selected}, [list(selected)], "fedavg")
        if cfg.strategy == "sfl":
            split = cfg.split or self.model.default_split
            groups = [list(selected)] if cfg.server_mode == "merged" else [[a] for a in selected]
            return RoundPlan({a: split for a in selected}, groups, "fixed")
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

    # ----------------------------------------------------------------- time table
    def fill_estimates(self, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> None:
        """SPEC §3 estimates for (agent, split) pairs never measured, from profile and measurements."""
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
                self.time_table.set_estimate(a, s, estimate_round_time(
                    self.costs[s], samples=samples, compute_flops=info.profile["compute_flops"],
                    uplink_bytes_per_s=float(up), downlink_bytes_per_s=float(down),
                    server_flops_per_s=self.cfg.server_flops, latency_s=info.profile.get("latency_s", 0.0),
                    messages=2 * self.cfg.local_iters + 2,
                    measured_compute_s_per_sample=float(per_sample) if isinstance(per_sample, (int, float)) else None))

    def record(self, r: int, times: Mapping[str, float], splits: Mapping[str, int]) -> None:
        """Measured round times of this round's agents go into the table (S2FL updates it every round)."""
        if self.cfg.strategy != "s2fl":
            return
        for a, t in times.items():
            if splits.get(a) in self.candidates:
                self.time_table.record(a, splits[a], t, r)
