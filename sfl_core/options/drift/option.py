"""Drift correction as a training option (``drift: fedprox | scaffold``): the engine's and the
device's sides of :mod:`sfl_core.options.drift.variates`.

On the wire an assignment carries FedProx's ``prox_mu`` or SCAFFOLD's ``correction`` (``c − cᵢ``
for the client portion's parameters). The server's copies are corrected too where the round
trains one copy per agent and averages them (SplitFed v1); a copy trained on the merged rows
of several agents needs none. Cost: SCAFFOLD's correction is one more client portion down per
round, and either term one more copy held while training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch

from sfl_core.options.base import (
    AssignField,
    DeviceOption,
    Recommendation,
    RoundContext,
    RoundOption,
    ServerTerms,
    in_range,
)
from sfl_core.options.drift.config import DriftConfig
from sfl_core.options.drift.variates import STATE_PREFIX, ControlVariates
from sfl_core.wire import codec as wire

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.evidence import Evidence
    from sfl_core.methods.base import RoundPlan
    from sfl_core.model.zoo import SplitModel
    from sfl_core.wire.assignment import Assignment

__all__ = ["Drift"]

MAX_MU = 100.0


def copies_per_agent(plan: "RoundPlan", split_agents: Sequence[str]) -> bool:
    """Whether the round trains a server copy for each agent, several of them, which
    aggregation averages like client portions (SplitFed v1)."""
    copies = [[a for a in g if a in split_agents] for g in plan.groups]
    copies = [c for c in copies if c]
    return len(copies) > 1 and all(len(c) == 1 for c in copies)


class Drift(RoundOption):
    SECTION: ClassVar[type[DriftConfig]] = DriftConfig
    ASSIGN_FIELDS: ClassVar[Mapping[str, AssignField]] = {
        "prox_mu": AssignField((int, float), in_range(0.0, MAX_MU)),   # FedProx's μ
        "correction": AssignField(dict),                                 # SCAFFOLD's c − cᵢ (encoded state)
    }
    RUN_INFO = ("drift",)
    STATE_PREFIX = STATE_PREFIX

    @classmethod
    def recommend(cls, cfg: "RunConfig", evidence: "Evidence", on: bool) -> Recommendation:
        """SCAFFOLD where the devices' label mixes differ: each one's local steps pull its portion
        towards its own classes, and the control variates take that pull out (its cost, one more
        client portion down per round, is priced by the time model)."""
        if evidence.strongly_skewed:
            return Recommendation({"kind": "scaffold"}, f"label-skewed devices (mean KL {evidence.label_skew:.2f} "
                                                        f"nats to the fleet's mix): SCAFFOLD corrects their drift")
        return Recommendation(None, f"devices' label mixes close enough (mean KL {evidence.label_skew:.2f} nats, "
                                    f"under 0.75): SCAFFOLD would cost more than it corrects")

    @classmethod
    def run_info(cls, cfg: "RunConfig") -> dict[str, Any]:
        # an agent that ignores the correction would drift unnoticed: it must refuse the run
        return {"drift": {"kind": cls.settings(cfg).kind}}

    @classmethod
    def portions_down(cls, cfg: "RunConfig") -> int:
        return 1 if cls.settings(cfg).kind == "scaffold" else 0

    @classmethod
    def portions_held(cls, cfg: "RunConfig") -> int:
        return 1 if cls.settings(cfg).on else 0

    def __init__(self, cfg: "RunConfig", model: "SplitModel"):
        super().__init__(cfg, model)
        self.variates: Optional[ControlVariates] = ControlVariates() if self.section.kind == "scaffold" else None

    def server_terms(self, ctx: RoundContext, r: int, plan: "RoundPlan", split_agents: Sequence[str],
                     assignments: Mapping[str, "Assignment"], terms: ServerTerms) -> None:
        if not copies_per_agent(plan, split_agents):
            return
        if self.section.kind == "fedprox":
            terms.proximal = self.section.mu
        if self.variates is not None:
            terms.corrections.update({a: self.variates.correction(a, ctx.server_params(assignments[a].split,
                                                                                       assignments[a].width))
                                      for a in split_agents})

    def assign_fields(self, ctx: RoundContext, r: int, agent: str, split: int, width: int) -> dict[str, Any]:
        if self.section.kind == "fedprox":
            return {"prox_mu": self.section.mu}
        assert self.variates is not None
        held = {k: v for k, v in ctx.client_state(split, width).items() if k in ctx.parameter_names}
        return {"correction": wire.encode_state(self.variates.correction(agent, held), self.cfg.zstd_level)}

    def observe_updates(self, ctx: RoundContext, start: Mapping[str, torch.Tensor],
                        clients: Mapping[str, Mapping[str, torch.Tensor]],
                        servers: Mapping[str, Mapping[str, torch.Tensor]],
                        assignments: Mapping[str, "Assignment"], terms: ServerTerms,
                        server_steps: Callable[[str], tuple[float, int, float]]) -> None:
        if self.variates is None or not clients:
            return
        names = ctx.parameter_names
        fleet, full = len(ctx.fleet), ctx.model.state_dict()
        self.variates.update(start, {a: {k: v for k, v in st.items() if k in names} for a, st in clients.items()},
                             {a: (assignments[a].lr, assignments[a].tau, assignments[a].momentum) for a in clients},
                             fleet_size=fleet, full=full)
        corrected = [a for a in clients if a in terms.corrections]
        if corrected:   # each agent's server copy stepped with its c − cᵢ: its cᵢ learns from it
            self.variates.update(start, {a: {k: v for k, v in servers[a].items() if k in names} for a in corrected},
                                 {a: server_steps(a) for a in corrected}, fleet_size=fleet,
                                 full=ctx.model.state_dict(), stepped_with={a: terms.corrections[a]
                                                                             for a in corrected})

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.variates.state_tensors() if self.variates is not None else {}

    def load_state(self, tensors: Mapping[str, torch.Tensor], last_round: int, model: "SplitModel") -> None:
        if self.variates is not None:
            self.variates.load_state_tensors(tensors)

    @classmethod
    def device(cls) -> DeviceOption:
        return DriftOnDevice()


class DriftOnDevice(DeviceOption):
    """Every local step adds FedProx's ``μ (w − x)`` (``x``: the weights just received) or
    SCAFFOLD's ``c − cᵢ``, which arrives whole."""

    def on_assign(self, fields: Mapping[str, Any], model: "SplitModel", split: int, client: torch.nn.Module,
                  weights: Mapping[str, torch.Tensor]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        if "correction" not in fields:
            return []
        keys = set(model.client_keys(split))
        params = {n: p for n, p in model.named_parameters() if n in keys}
        c = wire.decode_state(fields["correction"], {n: p.detach().cpu() for n, p in params.items()})
        return [(p, c[n].to(p.device)) for n, p in params.items() if n in c]

    def proximal(self, fields: Mapping[str, Any]) -> float:
        return float(fields.get("prox_mu", 0.0))
