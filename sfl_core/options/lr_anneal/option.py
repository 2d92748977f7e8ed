"""The learning rate annealed over the last rounds as a training option (``lr_anneal: SHARE``):
each round's learning rate of devices and server is multiplied by
:func:`~sfl_core.options.lr_anneal.schedule.anneal_factor`. Nothing more crosses the wire: the
rate already travels in each assignment."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from sfl_core.options.base import Recommendation, RoundOption
from sfl_core.options.lr_anneal.config import LrAnnealConfig
from sfl_core.options.lr_anneal.schedule import anneal_factor

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.evidence import Evidence

__all__ = ["LrAnneal"]


class LrAnneal(RoundOption):
    SECTION: ClassVar[type[LrAnnealConfig]] = LrAnnealConfig

    SHARE = 0.5
    """The share auto anneals over (a quarter did less at the hard end, docs/methods/auto.md)."""

    @classmethod
    def recommend(cls, cfg: "RunConfig", evidence: "Evidence", on: bool) -> Recommendation:
        """On (the last half of the run) where a round trains a sample of strongly label-skewed
        devices whose accuracy stopped climbing in the first half
        (:attr:`~sfl_core.evidence.Evidence.stopped_climbing`): each round then pulls the model
        towards the classes of the devices it took, so the last rounds' model swings with the
        sample, and a smaller step shrinks the swing. Not on a run still climbing when its last
        half begins (a smaller step would slow the climb: on MergeSFL's setting the accuracy
        first levels off at 35-50 % in the last rounds, still far from its end), nor where every
        device trains every round, nor on milder skew (not measured to pay there). Once on it
        stays on, so the schedule runs to its end."""
        changes = {"share": cls.SHARE}
        if on:
            return Recommendation(changes, "kept: the schedule runs to the last round")
        if not evidence.partial:
            return Recommendation(None, "every device trains every round: no sample for the last rounds to swing with")
        if not evidence.strongly_skewed:
            return Recommendation(None, f"the devices' label mixes are close enough (mean KL "
                                        f"{evidence.label_skew:.2f} nats): the learning rate is kept")
        if evidence.round > (1 - cls.SHARE) * cfg.rounds:
            return Recommendation(None, "the accuracy was still climbing when the run's last half began: "
                                        "the learning rate is kept to the end")
        if not evidence.stopped_climbing:
            return Recommendation(None, "the accuracy is still climbing (or not yet scored): the learning rate is kept")
        return Recommendation(changes, f"{evidence.per_round} of {evidence.agents} label-skewed devices a round "
                                       f"(mean KL {evidence.label_skew:.2f} nats) and the accuracy has stopped "
                                       f"climbing: the learning rate falls to a tenth over the last half of the "
                                       f"run, shrinking each round's pull towards its sample's classes")

    def lr_factor(self, r: int) -> float:
        return anneal_factor(r, self.cfg.rounds, float(self.section.share), LrAnnealConfig.FLOOR)
