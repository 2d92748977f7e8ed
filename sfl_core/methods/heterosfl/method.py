"""HeteroSFL (Chen et al., IEEE IoT Journal 2025; ICLR 2024 submission): per-group bottleneck widths and codecs by link rate.

A layer over any split method: the round's agents are grouped by uplink rate (quantiles or
``hetero.thresholds``) and each group gets its bottleneck width (``hetero.widths``, or widths
proportional to the groups' rates) and/or wire codec (``hetero.codecs``). HetBL aggregation,
logit calibration and BDKS act in the server trainer and the aggregation (docs/methods/heterosfl.md).
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from typing import Mapping, Sequence

from sfl_core.config.run import RunConfig
from sfl_core.fleet import AgentInfo, uplink_rate
from sfl_core.losses import LossSpec
from sfl_core.methods.base import Layer, RoundPlan, resolved_split
from sfl_core.methods.heterosfl.bdks import Bdks
from sfl_core.methods.heterosfl.config import HeteroConfig
from sfl_core.methods.heterosfl.groups import group_by_link_rate, widths_for_groups
from sfl_core.model.accounting import SplitCost
from sfl_core.model.zoo import SplitModel


class HeteroSFL(Layer):
    @classmethod
    def prepare_model(cls, cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> None:
        """The bottleneck at the run's split, ``hetero.width`` wide. With fixed per-group widths
        nobody trains the channels past the widest, so the full model is evaluated without them."""
        h = HeteroConfig.of(cfg)
        if h.width is not None:
            pair = model.add_bottleneck(resolved_split(cfg, model), h.width)
            pair.infer_width = max(h.widths) if h.widths else h.width

    def server_loss(self) -> LossSpec:
        """The run's loss, with BDKS's distillation terms where ``hetero.bdks`` asks for them."""
        h = HeteroConfig.of(self.cfg)
        return LossSpec(term=Bdks(h.bdks_alpha, h.bdks_theta) if h.bdks else None)

    @classmethod
    def preview_variants(cls, base: RunConfig, model: SplitModel,
                         costs: Mapping[int, SplitCost]) -> dict[str, RunConfig]:
        """Two link-rate groups at the run's split, the full width being the cut's channels."""
        split = resolved_split(base, model)
        channels = costs[split].activation_shape[0] if costs[split].activation_shape else 0
        if channels <= 1:
            return {}
        return {"HeteroSFL": HeteroConfig.of(base).replace_in(replace(base, strategy="sfl", split=split),
                                                               width=channels, groups=2)}

    @staticmethod
    def wanted(cfg: RunConfig) -> bool:
        return HeteroConfig.of(cfg).width is not None or HeteroConfig.of(cfg).codecs is not None

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> RoundPlan:
        plan = self.inner.plan(r, selected, agents)
        h = HeteroConfig.of(self.cfg)
        groups, indices = self.link_groups(selected, agents)
        if h.width is not None:
            plan = replace(plan, widths=self.widths(groups, indices, agents))
        if h.codecs is not None:
            plan = replace(plan, codecs={a: h.codecs[i] for g, i in zip(groups, indices) for a in g})
        return plan

    def link_groups(self, selected: Sequence[str], agents: Mapping[str, AgentInfo]) -> tuple[list[list[str]], list[int]]:
        """The round's agents by uplink rate, slowest group first, with each group's index into
        the configured per-group lists (empty groups are dropped, so indices can skip)."""
        h = HeteroConfig.of(self.cfg)
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
        h = HeteroConfig.of(self.cfg)
        assert h.width is not None
        group_rates = [min(uplink_rate(agents[a]) for a in g) for g in groups]
        fixed = [h.widths[i] for i in indices] if h.widths else None
        widths = widths_for_groups(group_rates, h.width, fixed=fixed)
        return {a: w for g, w in zip(groups, widths) for a in g}
