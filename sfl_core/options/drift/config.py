"""Drift correction's section of the run config (``drift:``)."""

from __future__ import annotations

from typing import ClassVar

from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, checked
from sfl_core.config.section import OptionSection
from sfl_core.config.values import nonneg_number, one_of


KINDS = ("auto", "none", "fedprox", "scaffold")


@dataclass(frozen=True, config=STRICT)
class DriftConfig(OptionSection):
    """Drift correction for the client portions and the averaged server copies
    (docs/methods/drift.md): FedProx's proximal term or SCAFFOLD's control variates.
    ``drift: scaffold`` is short for ``{kind: scaffold}``."""

    KEY: ClassVar[str] = "drift"
    SHORTHAND: ClassVar[str] = "kind"
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
    ('',
     "drift correction for the client portions, and for the server copies of server_mode per_agent (one per agent, averaged) (docs/methods/drift.md); 'drift: scaffold' is short for {kind: scaffold}."),
    ('kind',
     'auto (strategy auto decides from the registered fleet, docs/methods/auto.md; other strategies: none) | none | fedprox (Li et al. 2020: each local step adds mu (w - x) to the gradient, x the received client portion) | scaffold (Karimireddy et al. 2020: each local step adds c - c_i; the coordinator keeps every c_i and sends c - c_i with the assignment, one more client portion down per round).'),
    ('mu',
     "FedProx's mu >= 0."),
    )

    kind: Annotated[str, checked(one_of(*KINDS))] = "auto"
    """auto: strategy auto decides from the fleet (any other strategy: none)."""
    mu: Annotated[float, checked(nonneg_number)] = 0.01
    """FedProx's μ: each local step adds μ (w − x) to the gradient."""

    @property
    def on(self) -> bool:
        return self.kind not in ("auto", "none")

