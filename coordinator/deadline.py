"""A deployed round's deadline and each agent's busy limit, from the time model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

from sfl_core import timing

if TYPE_CHECKING:
    from coordinator.session import RoundAgent
    from sfl_core.config.run import RunConfig
    from sfl_core.fleet import AgentInfo
    from sfl_core.model.accounting import SplitCost

__all__ = ["round_deadline"]


def round_deadline(cfg: "RunConfig", costs: Mapping[int, "SplitCost"], infos: Mapping[str, "AgentInfo"],
                   agents: Mapping[str, "RoundAgent"], split_agents: int, *, now: float) -> Optional[float]:
    """When a deployed round's training must be over: ``round_deadline`` times the time model's
    prediction for its slowest agent (from what each measured, at the fp32 wire size: an upper
    bound), never under ``round_deadline_min_s``; None without one. Sets each agent's
    ``busy_limit_s``: an agent predicted to compute long between messages may stay busy as long.
    (A simulation's clock is the time model itself, so it has no deadline.)"""
    if not cfg.round_deadline or not agents:
        return None
    try:
        times = {a: timing.price_option(cfg, costs[ra.assignment.split], ra.assignment.codec, infos[a], ratio=1.0,
                                        width=ra.assignment.width, split_agents=split_agents).time(ra.assignment.batch_size)
                 for a, ra in agents.items()}
    except (KeyError, ValueError, ZeroDivisionError):
        return None
    for a, t in times.items():
        agents[a].busy_limit_s = max(cfg.busy_timeout_s, cfg.round_deadline * t)
    return now + max(cfg.round_deadline_min_s, cfg.round_deadline * max(times.values()))
