"""FedFC (Tsai et al., 2023): mixed cut layers by device class (``profile_splits``).

Each profile trains at its own split; the server concatenates the features where they meet
(the engine's merged step joins each agent's rows at its split). With ``server_weight: once``
a group's server copy counts once in the layer-wise average (the paper's Alg. 3).
"""

from __future__ import annotations

from typing import Mapping, Sequence, Union

from sfl_core.model.accounting import SplitCost
from sfl_core.config.run import RunConfig
from sfl_core.fleet import AgentInfo
from sfl_core.methods.base import RoundPlan, split_plan
from sfl_core.methods.sfl import SFL
from sfl_core.model.zoo import SplitModel


class FedFC(SFL):
    @property
    def configured_splits(self) -> tuple[int, ...]:
        return tuple(sorted({self.split, *(self.cfg.profile_splits or {}).values()}))

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        by_profile = self.cfg.profile_splits or {}
        return split_plan(self.cfg, {a: by_profile.get(agents[a].profile.name, self.split) for a in selected},
                          "per profile")


def split_learning(cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> Union[SFL, FedFC]:
    """``strategy: sfl``: one cut for everybody, or FedFC's cut per profile where ``profile_splits`` is set."""
    return (FedFC if cfg.profile_splits else SFL)(cfg, model, costs)
