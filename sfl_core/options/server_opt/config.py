"""The server optimiser's section of the run config (``server_opt:``)."""

from __future__ import annotations

from typing import ClassVar

from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, checked
from sfl_core.config.section import OptionSection
from sfl_core.config.values import POSITIVE_NUMBER, UNIT_OPEN, one_of


KINDS = ("auto", "none", "momentum", "adam", "yogi")


@dataclass(frozen=True, config=STRICT)
class ServerOptConfig(OptionSection):
    """How the aggregated client portion becomes the new global one (docs/methods/server-optimisers.md):
    plain aggregation, or a server optimiser stepping along the aggregate's difference."""

    KEY: ClassVar[str] = "server_opt"
    SHORTHAND: ClassVar[str] = "kind"
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
    ('',
     "how the round's aggregated client portion (and server layers averaged over several server copies: one per agent or per group) becomes the new global one (docs/methods/server-optimisers.md): the server optimiser steps along the difference between the aggregate and the round's starting model; nothing more crosses the wire; 'server_opt: none' is short for {kind: none}."),
    ('kind',
     'auto (strategy auto decides from the registered fleet, docs/methods/auto.md; other strategies: none) | none (plain aggregation) | momentum (FedAvgM, Hsu et al. 2019) | adam (FedAdam, Reddi et al. 2021) | yogi (FedYogi, Reddi et al. 2021).'),
    ('lr',
     'server learning rate eta > 0; momentum with lr 1 and beta1 0 is plain aggregation; adam and yogi want about 0.01-0.1.'),
    ('beta1',
     'momentum beta1 in [0, 1) (FedAvgM\'s beta; adam\'s and yogi\'s first moment).'),
    ('beta2',
     'second-moment decay beta2 in [0, 1) (adam, yogi).'),
    ('tau',
     'adaptivity tau > 0 (adam, yogi): the floor of the denominator; the second moment starts at tau^2.'),
    )

    kind: Annotated[str, checked(one_of(*KINDS))] = "auto"
    """auto: strategy auto decides from the fleet (any other strategy: none)."""
    lr: Annotated[float, POSITIVE_NUMBER] = 1.0
    beta1: Annotated[float, UNIT_OPEN] = 0.9
    beta2: Annotated[float, UNIT_OPEN] = 0.99
    tau: Annotated[float, POSITIVE_NUMBER] = 1e-3

    @property
    def on(self) -> bool:
        return self.kind not in ("auto", "none")

