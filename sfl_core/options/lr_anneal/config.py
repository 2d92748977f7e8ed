"""The annealed learning rate's section of the run config (``lr_anneal:``)."""

from __future__ import annotations

from typing import ClassVar, Union

from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, checked
from sfl_core.config.section import OptionSection
from sfl_core.config.values import auto_or_share


@dataclass(frozen=True, config=STRICT)
class LrAnnealConfig(OptionSection):
    """The learning rate of devices and server falls linearly to a tenth over the last ``share``
    of the run's rounds. ``lr_anneal: 0.5`` is short for ``{share: 0.5}``."""

    KEY: ClassVar[str] = "lr_anneal"
    SHORTHAND: ClassVar[str] = "share"
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("", "the learning rate annealed over the last rounds of the run (docs/methods/server-optimisers.md); "
             "'lr_anneal: 0.5' is short for {share: 0.5}."),
        ("share",
         "share s in [0, 1) of the run's rounds over which the learning rate of devices and server falls "
         "linearly from its value to a tenth of it at the last round: round r of R trains at "
         "lr x (1 - 0.9 (r - (1 - s) R) / (s R)) once r > (1 - s) R, on top of lr_decay; it shrinks the "
         "last rounds' swings, where each round's sample of label-skewed devices pulls the model towards "
         "its classes; the horizon is the run's rounds; 0 = off; auto (default) = strategy auto decides from "
         "the fleet and the run's accuracy (docs/methods/auto.md), other strategies: off."),
    )

    share: Annotated[Union[str, float], checked(auto_or_share)] = "auto"
    """Share of the run's rounds the learning rate falls over; 0: off; auto: strategy auto decides."""

    FLOOR: ClassVar[float] = 0.1
    """What the learning rate falls to by the last round, as a share of its value."""

    @property
    def on(self) -> bool:
        return isinstance(self.share, float) and self.share > 0
