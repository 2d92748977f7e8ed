"""A server optimiser as a training option (``server_opt: {kind: momentum | adam | yogi}``): the
round's average becomes the new global model through
:class:`~sfl_core.options.server_opt.optimiser.ServerOptimizer`. Averaged parameters step;
buffers stay averaged. Nothing more crosses the wire; its moments are checkpointed."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Mapping

import torch

from sfl_core.options.base import Recommendation, RoundContext, RoundOption
from sfl_core.options.server_opt.config import ServerOptConfig
from sfl_core.options.server_opt.optimiser import STATE_PREFIX, ServerOptimizer, averaged_names

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.evidence import Evidence
    from sfl_core.model.zoo import SplitModel

__all__ = ["ServerOpt"]


class ServerOpt(RoundOption):
    SECTION: ClassVar[type[ServerOptConfig]] = ServerOptConfig
    STATE_PREFIX = STATE_PREFIX

    @classmethod
    def recommend(cls, cfg: "RunConfig", evidence: "Evidence", on: bool) -> Recommendation:
        """Server momentum (FedAvgM, beta 0.5) wherever a round trains a sample of the fleet: each
        round's average follows the devices it happened to take (their classes where labels are
        skewed, their batches' noise where they are not), and momentum keeps the direction the
        rounds share. Nothing more crosses the wire. Where every device trains every round the
        rounds do not differ by their sample, and plain averaging stays."""
        if evidence.partial:
            why = ("label-skewed devices" if evidence.strongly_skewed else
                   f"devices (mean KL {evidence.label_skew:.2f} nats to the fleet's mix)")
            return Recommendation({"kind": "momentum", "lr": 1.0, "beta1": 0.5},
                                  f"{evidence.per_round} of {evidence.agents} {why} a round: server momentum "
                                  f"(FedAvgM) evens out the directions of the rounds' samples")
        return Recommendation(None, "every device trains every round: plain averaging")

    def __init__(self, cfg: "RunConfig", model: "SplitModel"):
        super().__init__(cfg, model)
        so = self.section
        self.optimiser = ServerOptimizer(so.kind, so.lr, so.beta1, so.beta2, so.tau)

    def transform_average(self, ctx: RoundContext, start: Mapping[str, torch.Tensor],
                          average: dict[str, torch.Tensor], clients: Mapping[str, Mapping[str, torch.Tensor]],
                          servers: Mapping[str, Mapping[str, torch.Tensor]],
                          copy_of: Mapping[str, int]) -> dict[str, torch.Tensor]:
        return self.optimiser.step(start, average, averaged_names(clients, servers, copy_of, ctx.parameter_names))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.optimiser.state_tensors()

    def load_state(self, tensors: Mapping[str, torch.Tensor], last_round: int, model: "SplitModel") -> None:
        self.optimiser.load_state_tensors(tensors)
