"""The calibrated loss as a training option (``loss: calibrated``): every server copy scores a
row against its own agent's label counts (:func:`sfl_core.losses.logit_calibrated_ce`), whatever
the method; a method's own loss term (HeteroSFL's BDKS) stays. Nothing crosses the wire."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

from sfl_core.losses import LossSpec
from sfl_core.options.base import RoundOption
from sfl_core.options.calibrated_loss.config import LossConfig

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig

__all__ = ["CalibratedLoss"]


class CalibratedLoss(RoundOption):
    SECTION: ClassVar[type[LossConfig]] = LossConfig

    @classmethod
    def wanted(cls, cfg: "RunConfig") -> bool:
        return bool(cls.settings(cfg).kind == "calibrated")

    def server_loss(self, spec: LossSpec) -> LossSpec:
        return dataclasses.replace(spec, kind="calibrated", tau=self.section.tau)
