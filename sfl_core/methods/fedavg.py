"""FedAvg (McMahan et al., 2017): every agent trains the whole model; only weights travel."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from sfl_core.config.run import RunConfig
from sfl_core.fleet import AgentInfo
from sfl_core.methods.base import Method, RoundPlan
from sfl_core.model.accounting import SplitCost
from sfl_core.model.zoo import SplitModel


class FedAvg(Method):
    TRAINS_WHOLE_MODEL = True

    @classmethod
    def preview_variants(cls, base: RunConfig, model: SplitModel,
                         costs: Mapping[int, SplitCost]) -> dict[str, RunConfig]:
        return {"FedAvg": replace(base, strategy="fedavg")}

    def splits_to_time(self) -> list[int]:
        return [self.model.num_blocks]

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        return RoundPlan({a: self.model.num_blocks for a in selected}, [list(selected)], "fedavg")
