"""FedAvg (McMahan et al., 2017): every agent trains the whole model; only weights travel."""

from __future__ import annotations

from typing import Mapping, Sequence

from sfl_core.fleet import AgentInfo
from sfl_core.methods.base import Method, RoundPlan


class FedAvg(Method):
    TRAINS_WHOLE_MODEL = True

    def splits_to_time(self) -> list[int]:
        return [self.model.num_blocks]

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        return RoundPlan({a: self.model.num_blocks for a in selected}, [list(selected)], "fedavg")
