"""The delivered model average as a training option (``model_ema: DECAY``): after each round
(its aggregation and phases) the global model is folded into
:class:`~sfl_core.options.model_ema.average.ModelAverage`, and the average is what the run
delivers. Training goes on from the global model; nothing crosses the wire."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Mapping, Optional

import torch

from sfl_core.options.base import RoundContext, RoundOption
from sfl_core.options.model_ema.average import STATE_PREFIX, ModelAverage, delivered_weights
from sfl_core.options.model_ema.config import ModelEmaConfig

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.model.zoo import SplitModel

__all__ = ["ModelEma"]


class ModelEma(RoundOption):
    SECTION: ClassVar[type[ModelEmaConfig]] = ModelEmaConfig
    STATE_PREFIX = STATE_PREFIX

    @classmethod
    def wanted(cls, cfg: "RunConfig") -> bool:
        return bool(cls.settings(cfg).on)

    def __init__(self, cfg: "RunConfig", model: "SplitModel"):
        super().__init__(cfg, model)
        self.average = ModelAverage(self.section.decay)

    def after_round(self, ctx: RoundContext, r: int) -> None:
        self.average.update(ctx.model.state_dict())

    def delivered(self, model: "SplitModel") -> Optional[dict[str, torch.Tensor]]:
        return self.average.state(model.state_dict()) if self.average.tensors else None

    @classmethod
    def delivered_from_checkpoint(cls, model: Mapping[str, torch.Tensor],
                                  own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return delivered_weights(model, own)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.average.state_tensors()

    def load_state(self, tensors: Mapping[str, torch.Tensor], last_round: int, model: "SplitModel") -> None:
        self.average.load_state_tensors(tensors)
