"""Split federated learning at one fixed cut (SplitFed, Thapa et al., 2022).

``server_mode`` says how the server trains on the agents' activations: ``per_agent`` (SplitFed
v1: one server copy per agent, averaged), ``merged`` (one copy on the concatenated batch, as
MergeSFL's feature merging) or ``sequential`` (SplitFed v2: one copy updated agent after agent).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from sfl_core.fleet import AgentInfo
from sfl_core.methods.base import Method, RoundPlan, split_plan


class SFL(Method):
    @property
    def split(self) -> int:
        return self.cfg.split or self.model.default_split

    @property
    def configured_splits(self) -> tuple[int, ...]:
        return (self.split,)

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        return split_plan(self.cfg, {a: self.split for a in selected}, "fixed")
