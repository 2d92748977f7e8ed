"""The delivered model average's section of the run config (``model_ema:``)."""

from __future__ import annotations

from typing import ClassVar, Union

from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, checked
from sfl_core.config.section import OptionSection
from sfl_core.config.values import auto_or_share


@dataclass(frozen=True, config=STRICT)
class ModelEmaConfig(OptionSection):
    """The exponential moving average over rounds of the global model that the run delivers
    (evaluates, exports): a <- d a + (1 - d) x after each round. ``model_ema: 0.8`` is short for
    ``{decay: 0.8}``."""

    KEY: ClassVar[str] = "model_ema"
    SHORTHAND: ClassVar[str] = "decay"
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("", "the model the run delivers: an exponential moving average of the global model over rounds "
             "(docs/methods/server-optimisers.md); 'model_ema: 0.8' is short for {decay: 0.8}."),
    ('decay',
     "decay d in [0, 1) of an exponential moving average of the global model over rounds, the model the run delivers: a <- d a + (1 - d) x after each round's aggregation (and statistics pass), BatchNorm statistics averaged with the weights; the average is scored on the validation set, sent for federated evaluation and exported, while training goes on from the global model x; it damps the round-to-round swings of label-skewed rounds (docs/methods/server-optimisers.md); kept on the coordinator, nothing more crosses the wire; 0 = off; auto (default) = strategy auto decides from the fleet and the run's accuracy (docs/methods/auto.md), other strategies: off."),
    )

    decay: Annotated[Union[str, float], checked(auto_or_share)] = "auto"
    """Decay d of the average; 0: off; auto: strategy auto decides (any other strategy: off)."""

    @property
    def on(self) -> bool:
        return isinstance(self.decay, float) and self.decay > 0

