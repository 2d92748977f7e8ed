"""The server loss's section of the run config (``loss:``)."""

from __future__ import annotations

from typing import ClassVar, Mapping

from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, checked
from sfl_core.config.section import OptionSection
from sfl_core.config.values import AT_LEAST_0, one_of

KINDS = ("ce", "calibrated")


@dataclass(frozen=True, config=STRICT)
class LossConfig(OptionSection):
    """The server's training loss: cross-entropy, or logit calibration (FedLC, as HeteroSFL uses
    it). ``loss: calibrated`` is short for ``{kind: calibrated}``; a run file's top-level
    ``calibration_tau`` is ``loss.tau``."""

    KEY: ClassVar[str] = "loss"
    SHORTHAND: ClassVar[str] = "kind"
    ALIASES: ClassVar[Mapping[str, str]] = {"calibration_tau": "tau"}
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("", "the server's training loss (docs/methods/heterosfl.md); 'loss: calibrated' is short for "
             "{kind: calibrated}."),
        ("kind", "ce (cross-entropy) | calibrated (FedLC logit calibration, Zhang et al. 2022: logit z_c - tau * "
                 "n_c^(-1/4) with n_c the row's agent's count of class c; counters label skew)."),
        ("tau", "calibration strength tau >= 0 (0 = plain cross-entropy); a top-level calibration_tau "
                "means the same."),
    )

    kind: Annotated[str, checked(one_of(*KINDS))] = "ce"
    tau: Annotated[float, AT_LEAST_0] = 1.0
