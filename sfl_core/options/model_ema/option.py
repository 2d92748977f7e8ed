"""The delivered model average as a training option (``model_ema: DECAY``): after each round
(its aggregation and phases) the global model is folded into
:class:`~sfl_core.options.model_ema.average.ModelAverage`, and the average is what the run
delivers. Training goes on from the global model; nothing crosses the wire."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Mapping, Optional

import torch

from sfl_core.evidence import above_chance, climb, swing
from sfl_core.options.base import Recommendation, RoundContext, RoundOption
from sfl_core.options.model_ema.average import STATE_PREFIX, ModelAverage, delivered_weights
from sfl_core.options.model_ema.config import ModelEmaConfig

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.evidence import Evidence
    from sfl_core.model.zoo import SplitModel

__all__ = ["ModelEma"]


class ModelEma(RoundOption):
    SECTION: ClassVar[type[ModelEmaConfig]] = ModelEmaConfig
    STATE_PREFIX = STATE_PREFIX

    SWINGS = 0.02
    """How far the validation accuracy falls back a round, on average over the last 5 scored
    rounds (:func:`sfl_core.evidence.swing`), that switches the average on."""

    @classmethod
    def recommend(cls, cfg: "RunConfig", evidence: "Evidence", on: bool) -> Recommendation:
        """The average (decay 0.8) once the global model swings from round to round: the scored
        accuracy falls back by :attr:`SWINGS` a round on average; or, where a round trains a
        sample of the fleet, once the accuracy has stopped climbing (it falls back as much as it
        gains over the last 5 scored rounds, all clearly above chance:
        :func:`~sfl_core.evidence.climb`, :func:`~sfl_core.evidence.above_chance`): from there
        each round's sample only moves the model around where it has got to, and the average sits
        in the middle. Not from the label skew alone, nor earlier: on a run still climbing, or
        stuck at chance before it climbs, the average of the last rounds lags the last one (it
        cost accuracy on short skewed runs, and time to the target everywhere). Once on it stays
        on: the scored accuracy is then the average's, which no longer shows the swings that
        switched it on (switching off on its calm made the average flap on and off at the hard
        end, losing it each time)."""
        if on:
            return Recommendation({"decay": 0.8}, "kept: the scored accuracy is the average's from here on")
        s, c = swing(evidence.accuracy), climb(evidence.accuracy)
        if s is not None and s >= cls.SWINGS:
            return Recommendation({"decay": 0.8}, f"the accuracy falls back {100 * s:.1f} points a round: "
                                                  f"the delivered model averages the last rounds' (decay 0.8)")
        if s is None or c is None:
            return Recommendation(None, "too few scored rounds yet: the global model is delivered as it is")
        if not above_chance(evidence.accuracy, evidence.classes):
            return Recommendation(None, "the accuracy is still near chance: the global model is delivered as it is")
        if evidence.partial and evidence.stopped_climbing:
            return Recommendation({"decay": 0.8}, f"{evidence.per_round} of {evidence.agents} devices a round and "
                                                  f"the accuracy has stopped climbing (net {100 * c:+.1f} points a "
                                                  f"round, falls back {100 * s:.1f}): the delivered model averages "
                                                  f"the last rounds' (decay 0.8)")
        return Recommendation(None, "the accuracy " + ("does not fall back" if not s else "still climbs") +
                                    ": the global model is delivered as it is")

    def __init__(self, cfg: "RunConfig", model: "SplitModel"):
        super().__init__(cfg, model)
        self.average = ModelAverage(float(self.section.decay))

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
