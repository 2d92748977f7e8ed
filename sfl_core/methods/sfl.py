"""Split federated learning at one fixed cut (SplitFed, Thapa et al., 2022); FedFC's cut per
device profile is a layer over it (:mod:`sfl_core.methods.fedfc`).

``server_mode`` says how the server trains on the agents' activations: ``per_agent`` (SplitFed
v1: one server copy per agent, averaged), ``merged`` (one copy on the concatenated batch, as
MergeSFL's feature merging) or ``sequential`` (SplitFed v2: one copy updated agent after agent).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional, Sequence

from sfl_core.config.run import RunConfig
from sfl_core.fleet import AgentInfo
from sfl_core.methods.base import Method, RoundPlan, split_plan, resolved_split
from sfl_core.model.accounting import SplitCost
from sfl_core.model.zoo import SplitModel


class SFL(Method):
    @classmethod
    def preview_variants(cls, base: RunConfig, model: SplitModel,
                         costs: Mapping[int, SplitCost]) -> dict[str, RunConfig]:
        """SFL at the run's split."""
        return {"SFL": replace(base, strategy="sfl")}

    @classmethod
    def one_split_conflict(cls, cfg: RunConfig) -> Optional[str]:
        return None

    @property
    def split(self) -> int:
        return resolved_split(self.cfg, self.model)

    @property
    def configured_splits(self) -> tuple[int, ...]:
        return (self.split,)

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        return split_plan(self.cfg, {a: self.split for a in selected}, "fixed")

