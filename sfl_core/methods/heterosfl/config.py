"""HeteroSFL's section of the run config (``hetero:``): link-rate groups, their widths and codecs, BDKS."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from pydantic import model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, Fail, checked, invalid, number
from sfl_core.config.section import MethodSection
from sfl_core.config.values import (
    AT_LEAST_0,
    BOOLEAN,
    FRACTION,
    OPTIONAL_POSITIVE_INTEGER,
    codec_list,
    integer_in,
    positive_integers,
)

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig


def _rate_list(v: Any, fail: Fail) -> tuple[float, ...] | None:
    if v is None:
        return None
    nums = [number(x) for x in v] if isinstance(v, (list, tuple)) else []
    rates = [float(x) for x in nums if x is not None]
    if not nums or len(rates) != len(nums) or any(x <= 0 for x in rates) or any(b <= a for a, b in zip(rates, rates[1:])):
        fail("a strictly ascending list of positive rates in bytes/s, or null")
    return tuple(rates)


@dataclass(frozen=True, config=STRICT)
class HeteroConfig(MethodSection):
    """HeteroSFL (docs/methods/heterosfl.md): agents grouped by link rate; each group gets a bottleneck width (and
    optionally its own codec) so the groups' per-step transfer times come out close (the slow
    group compresses most)."""

    KEY: ClassVar[str] = 'hetero'
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
        ('',
         'HeteroSFL (docs/methods/heterosfl.md): agents grouped by link rate, each group with its own bottleneck width and/or codec'),
        ('width',
         'full (widest) bottleneck width P in channels; null = no bottleneck. Needs one fixed split (strategy sfl); under strategy auto use auto.widths.'),
        ('groups',
         'agents grouped by measured uplink rate into 1-4 groups.'),
        ('widths',
         "fixed width per group, slowest group first; null = widths proportional to the groups' rates (fastest = width)."),
        ('thresholds',
         'ascending uplink rates (B/s) separating the groups; null = equal-count quantiles.'),
        ('codecs',
         "codec per group, slowest group first (e.g. [topk4, fp32]); works with or without a bottleneck; null = the run's codec."),
        ('bdks',
         'bi-directional knowledge sharing (HeteroSFL Eq. 6-8) for every group wider than the narrowest: loss(wide) + bdks_alpha * N2W + W2N, on the server only (about 2x server compute for those rows).'),
        ('bdks_alpha',
         'weight of the narrow-to-wide distillation, >= 0.'),
        ('bdks_theta',
         "a class is under-represented in a group when its share of the group's data is below bdks_theta x its share of all agents' data, in [0, 1]."),
    )

    width: Annotated[Optional[int], OPTIONAL_POSITIVE_INTEGER] = None                     # full (widest) width P; None = no bottleneck
    groups: Annotated[int, checked(integer_in(1, 4, what="an integer from 1 to 4"))] = 2   # link-rate groups, 1..4
    widths: Annotated[Optional[tuple[int, ...]], checked(positive_integers)] = None      # fixed width per group, slowest first
    thresholds: Annotated[Optional[tuple[float, ...]], checked(_rate_list)] = None   # uplink B/s between groups; None = quantiles
    codecs: Annotated[Optional[tuple[str, ...]], checked(codec_list)] = None        # codec per group, slowest first
    bdks: Annotated[bool, BOOLEAN] = False                 # bi-directional knowledge sharing for the wider groups
    bdks_alpha: Annotated[float, AT_LEAST_0] = 1.0        # weight of the narrow-to-wide distillation (Eq. 8)
    bdks_theta: Annotated[float, FRACTION] = 0.1        # under-represented: class share < theta x its share overall

    @model_validator(mode="after")
    def _relations(self) -> "HeteroConfig":
        if self.codecs is not None and len(self.codecs) != self.groups:
            raise invalid("codecs", f"expected {self.groups} codecs (one per group), got {list(self.codecs)}")
        if self.widths is not None:
            if len(self.widths) != self.groups:
                raise invalid("widths", f"expected {self.groups} widths (one per group), got {list(self.widths)}")
            if self.width is None:
                raise invalid("widths", "fixed widths need the full width (set hetero.width)")
            if any(b < a for a, b in zip(self.widths, self.widths[1:])):
                raise invalid("widths", f"expected widths non-decreasing from the slowest group, got {list(self.widths)}")
            if max(self.widths) > self.width:
                raise invalid("widths", f"expected widths <= hetero.width {self.width}")
        if self.thresholds is not None and len(self.thresholds) != self.groups - 1:
            raise invalid("thresholds", f"expected {self.groups - 1} rates (between {self.groups} groups), "
                                        f"got {list(self.thresholds)}")
        if self.bdks and self.width is None:
            raise invalid("bdks", "needs a bottleneck (set hetero.width)")
        return self

    def neutral(self) -> "HeteroConfig":
        return replace(self, width=None, widths=None, codecs=None, bdks=False)

    def check_run(self, run: "RunConfig") -> None:
        if self.width is None:
            return
        from sfl_core.method_registry import one_split_conflict
        conflict = one_split_conflict(run)
        if conflict:
            raise invalid("hetero.width", conflict)
