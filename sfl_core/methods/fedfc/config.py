"""FedFC's section of the run config (``fedfc:``): a cut per device profile and how the merged
server copy counts in the layer-wise average.

Both keys were top-level keys before FedFC had a section; a run file that still sets
``profile_splits:`` or ``server_weight:`` at the top reads them as ``fedfc.<key>`` (``ALIASES``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from pydantic.dataclasses import dataclass
from typing_extensions import Annotated  # typing.Annotated needs Python 3.9

from sfl_core.config.fields import STRICT, Fail, checked, invalid
from sfl_core.config.section import MethodSection
from sfl_core.config.values import one_of, optional

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig


def _split_map(v: Any, fail: Fail) -> dict[str, int]:
    if not isinstance(v, dict) or not v or not all(isinstance(k, str) and isinstance(x, int) and
                                                   not isinstance(x, bool) and x >= 1 for k, x in v.items()):
        fail("a mapping of device profile name to split point (an integer >= 1), or null")
    return dict(v)


@dataclass(frozen=True, config=STRICT)
class FedFcConfig(MethodSection):
    """FedFC mixed cut layers (docs/methods/fedfc.md), over ``strategy: sfl``."""

    KEY: ClassVar[str] = "fedfc"
    ALIASES: ClassVar[dict[str, str]] = {"profile_splits": "profile_splits", "server_weight": "server_weight"}
    DOCS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("", "FedFC mixed cut layers (docs/methods/fedfc.md), with strategy sfl; the top-level keys "
             "profile_splits and server_weight of older run files read as these."),
        ("profile_splits",
         "split point per device profile, e.g. {jetson-nano: 1, jetson-agx-xavier: 3}; other agents use "
         "split. With server_mode merged, one server pass joins each agent's rows at its own layer; null = off."),
        ("server_weight",
         "how a merged server copy counts in the layer-wise average of mixed cuts: members (once per agent "
         "it trained for, weighted by their data) | once (one participant, FedFC's Alg. 3)."),
    )

    profile_splits: Annotated[Optional[dict[str, int]], checked(optional(_split_map))] = None
    server_weight: Annotated[str, checked(one_of("members", "once"))] = "members"

    def neutral(self) -> "FedFcConfig":
        return replace(self, profile_splits=None, server_weight="members")

    def check_run(self, run: "RunConfig") -> None:
        if self.profile_splits is not None and run.strategy != "sfl":
            raise invalid("fedfc.profile_splits", f"mixed cut layers need strategy 'sfl' without a bottleneck, "
                                                  f"got strategy {run.strategy!r}")
        if self.server_weight == "once" and self.profile_splits is None:
            raise invalid("fedfc.server_weight", "'once' weighs the server copy of FedFC's mixed cuts: "
                                                 "it needs fedfc.profile_splits")
