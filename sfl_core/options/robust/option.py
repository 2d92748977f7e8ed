"""Robust aggregation as a training option (``robust:``): what one device's claim or update can
do to the round's average is bounded, and every device a rule acts on is named.

* The weight cap holds by default: an agent's weight (its claimed data size, or the batch the
  coordinator assigned) is at most ``weight_cap`` times the round's median weight. The median
  is an honest device's while fewer than half lie.
* The server portion's screen holds by default (:mod:`sfl_core.options.robust.rows`): a
  device whose activations' scale lies far from its cut's median has its rows left out of the
  server's step, and its update out of the round's average.
* ``aggregate`` picks the rule (:mod:`sfl_core.options.robust.rules`): clipping and Multi-Krum
  act on the client states before the layer-wise average (the states the devices sent; the
  server copies are the coordinator's own), the coordinate-wise median and trimmed mean
  replace the average itself over its participants.

Nothing more crosses the wire; each round's metrics record who was capped, clipped or left
out (``robust``), and the coordinator's log names them in one line.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Sequence

import torch

from sfl_core.options.base import RoundContext, RoundOption
from sfl_core.options.robust.config import RobustConfig
from sfl_core.options.robust.rows import cut_sizes, far_rows, rms, typical_size
from sfl_core.options.robust.rules import change_sizes, coordinate_median, multi_krum, trimmed_mean, typical_changes

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.model.zoo import SplitModel
    from sfl_core.wire.assignment import Assignment

__all__ = ["FLAGS", "OUTLIER_SCORE", "Robust", "krum_f"]

FLAGS = ("capped", "clipped", "outliers", "rows_left_out")
"""What counts as a flag towards quarantine: the round's metrics' keys that name agents."""

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


def _farther(x: float, y: float) -> bool:
    """Whether scale ``x`` lies farther from 1 than ``y``, either way (0: farthest)."""
    return x <= 0 or (y > 0 and abs(math.log(x)) > abs(math.log(y)))


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
        self.rows: dict[str, tuple[int, float]] = {}
        """This round's agents whose rows a server step left out: the steps, and the scale (their
        activations' size over the typical) farthest from 1."""
        self._rows_round = -1
        self.typical: dict[tuple[int, int], float] = {}
        """Per cut (split, width), the median activations' RMS its accepted devices sent last."""
        self._anchors: dict[tuple[int, int], Optional[float]] = {}
        self.past_change: dict[str, float] = {}
        """Per layer, the typical change (per unit of learning rate) clipping last measured it by."""

    def _start_round(self, r: int) -> None:
        """Forget the last round's rows left out (and its anchors) at the first word of round ``r``."""
        if r != self._rows_round:
            self.rows, self._rows_round, self._anchors = {}, r, {}

    def screen_rows(self, ctx: RoundContext, r: int, step: int, rows: Mapping[str, torch.Tensor],
                    assignments: Mapping[str, "Assignment"]) -> set[str]:
        factor = self.section.activation_factor
        self._start_round(r)
        if not factor:
            return set()
        out: set[str] = set()
        for cut, sizes in cut_sizes(rows, {a: (assignments[a].split, assignments[a].width) for a in rows}).items():
            if cut not in self._anchors:
                ref = ctx.reference_rows(*cut)
                self._anchors[cut] = rms(ref) if ref is not None else None
            typical = typical_size(list(sizes.values()), self.typical.get(cut), self._anchors[cut], factor)
            far = far_rows(sizes, typical, factor)
            kept = [x for a, x in sizes.items() if a not in far]
            if kept:
                self.typical[cut] = statistics.median(kept)
            for a, scale in far.items():
                steps, worst = self.rows.get(a, (0, 1.0))
                if not steps:
                    ctx.log(f"robust: round {r}: rows of {a} left out of the server's step {step}: its activations' "
                            f"size is {scale:.3g}x the typical size at its cut (limit {factor:g}x either way); "
                            f"its update is left out of the round's average", warning=True)
                self.rows[a] = (steps + 1, scale if _farther(scale, worst) else worst)
            out |= set(far)
        return out

    def worker_findings(self, r: int) -> dict[str, Any]:
        rows = self.rows if self._rows_round == r else {}
        return {"rows": {a: [steps, scale] for a, (steps, scale) in rows.items()}} if rows else {}

    def merge_worker_findings(self, ctx: RoundContext, r: int, findings: Mapping[str, Any]) -> None:
        """A worker's agents whose rows it left out: their updates are left out here, they are
        named in the leader's log and metrics and counted towards quarantine, as the leader's own."""
        rows = findings.get("rows") if isinstance(findings, Mapping) else None
        if not isinstance(rows, Mapping):
            return
        self._start_round(r)
        for a, found in rows.items():
            if not (isinstance(a, str) and isinstance(found, (list, tuple)) and len(found) == 2
                    and isinstance(found[0], int) and found[0] > 0 and isinstance(found[1], (int, float))
                    and math.isfinite(found[1]) and found[1] >= 0):
                ctx.log(f"robust: round {r}: a server worker's finding for {a!r} is malformed; ignored", warning=True)
                continue
            steps, scale = int(found[0]), float(found[1])
            ctx.log(f"robust: round {r}: a server worker left the rows of {a} out of {steps} of its steps "
                    f"(activations {scale:.3g}x the typical size at its cut); its update is left out of the "
                    f"round's average", warning=True)
            mine = self.rows.get(a, (0, 1.0))
            self.rows[a] = (mine[0] + steps, scale if _farther(scale, mine[1]) else mine[1])

    def screen(self, ctx: RoundContext, r: int, start: Mapping[str, torch.Tensor],
               clients: dict[str, dict[str, torch.Tensor]], weights: dict[str, float],
               assignments: Mapping[str, "Assignment"]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float]]:
        s = self.section
        self.last = {}
        rows = {a: v for a, v in self.rows.items() if a in weights and self._rows_round == r}
        if rows:   # a device that lied to the server's step: its update is not let in either
            self.last["rows_left_out"] = {a: steps for a, (steps, _) in rows.items()}
            self.last["activation_scale"] = {a: round(x, 4) for a, (_, x) in rows.items()}
            clients = {a: c for a, c in clients.items() if a not in rows}
        bounded = capped_weights(weights, s.weight_cap)
        capped = sorted(a for a in weights if bounded[a] < weights[a])
        if capped:
            self.last["capped"] = {a: weights[a] for a in capped}
            ctx.log(f"robust: round {r}: weight capped at {s.weight_cap:g}x the round's median for "
                    f"{', '.join(capped)} (claimed {', '.join(f'{weights[a]:g}' for a in capped)})", warning=True)
        ids = list(clients)
        if s.aggregate == "clip" and len(ids) > 1:
            states, rates = [clients[a] for a in ids], [assignments[a].lr for a in ids]
            typical = typical_changes(start, states, rates, self.past_change)
            self.past_change.update(typical)
            sizes = change_sizes(start, states, rates, typical)
            over = {a: round(x, 4) for a, x in zip(ids, sizes) if x > s.clip_factor}
            if over:
                self.last["clipped"] = over
                ctx.log(f"robust: round {r}: left out, a change over {s.clip_factor:g}x the round's typical change: "
                        + ", ".join(f"{a} ({x:.3g}x)" for a, x in sorted(over.items())), warning=True)
                clients = {a: c for a, c in clients.items() if a not in over}
        elif s.aggregate == "multi_krum" and len(ids) > 3:
            f = krum_f(len(ids), s.attackers)
            keep, scores = multi_krum([clients[a] for a in ids], f)
            out = sorted(ids[i] for i in range(len(ids)) if i not in keep)
            median_score = statistics.median(scores)
            outliers = [a for a in out if scores[ids.index(a)] > OUTLIER_SCORE * median_score]
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
        """Each agent's flagged rounds in a row (capped, clipped, a Multi-Krum outlier, or its rows
        left out of a server step); quarantine
        at ``quarantine`` of them."""
        flagged = {a for key in FLAGS for a in self.last.get(key, ())}
        for a in took_part:
            self.streak[a] = self.streak.get(a, 0) + 1 if a in flagged else 0
            k = self.section.quarantine
            if k and self.streak[a] >= k:
                what = ", ".join(x.replace("_", " ") for x in FLAGS if a in self.last.get(x, ()))
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
