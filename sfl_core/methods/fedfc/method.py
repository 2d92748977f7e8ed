"""FedFC, *Federated Feature Concatenate Method for Heterogeneous Computing in Federated
Learning* (Chung et al., 2023): each device profile trains at its own cut, and the server
concatenates the features where they meet (the engine's merged step joins each agent's rows
at its split).

A layer over ``strategy: sfl``: the agents of a profile named in ``fedfc.profile_splits`` move
to that cut, the others keep the run's ``split``. With ``fedfc.server_weight: once`` a group's
server copy counts once in the layer-wise average (the paper's Alg. 3), not once per member.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional, Sequence

from sfl_core.config.run import RunConfig, load_profile
from sfl_core.fleet import AgentInfo
from sfl_core.methods.base import Layer, RoundPlan
from sfl_core.methods.fedfc.config import FedFcConfig
from sfl_core.model.accounting import SplitCost
from sfl_core.model.zoo import SplitModel
from sfl_core.timing import fleet_round_time


class FedFC(Layer):
    @staticmethod
    def wanted(cfg: RunConfig) -> bool:
        return FedFcConfig.of(cfg).profile_splits is not None

    @classmethod
    def one_split_conflict(cls, cfg: RunConfig) -> Optional[str]:
        if FedFcConfig.of(cfg).profile_splits is None:
            return None
        return "a bottleneck needs one split point for every agent; fedfc.profile_splits mixes cut layers"

    @classmethod
    def preview_variants(cls, base: RunConfig, model: SplitModel,
                         costs: Mapping[int, SplitCost]) -> dict[str, RunConfig]:
        """Each device class at its fastest cut for this fleet."""
        cuts = [s for s in sorted(costs) if s < model.num_blocks]
        profiles = {p: load_profile(p) for p in dict.fromkeys(base.agent_profiles())}
        fastest = {prof.name: min(cuts, key=lambda s: fleet_round_time(base, costs[s], [prof]))
                   for prof in profiles.values()}
        return {"FedFC": FedFcConfig.of(base).replace_in(replace(base, strategy="sfl"), profile_splits=fastest)}

    @property
    def configured_splits(self) -> tuple[int, ...]:
        return tuple(sorted({*self.inner.configured_splits,
                             *(FedFcConfig.of(self.cfg).profile_splits or {}).values()}))

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        plan = self.inner.plan(r, selected, agents)
        fedfc = FedFcConfig.of(self.cfg)
        by_profile = fedfc.profile_splits or {}
        splits = {a: by_profile.get(agents[a].profile.name, s) for a, s in plan.splits.items()}
        return replace(plan, splits=splits, phase="per profile", server_once=fedfc.server_weight == "once")
