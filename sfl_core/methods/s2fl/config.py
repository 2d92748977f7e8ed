"""S2FL's section of the run config (``s2fl:``): the sliding split and the data-balance groups."""

from __future__ import annotations

from typing import ClassVar, Optional

from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, checked
from sfl_core.config.section import MethodSection
from sfl_core.config.values import BOOLEAN, POSITIVE_INTEGER, split_points


@dataclass(frozen=True, config=STRICT)
class S2flConfig(MethodSection):
    """S2FL switches (docs/methods/s2fl.md). The paper's ablations: +R = both off (SplitFed v1 at the
    largest candidate split), +B = balance only, +M = sliding only, +MB = both."""

    KEY: ClassVar[str] = 's2fl'
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
        ('',
         'S2FL switches, used when strategy is s2fl (docs/methods/s2fl.md)'),
        ('sliding',
         'per-agent split from the client time table (warm-up: rounds 1..K use candidate k for everybody; then the median rule).'),
        ('balance',
         "group agents so each group's label mix is closest to uniform (Eq. 2); one server copy per group. false = one copy per agent."),
        ('group_size',
         'agents per group when balancing.'),
        ('candidates',
         "candidate split points, e.g. [1, 2, 3]; null = the model's defaults (sfl_core/model/zoo.py). With sliding false the largest candidate is used (the paper's SFL baseline)."),
    )

    sliding: Annotated[bool, BOOLEAN] = True           # adaptive sliding split from the client time table
    balance: Annotated[bool, BOOLEAN] = True           # data-balance grouping (one server copy per group)
    group_size: Annotated[int, POSITIVE_INTEGER] = 5         # agents per group when balancing
    candidates: Annotated[Optional[tuple[int, ...]], checked(split_points)] = None  # None = the model's defaults
