"""Robust aggregation as a training option (``robust:``): what one device's claim or update can
do to the round's average is bounded, and every device a rule acts on is named.

* The weight cap holds by default: an agent's weight (its claimed data size, or the batch the
  coordinator assigned) is at most ``weight_cap`` times the round's median weight. The median
  is an honest device's while fewer than half lie.
* ``aggregate`` picks the rule (:mod:`sfl_core.options.robust.rules`): clipping and Multi-Krum
  act on the client states before the layer-wise average (the states the devices sent; the
  server copies are the coordinator's own), the coordinate-wise median and trimmed mean
  replace the average itself over its participants.

Nothing more crosses the wire; each round's metrics record who was capped, clipped or left
out (``robust``), and the coordinator's log names them in one line.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Sequence

import torch

from sfl_core.options.base import RoundContext, RoundOption
from sfl_core.options.robust.config import RobustConfig
from sfl_core.options.robust.rules import clip_updates, coordinate_median, multi_krum, trimmed_mean

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.model.zoo import SplitModel
    from sfl_core.wire.assignment import Assignment

__all__ = ["OUTLIER_SCORE", "Robust", "krum_f"]

OUTLIER_SCORE = 2.0
"""Multi-Krum leaves ``f`` devices out every round, honest ones too where fewer attack; a device
left out counts as flagged (named, towards quarantine) only where its score is over this many
times the round's median score."""


def krum_f(agents: int, share: float) -> int:
    """Multi-Krum's ``f``: ``floor(share · agents)``, at most ``(agents − 3) // 2`` (Krum needs
    ``n > 2f + 2``), at least 0."""
    return max(0, min(int(share * agents), (agents - 3) // 2))


def capped_weights(weights: Mapping[str, float], cap: float) -> dict[str, float]:
    """Each weight at most ``cap`` times the median weight (``cap`` 0: as they are)."""
    if cap <= 0 or not weights:
        return dict(weights)
    bound = cap * statistics.median(weights.values())
    return {a: min(w, bound) for a, w in weights.items()}


class Robust(RoundOption):
    SECTION: ClassVar[type[RobustConfig]] = RobustConfig

    @classmethod
    def wanted(cls, cfg: "RunConfig") -> bool:
        return bool(cls.settings(cfg).on)

    def __init__(self, cfg: "RunConfig", model: "SplitModel"):
        super().__init__(cfg, model)
        self.last: dict[str, Any] = {}
        self.streak: dict[str, int] = {}
        """Per agent, its rounds in a row flagged (the rounds it took part in)."""

    def screen(self, ctx: RoundContext, r: int, start: Mapping[str, torch.Tensor],
               clients: dict[str, dict[str, torch.Tensor]], weights: dict[str, float],
               assignments: Mapping[str, "Assignment"]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float]]:
        s = self.section
        self.last = {}
        bounded = capped_weights(weights, s.weight_cap)
        capped = sorted(a for a in weights if bounded[a] < weights[a])
        if capped:
            self.last["capped"] = {a: weights[a] for a in capped}
            ctx.log(f"robust: round {r}: weight capped at {s.weight_cap:g}x the round's median for "
                    f"{', '.join(capped)} (claimed {', '.join(f'{weights[a]:g}' for a in capped)})", warning=True)
        ids = list(clients)
        if s.aggregate == "clip" and len(ids) > 1:
            states, scales = clip_updates(start, [clients[a] for a in ids], s.clip_factor,
                                          [assignments[a].lr for a in ids])
            clients = dict(zip(ids, states))
            clipped = {a: round(x, 6) for a, x in zip(ids, scales) if x < 1}
            if clipped:
                self.last["clipped"] = clipped
                ctx.log(f"robust: round {r}: clipped to {s.clip_factor:g}x the round's typical change: "
                        + ", ".join(f"{a} (x{x:.3g})" for a, x in sorted(clipped.items())), warning=True)
        elif s.aggregate == "multi_krum" and len(ids) > 3:
            f = krum_f(len(ids), s.attackers)
            keep, scores = multi_krum([clients[a] for a in ids], f)
            out = sorted(ids[i] for i in range(len(ids)) if i not in keep)
            typical = statistics.median(scores)
            outliers = [a for a in out if scores[ids.index(a)] > OUTLIER_SCORE * typical]
            if out:
                self.last["left_out"] = out
                self.last["outliers"] = outliers
                self.last["scores"] = {a: float(x) for a, x in zip(ids, scores)}
                ctx.log(f"robust: round {r}: Multi-Krum left out {', '.join(out)} (f = {f}; outliers, over "
                        f"{OUTLIER_SCORE:g}x the median score: {', '.join(outliers) or 'none'})", warning=True)
            clients = {a: clients[a] for a in ids if a not in out}
        self._count(ctx, r, list(weights))
        return clients, {a: bounded[a] for a in clients}

    def _count(self, ctx: RoundContext, r: int, took_part: Sequence[str]) -> None:
        """Each agent's flagged rounds in a row (capped, clipped, or a Multi-Krum outlier); quarantine
        at ``quarantine`` of them."""
        flagged = set(self.last.get("capped", {})) | set(self.last.get("clipped", {})) | set(self.last.get("outliers", []))
        for a in took_part:
            self.streak[a] = self.streak.get(a, 0) + 1 if a in flagged else 0
            k = self.section.quarantine
            if k and self.streak[a] >= k:
                what = ", ".join(x for x in ("capped", "clipped", "outliers") if a in self.last.get(x, ()))
                ctx.quarantine(a, f"flagged by robust aggregation in {self.streak[a]} of its rounds in a row "
                                  f"(round {r}: {what})")
                self.last.setdefault("quarantined", []).append(a)
                self.streak[a] = 0

    def aggregate(self, ctx: RoundContext, states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
                  defaults: Mapping[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        if self.section.aggregate == "median":
            return coordinate_median(states, defaults)
        if self.section.aggregate == "trimmed_mean":
            return trimmed_mean(states, self.section.trim, defaults)
        return None

    def round_metrics(self) -> dict[str, Any]:
        return dict(self.last)
