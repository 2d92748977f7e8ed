"""What each method would do with a fleet before any training: ``sfl-coord plan``.

For a run config, every registered method is built from the same config with its own switches
(:meth:`~sfl_core.methods.base.Method.preview_variants`), asked for its round plan exactly as the engine
asks it (``select`` then ``plan``), and each agent's assignment is priced by the time model
(:func:`sfl_core.timing.price_option`, the function auto plans with, which the virtual
clock charges). The result: per method the predicted round time, bytes moved per round and
mean waiting time, and per agent its split, codec, width and batch. Nothing is measured yet,
so the numbers are the profiles' (registration measurements refine them in a run).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from sfl_core import option_registry, timing
from sfl_core.config.run import RunConfig
from sfl_core.fleet import AgentInfo
from sfl_core.method_registry import method_classes
from sfl_core.methods import build_method
from sfl_core.model.accounting import SplitCost
from sfl_core.model.zoo import SplitModel
from sfl_core.timing import price_option
from sfl_core.wire.codec import nominal_ratio


@dataclass(frozen=True)
class PlannedAgent:
    split: int
    codec: str
    batch: int
    width: int
    time_s: float
    bytes: float
    window: int = 1
    """Steps in flight (1: lock-step)."""


@dataclass(frozen=True)
class MethodPreview:
    method: str
    round_s: float
    bytes_per_round: float
    waiting_s: float
    agents: dict[str, PlannedAgent]
    phase: str = ""
    strategy: str = ""
    """The ``strategy:`` of the run config this row was planned from."""
    phase_s: float = 0.0
    """Of ``round_s``, the phases after aggregation that training options add (a statistics pass),
    spread over the rounds that have one."""

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "round_s": self.round_s, "bytes_per_round": self.bytes_per_round,
                "waiting_s": self.waiting_s, "phase": self.phase, "phase_s": self.phase_s,
                "agents": {a: dataclasses.asdict(x) for a, x in self.agents.items()}}


def variants(cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost]) -> dict[str, RunConfig]:
    """Each method on this config: the user's settings with every method's own switches off
    (``MethodSection.neutral``), then each registered method's runs of that common ground
    (``Method.preview_variants``)."""
    base = dataclasses.replace(cfg, server_mode="merged",
                               sections={key: s.neutral() for key, s in cfg.sections.items()})
    out: dict[str, RunConfig] = {}
    for method in method_classes():
        out.update(getattr(method, "preview_variants", lambda *_: {})(base, model, costs))
    return out


DRAWS = 8
"""Rounds each method's row is averaged over: a method that samples ``per_round`` agents
uniformly is priced over several of its own draws, not over one arbitrary subset."""


def preview(cfg: RunConfig, model: SplitModel, costs: Mapping[int, SplitCost],
            agents: Mapping[str, AgentInfo]) -> list[MethodPreview]:
    """Every method's planned rounds on ``agents`` (after S2FL's warm-up: its steady state),
    each drawn as the engine draws it (the method's ``uniform_sample``, then its ``select``
    and ``plan``) and priced by the time model; a row is the mean over :data:`DRAWS` rounds
    and its agents are the first round's."""
    ids = sorted(agents)
    out = []
    for name, variant in variants(cfg, model, costs).items():
        method = build_method(variant, model, costs)
        first = len(method.candidates) + 1
        variant, _ = method.learning(first, agents, [])   # with the training options it decides (auto)
        method.use_config(variant)
        rounds = [_planned_round(variant, method, costs, agents, ids, r) for r in range(first, first + DRAWS)]
        n = len(rounds)
        out.append(MethodPreview(name, sum(x[0] for x in rounds) / n, sum(x[1] for x in rounds) / n,
                                 sum(x[2] for x in rounds) / n, rounds[0][3], rounds[0][4], variant.strategy,
                                 sum(x[5] for x in rounds) / n))
    return out


def _planned_round(variant: RunConfig, method: Any, costs: Mapping[int, SplitCost], agents: Mapping[str, AgentInfo],
                   ids: list[str], r: int) -> tuple[float, float, float, dict[str, PlannedAgent], str, float]:
    """Round ``r`` of ``method`` as the engine would plan it: (round s, bytes, waiting s, agents,
    phase, of which the statistics pass's s)."""
    selected, batches = method.select(r, ids, agents, method.uniform_sample(r, ids))
    plan = method.plan(r, selected, agents)
    rows = {}
    for a in selected:
        split = plan.splits[a]
        cost = costs[split]
        codec = plan.codecs.get(a, variant.codec)
        width = plan.widths.get(a, 0)
        batch = batches.get(a) or variant.batch_size
        opt = price_option(variant, cost, codec, agents[a], ratio=nominal_ratio(codec), width=width,
                           split_agents=len(selected), window=plan.windows.get(a))
        ratio = timing.cut_wire_fraction(cost, codec, width)
        # weights up, and down with what the options add (a correction)
        portions = 2 + sum(o.portions_down(variant) for o in option_registry.wanted(variant))
        traffic = portions * cost.client_param_bytes + 2 * variant.local_iters * batch * cost.activation_bytes * ratio
        rows[a] = PlannedAgent(split, codec, batch, width, opt.time(batch), traffic, opt.window)
    times = [x.time_s for x in rows.values()]
    pass_s, pass_bytes = _phases(variant, costs, agents, rows)
    return (timing.round_time(times) + pass_s, sum(x.bytes for x in rows.values()) + pass_bytes,
            timing.waiting_time(times), rows, plan.phase, pass_s)

def _phases(cfg: RunConfig, costs: Mapping[int, SplitCost], agents: Mapping[str, AgentInfo],
            rows: Mapping[str, PlannedAgent]) -> tuple[float, float]:
    """The phases after aggregation the run's training options add (a statistics pass), per
    round: seconds and bytes (:meth:`~sfl_core.options.base.RoundOption.phase_cost`)."""
    plans = {a: (x.split, x.codec, x.width) for a, x in rows.items()}
    priced = [o.phase_cost(cfg, costs, agents, plans) for o in option_registry.wanted(cfg)]
    return sum(t for t, _ in priced), sum(b for _, b in priced)
