"""S2FL (Yan et al., 2023): a sliding split per agent and data-balance groups on the server.

``s2fl.sliding``: after a warm-up round per candidate split (every device times each), the
median rule moves slow agents to shallower splits from the time table. ``s2fl.balance``:
the server trains groups whose merged label mix is close to uniform. Without ``sliding``
every agent trains at the largest candidate (the S2FL paper's SFL baseline).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional, Sequence

from sfl_core.config.run import RunConfig
from sfl_core.fleet import AgentInfo
from sfl_core.methods.base import Method, RoundPlan
from sfl_core.methods.s2fl.config import S2flConfig
from sfl_core.methods.s2fl.grouping import group_by_balance
from sfl_core.methods.s2fl.sliding_split import median_rule, warmup_split
from sfl_core.model.accounting import SplitCost
from sfl_core.model.zoo import SplitModel, candidate_splits
from sfl_core.timing import price_option


class S2FL(Method):
    @classmethod
    def preview_variants(cls, base: RunConfig, model: SplitModel,
                         costs: Mapping[int, SplitCost]) -> dict[str, RunConfig]:
        try:
            candidate_splits(base.model)
        except ValueError:      # a model without candidate cuts: nothing to slide over
            return {}
        return {"S2FL": replace(base, strategy="s2fl")}

    @classmethod
    def one_split_conflict(cls, cfg: RunConfig) -> Optional[str]:
        if S2flConfig.of(cfg).sliding:
            return ("a bottleneck needs one fixed split point, and s2fl's sliding split moves it "
                    "(set s2fl.sliding false, or use strategy sfl)")
        return None

    def __init__(self, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]):
        super().__init__(cfg, model, costs)
        cands = S2flConfig.of(cfg).candidates or candidate_splits(cfg.model)
        for s in cands:
            model.check_split(s)
        self._candidates: tuple[int, ...] = tuple(cands)

    @property
    def candidates(self) -> tuple[int, ...]:
        return self._candidates

    def notes(self, pool: int) -> list[str]:
        k, per_round = len(self.candidates), self.cfg.per_round
        if S2flConfig.of(self.cfg).sliding and per_round and per_round < pool:
            return [f"s2fl: warm-up rounds 1-{k} train every registered agent ({pool}), not per_round "
                    f"({per_round}), so the time table has each agent at each candidate split; about "
                    f"{pool / per_round:.1f}x a round's bytes in those {k} rounds"]
        return []

    def selects_everyone(self, r: int) -> bool:
        """The warm-up sends each candidate split to every device (not only the round's
        selection), so the time table holds a measurement for every agent and split."""
        return S2flConfig.of(self.cfg).sliding and warmup_split(r, self.candidates) is not None

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        s2 = S2flConfig.of(self.cfg)
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

    def fill_estimates(self, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> None:
        """Time-model estimates (docs/methods/time-model.md) for (agent, split) pairs never measured, from profile and measurements."""
        for a in selected:
            info = agents[a]
            for s in self.candidates:
                entry = self.time_table.get(a, s)
                if entry is not None and not entry.estimated:
                    continue
                ratio = self.wire_ratio.get(f"{s}/{self.cfg.codec}", 1.0)
                option = price_option(self.cfg, self.costs[s], self.cfg.codec, info, ratio=ratio)
                self.time_table.set_estimate(a, s, option.time(self.cfg.batch_size))

    def record(self, r: int, times: Mapping[str, float], splits: Mapping[str, int],
               round_s: float | None = None) -> None:
        """Measured round times of this round's agents go into the table (updated every round)."""
        for a, t in times.items():
            if splits.get(a) in self.candidates:
                self.time_table.record(a, splits[a], t, r)
