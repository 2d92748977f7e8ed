"""The widths the global model runs its bottlenecks at between rounds (HeteroSFL's pairs, auto's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from sfl_core.model.bottleneck import covered_width

if TYPE_CHECKING:
    from sfl_core.fleet import AgentInfo
    from sfl_core.methods.base import RoundPlan
    from sfl_core.model.zoo import SplitModel

__all__ = ["widen_bottlenecks"]


def widen_bottlenecks(model: "SplitModel", plan: "RoundPlan", latest_width: dict[str, int],
                      infos: Mapping[str, "AgentInfo"]) -> None:
    """The width the full model runs each bottleneck at (evaluation, export, and the rows of
    agents cut before the pair): the widest whose channels were trained on every class
    (:func:`sfl_core.model.bottleneck.covered_width`, from each agent's latest width there).
    Channels nobody trained are never used (auto may give every agent a narrow width;
    HeteroSFL starts at its widest), nor channels only a group blind to some classes trained.
    Rows cut before the pair pass it at that width too, so every row reaches the server's
    later layers through the same channels (tried: giving them the full width stalled
    training in the test fleet, the later layers then see two different distributions)."""
    if not model.bottlenecks:
        return
    for a, w in plan.widths.items():
        if w and model.bottleneck(plan.splits[a]) is not None:
            latest_width[f"{plan.splits[a]}/{a}"] = w
    population = [sum(c) for c in zip(*(i.label_counts for i in infos.values() if i.label_counts))]
    for s, pair in model.bottlenecks.items():
        latest = {k.split("/", 1)[1]: w for k, w in latest_width.items() if k.split("/", 1)[0] == s}
        if latest:
            counts = {a: infos[a].label_counts if a in infos else []
                      for a in latest}
            pair.infer_width = min(int(pair.width), covered_width(latest, counts, population))  # type: ignore[arg-type, assignment]
