"""Split federated learning at one fixed cut (SplitFed, Thapa et al., 2022), or at a cut per
device profile (FedFC, Chung et al., 2023: ``profile_splits``).

``server_mode`` says how the server trains on the agents' activations: ``per_agent`` (SplitFed
v1: one server copy per agent, averaged), ``merged`` (one copy on the concatenated batch, as
MergeSFL's feature merging) or ``sequential`` (SplitFed v2: one copy updated agent after agent).

FedFC's mixed cuts: each profile trains at its own split; the server concatenates the features
where they meet (the engine's merged step joins each agent's rows at its split). With
``server_weight: once`` a group's server copy counts once in the layer-wise average (the
paper's Alg. 3).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional, Sequence

from sfl_core.config.run import RunConfig, load_profile
from sfl_core.fleet import AgentInfo
from sfl_core.methods.base import Method, RoundPlan, split_plan, resolved_split
from sfl_core.model.accounting import SplitCost
from sfl_core.model.zoo import SplitModel
from sfl_core.timing import fleet_round_time


class SFL(Method):
    @classmethod
    def preview_variants(cls, base: RunConfig, model: SplitModel,
                         costs: Mapping[int, SplitCost]) -> dict[str, RunConfig]:
        """SFL at the run's split; FedFC with each device class at its fastest cut for this fleet."""
        samples = base.batch_size * base.local_iters
        cuts = [s for s in sorted(costs) if s < model.num_blocks]
        profiles = {p: load_profile(p) for p in dict.fromkeys(base.agent_profiles())}
        fastest = {prof.name: min(cuts, key=lambda s: fleet_round_time(costs[s], [prof], samples=samples,
                                                                       server_flops_per_s=base.server_flops))
                   for prof in profiles.values()}
        return {"SFL": replace(base, strategy="sfl"), "FedFC": replace(base, strategy="sfl", profile_splits=fastest)}

    @classmethod
    def for_run(cls, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> Method:
        return (FedFC if cfg.profile_splits else SFL)(cfg, model, costs)

    @classmethod
    def one_split_conflict(cls, cfg: RunConfig) -> Optional[str]:
        return None     # profile_splits with a bottleneck is refused by the run config itself

    @property
    def split(self) -> int:
        return resolved_split(self.cfg, self.model)

    @property
    def configured_splits(self) -> tuple[int, ...]:
        return (self.split,)

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        return split_plan(self.cfg, {a: self.split for a in selected}, "fixed")


class FedFC(SFL):
    @property
    def configured_splits(self) -> tuple[int, ...]:
        return tuple(sorted({self.split, *(self.cfg.profile_splits or {}).values()}))

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        by_profile = self.cfg.profile_splits or {}
        return split_plan(self.cfg, {a: by_profile.get(agents[a].profile.name, self.split) for a in selected},
                          "per profile")
