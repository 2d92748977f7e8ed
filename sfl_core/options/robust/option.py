"""Robust aggregation as a training option (``robust:``): what one device's claim or update can
do to the round's average is bounded, and every device a rule acts on is named.

* The weight cap holds by default: an agent's weight (its claimed data size, or the batch the
  coordinator assigned) is at most ``weight_cap`` times the median weight: of every registered
  agent's claim where the weights are claims, else of the round's. A claimed median is an
  honest device's while fewer than half the fleet lie, whatever share of one round they take.
* The server portion's screens hold by default: a device whose activations' scale lies far
  from its cut's median (:mod:`sfl_core.options.robust.rows`), or whose labels disagree with
  what its inputs look like at the cut (:mod:`sfl_core.options.robust.labels`; where the
  devices' layers hold BatchNorm, against held-out samples of each device's own mix of
  classes), has its rows left out of the server's steps, and its update out of the round's
  average.
* The mix of classes a device registered is checked against the labels it sends
  (``mix_limit``; :mod:`sfl_core.options.robust.mix`): a claim its labels refute is named and
  replaced, for the planners, by the mix it showed.
* A row a device sent twice in a step (its sampler wrapped around fewer samples than its batch)
  is trained on once (``repeated_rows``; :mod:`sfl_core.options.robust.repeats`): a device
  weighs in the server's step by the samples it showed.
* ``aggregate`` picks the rule (:mod:`sfl_core.options.robust.rules`): clipping and Multi-Krum
  act on the client states before the layer-wise average (the states the devices sent; the
  server copies are the coordinator's own), the coordinate-wise median and trimmed mean
  replace the average itself over its participants. Clipping bounds each change by the
  round's typical change and, among agents given the same assignment (peers train alike),
  more tightly by their own.

Nothing more crosses the wire; each round's metrics record who was capped, clipped or left
out (``robust``), and the coordinator's log names them in one line.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Sequence

import torch

from sfl_core.model.norm_layers import batch_norm_layers
from sfl_core.options.base import RoundContext, RoundOption, RowsTrained
from sfl_core.options.robust.config import RobustConfig
from sfl_core.options.robust.labels import (MIN_ROWS, POOLED_ROUNDS, LabelCount, Reference, class_centroids,
                                           count_each, count_far, distinct, judge, matched_selection)
from sfl_core.options.robust.mix import deviations, shown_mix
from sfl_core.options.robust.repeats import repeats
from sfl_core.options.robust.rows import cut_sizes, far_rows, rms, typical_size
from sfl_core.options.robust.rules import (Changes, coordinate_median, measure_changes, multi_krum, relative_of,
                                           sizes_of, trimmed_mean, typical_of)

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig
    from sfl_core.model.zoo import SplitModel
    from sfl_core.wire.assignment import Assignment

__all__ = ["FLAGS", "IMPLAUSIBLE", "OUTLIER_SCORE", "PEERS", "Robust", "change_scale", "flagged_in", "krum_f",
           "peer_key"]

FLAGS = ("refused", "capped", "clipped", "clipped_by_peers", "replaced", "outliers", "rows_left_out", "mix_refuted")
"""The round's metrics' keys that name agents; each counts towards quarantine (``capped`` only
over :data:`IMPLAUSIBLE`)."""


def flagged_in(metrics: Mapping[str, Any]) -> set[str]:
    """The agents a round's metrics of this option (``metrics["robust"]``) name as flagged: every
    key of :data:`FLAGS` but ``capped`` (a cap alone is no accusation; :data:`IMPLAUSIBLE`)."""
    return {a for key in FLAGS if key != "capped" for a in metrics.get(key, ())}


IMPLAUSIBLE = 10.0
"""A capped claim counts towards quarantine only where it is over this many times the cap (by
default a hundred times the fleet's median): an honest device can hold over ten times the
median's data (Dirichlet 0.1 splits over 20-100 devices held up to 12 times the fleet's median,
and up to about 60 times a round's; fleets of unequal shards hold more), and capping bounds
what it weighs; quarantining it would lose its data."""

REPLACED = 1.0
"""A change at least this many times the size of the weights it started from (``relative_changes``)
is left out under ``clip``: honest rounds move the weights by a fraction of their size."""

PEERS = 5
"""The fewest agents of a round sharing an assignment whose changes are compared as peers
(``peer_factor``). The median of three is an honest change while fewer than half lie, but not
a steady one: on a label-skewed BatchNorm fleet an honest device in a group of four lay over
four times the other three's median."""

OUTLIER_SCORE = 2.0
"""Multi-Krum leaves ``f`` devices out every round, honest ones too where fewer attack; a device
left out counts as flagged (named, towards quarantine) only where its score is over this many
times the round's median score."""


SCREEN_NOTICE_S = 1.0
SCREEN_NOTICE_SHARE = 0.5
"""The coordinator's log says once what the label screen costs where, in a round, it took at
least :data:`SCREEN_NOTICE_S` seconds and this share of the round's steps (from the first
screened step to the round's end): with BatchNorm on a CPU server its held-out passes can take
most of a round, and an operator then has choices (docs/scaling.md)."""


def krum_f(agents: int, share: float) -> int:
    """Multi-Krum's ``f``: ``floor(share · agents)``, at most ``(agents − 3) // 2`` (Krum needs
    ``n > 2f + 2``), at least 0."""
    return max(0, min(int(share * agents), (agents - 3) // 2))


def peer_key(assignment: "Assignment") -> tuple[Any, ...]:
    """What makes agents peers for ``peer_factor``: the same training mode, cut, bottleneck width,
    batch, steps and window (what sets how far an honest round moves the weights, per unit of
    learning rate)."""
    return (assignment.mode, assignment.split, assignment.width, assignment.batch_size, assignment.tau,
            assignment.window)


def change_scale(assignment: "Assignment") -> float:
    """The scale of an honest round's change for ``assignment``: its learning rate over the
    square root of its batch. Per unit of learning rate a change is its steps' gradients; a
    small batch's are mostly noise, whose size goes as one over the square root of the batch,
    and the planners scale the learning rate with the batch, not its root, so per unit of
    learning rate alone the small batches the joint planner gives slow devices look like
    attacks beside the large ones. Devices given the same batch compare as before."""
    return assignment.lr / math.sqrt(max(assignment.batch_size, 1))


def capped_weights(weights: Mapping[str, float], cap: float,
                   over: Optional[Mapping[str, float]] = None) -> dict[str, float]:
    """Each weight at most ``cap`` times the median of ``over`` (the fleet's claims; default:
    ``weights``). ``cap`` 0: as they are. Why the fleet's and not the round's alone: a round of
    ten drawn from a fleet where three in ten lie has a liars' majority about one round in
    twelve, and its median is then a lie."""
    if cap <= 0 or not weights:
        return dict(weights)
    bound = cap * statistics.median((over or weights).values())
    return {a: min(w, bound) for a, w in weights.items()}


def _mix_text(counts: Sequence[int]) -> str:
    """A mix of classes in one short run: the classes held, ``class: count`` (e.g. ``3: 120, 7: 25``)."""
    return ", ".join(f"{k}: {n}" for k, n in enumerate(counts) if n) or "none"


def _holds_all(ctx: RoundContext, agent: str, images: int) -> bool:
    """Whether a step that repeated rows holds all of ``agent``'s data: its distinct ``images``
    are as many as the samples it registered (a step at the end of a larger device's epoch
    repeats a few of its images too, and it has more to show); where its registration is not
    known, a repeat is taken to mean it."""
    info = ctx.fleet.get(agent)
    return info is None or int(getattr(info, "num_samples", 0)) <= images


def _farther(x: float, y: float) -> bool:
    """Whether scale ``x`` lies farther from 1 than ``y``, either way (0: farthest)."""
    return x <= 0 or (y > 0 and abs(math.log(x)) > abs(math.log(y)))


class Robust(RoundOption):
    SECTION: ClassVar[type[RobustConfig]] = RobustConfig

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
        self._matched: dict[int, bool] = {}
        """Per split, whether the devices' layers hold BatchNorm (the label screen's reference is
        then matched to each device's mix of classes)."""
        self.labels: dict[str, tuple[int, float]] = {}
        """This round's agents whose rows the label screen left out: the steps, and their share of
        mismatched rows over the expected share."""
        self._label_counts: dict[str, LabelCount] = {}
        self._label_past: dict[str, list[LabelCount]] = {}
        """Per agent, its judged counts of its last rounds before this one (at most
        :data:`~sfl_core.options.robust.labels.POOLED_ROUNDS` - 1), pooled with this round's."""
        self._label_refs: dict[tuple[int, int], Optional[tuple[torch.Tensor, Optional[Reference]]]] = {}
        """Per cut this round, the held-out labels and (without BatchNorm) their class centroids."""
        self._label_s, self._round_t0, self._noticed = 0.0, 0.0, False
        """This round's seconds in the label screen, when its first step was screened, and whether
        the log said what the screen costs (:data:`SCREEN_NOTICE_S`)."""
        self._sent: dict[tuple[str, ...], torch.Tensor] = {}
        """This round's labels sent, a count per agent and class, summed over the steps that had the
        same agents (usually all of them: one addition a step; :attr:`sent` reads them out)."""
        self.past_change: dict[str, float] = {}
        """Per layer, the typical change (per unit of :func:`change_scale`) clipping last measured it by."""
        self.past_peer_change: dict[tuple[Any, ...], dict[str, float]] = {}
        """The same, per assignment that peers shared (:func:`peer_key`)."""

    @staticmethod
    def _cap_median_over(ctx: RoundContext, weights: Mapping[str, float]) -> Mapping[str, float]:
        """What the weight cap's median is over: every registered agent's claimed data size where
        the round's weights are those claims (each one known from registration), else the
        round's weights (batches the coordinator assigned: nothing in them is a device's word)."""
        claims = {a: float(info.num_samples) for a, info in ctx.fleet.items()}
        return claims if all(claims.get(a) == w for a, w in weights.items()) else weights

    def _start_round(self, r: int) -> None:
        """Forget the last round's rows left out (and its anchors) at the first word of round ``r``."""
        if r != self._rows_round:
            for a, c in self._label_counts.items():
                if c.rows >= MIN_ROWS:
                    self._label_past[a] = [*self._label_past.get(a, ()), c][1 - POOLED_ROUNDS:]
            self.rows, self._rows_round, self._anchors = {}, r, {}
            self.labels, self._label_counts, self._label_refs, self._sent = {}, {}, {}, {}
            self._label_s, self._round_t0 = 0.0, time.monotonic()

    def screen_rows(self, ctx: RoundContext, r: int, step: int, rows: Mapping[str, torch.Tensor],
                    assignments: Mapping[str, "Assignment"], labels: Mapping[str, torch.Tensor]) -> set[str]:
        self._start_round(r)
        if self.section.mix_limit and labels:
            self._add_sent(labels, ctx.model.num_classes)
        out = self._screen_sizes(ctx, r, step, rows, assignments)
        if self.section.label_margin != 0:
            t0 = time.monotonic()
            out |= self._screen_labels(ctx, r, step, {a: x for a, x in rows.items() if a not in out},
                                       assignments, labels)
            self._label_s += time.monotonic() - t0
        return out

    def _add_sent(self, labels: Mapping[str, torch.Tensor], classes: int) -> None:
        """Count a step's labels, a count per agent and class, in one pass over them all."""
        ids = tuple(labels)
        if not ids:
            return
        ys = [labels[a].reshape(-1).long().cpu() for a in ids]
        y = torch.cat(ys)
        owner = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([len(x) for x in ys]))
        ok = (y >= 0) & (y < classes)   # out of range was refused at decoding; never counted
        counts = torch.bincount(owner[ok] * classes + y[ok], minlength=len(ids) * classes).view(len(ids), classes)
        mine = self._sent.get(ids)
        self._sent[ids] = counts if mine is None else mine + counts

    @property
    def sent(self) -> dict[str, list[int]]:
        """This round's labels each agent sent, a count per class (checked against its claimed mix)."""
        out: dict[str, list[int]] = {}
        for ids, counts in self._sent.items():
            for a, row in zip(ids, counts.tolist()):
                mine = out.get(a)
                out[a] = row if mine is None else [x + k for x, k in zip(mine, row)]
        return out

    def _add_counts(self, agent: str, counts: list[int]) -> None:
        """A server worker's count of ``agent``'s labels, added to this round's."""
        mine = self._sent.get((agent,))
        row = torch.tensor([counts], dtype=torch.long)
        self._sent[(agent,)] = row if mine is None else mine + row

    def _check_mixes(self, ctx: RoundContext, r: int, took_part: Sequence[str]) -> None:
        """Each agent's claimed mix of classes against the labels it sent this round
        (:mod:`sfl_core.options.robust.mix`): a refuted claim is named, flagged, and replaced for
        the planners by the mix it showed, its claimed total kept."""
        limit = self.section.mix_limit
        refuted: dict[str, float] = {}
        sent_by = self.sent
        for a in took_part:
            info, sent = ctx.fleet.get(a), sent_by.get(a)
            if info is None or not sent or len(info.label_counts) != len(sent):
                continue
            z = deviations(info.label_counts, sent)
            if z <= limit:
                continue
            refuted[a] = z
            shown = shown_mix(sent, int(info.num_samples))
            ctx.log(f"robust: round {r}: the mix of classes {a} registered disagrees with the labels it sent "
                    f"({sum(sent)} labels, " + ("one of a class it claimed none of" if math.isinf(z) else
                                                f"{z:.1f} standard deviations of chance from its claim")
                    + f", limit {limit:g}): planned from now on by the mix it showed "
                    f"({_mix_text(shown)} of {int(info.num_samples)}, against {_mix_text(info.label_counts)})",
                    warning=True)
            ctx.correct_mix(a, shown)
        if refuted:
            self.last["mix_refuted"] = {a: (round(z, 1) if math.isfinite(z) else "a class claimed none of")
                                        for a, z in sorted(refuted.items())}

    def after_round(self, ctx: RoundContext, r: int) -> None:
        """Say once what the label screen costs, where it took most of a round (:data:`SCREEN_NOTICE_S`)."""
        if self._noticed or r != self._rows_round or self._label_s < SCREEN_NOTICE_S:
            return
        steps_s = time.monotonic() - self._round_t0
        if self._label_s < SCREEN_NOTICE_SHARE * steps_s:
            return
        self._noticed = True
        why = (" (with BatchNorm in the devices' layers, each device's own mix of held-out samples runs through "
               "the client portion at its first steps; with norm_stats.freeze_after they run once a round)"
               if any(self._matched.values()) else "")
        ctx.log(f"robust: round {r}: the label screen took {self._label_s:.1f} s of the round's {steps_s:.1f} s of "
                f"steps{why}; robust.label_margin: 0 turns it off (docs/scaling.md)")

    def rows_trained(self, ctx: RoundContext, r: int, step: int, rows: Mapping[str, torch.Tensor],
                     labels: Mapping[str, torch.Tensor]) -> dict[str, RowsTrained]:
        """A row sent twice in a step trained on once (``repeated_rows: once``;
        :mod:`sfl_core.options.robust.repeats`)."""
        if self.section.repeated_rows != "once":
            return {}
        found = {a: repeats(rows[a], y) for a, y in labels.items() if a in rows}
        return {a: narrowed for a, narrowed in found.items() if narrowed is not None}

    def _matched_at(self, ctx: RoundContext, split: int) -> bool:
        """Whether the label screen's reference at ``split`` is matched (BatchNorm), decided once per split."""
        if split not in self._matched:
            self._matched[split] = bool(batch_norm_layers(ctx.model.client(split)))
        return self._matched[split]

    def _screen_labels(self, ctx: RoundContext, r: int, step: int, rows: Mapping[str, torch.Tensor],
                       assignments: Mapping[str, "Assignment"], labels: Mapping[str, torch.Tensor]) -> set[str]:
        """The label screen (:mod:`sfl_core.options.robust.labels`): each agent's rows are judged
        from the round's first steps until it has sent :data:`~sfl_core.options.robust.labels.MIN_ROWS`
        (its client portion is still the round's, the one the held-out rows ran through); an agent
        whose labels disagree with its inputs has its rows left out for the rest of the round."""
        at_cut: dict[tuple[int, int], tuple[Reference, list[tuple[str, torch.Tensor, torch.Tensor]]]] = {}
        whole: set[str] = set()   # agents whose step repeated rows: all their data is in it
        for a, x in rows.items():
            so_far = self._label_counts.get(a, LabelCount())
            if a in self.labels or a not in labels or so_far.rows >= MIN_ROWS or so_far.whole:
                continue
            cut = (assignments[a].split, assignments[a].width)
            matched = self._matched_at(ctx, cut[0])
            if cut not in self._label_refs and matched:   # each device's mix run apart: only the labels now
                held_y = ctx.held_out_labels()
                self._label_refs[cut] = None if held_y is None else (held_y, None)
            elif cut not in self._label_refs:
                ref = ctx.labelled_reference(*cut)
                self._label_refs[cut] = None if ref is None else (
                    ref[1], class_centroids(ref[0], ref[1], ctx.model.num_classes))
            held = self._label_refs[cut]
            if held is None:
                continue
            sent = labels[a].cpu()
            x, y, repeated = distinct(x.cpu(), sent)   # a row sent twice counted once
            if repeated and _holds_all(ctx, a, len(y)):
                whole.add(a)
            if held[1] is None:   # held-out samples of the batch's mix as it ran, normalised as one batch like it
                select = matched_selection(sent, held[0], ctx.model.num_classes)
                ref = ctx.labelled_reference(*cut, select=select) if len(select) else None
                self._label_counts.setdefault(a, LabelCount()).add(
                    count_far(x, y, *ref) if ref is not None else LabelCount())
            else:
                at_cut.setdefault(cut, (held[1], []))[1].append((a, x, y))
        for reference, judged_here in at_cut.values():   # the devices of a cut counted together
            for (a, _, _), found in zip(judged_here, count_each([(x, y) for _, x, y in judged_here], reference)):
                self._label_counts.setdefault(a, LabelCount()).add(found)
        for a in whole:
            self._label_counts.setdefault(a, LabelCount()).whole = True
        margin = self.section.label_screen()
        judged = {a: c for a, c in self._label_counts.items() if a not in self.labels}
        images = {a: int(getattr(ctx.fleet.get(a), "num_samples", 0)) for a in judged}
        for a, verdict in judge(judged, self._label_past, margin, images=images).items():
            c, excess = verdict.count, verdict.excess
            when = f" over its last {verdict.rounds} rounds" if verdict.rounds > 1 else ""
            ctx.log(f"robust: round {r}: rows of {a} left out of the server's steps from step {step}: its "
                    f"labels disagree with its inputs{when} ({c.mismatched} of {c.rows} rows unlike the held-out "
                    f"rows of their label at its cut, {c.expected:.1f} expected; over by {excess:.2f}, limit "
                    f"{margin:g}; {c.significance:.1f} standard deviations of chance); its update is left out "
                    f"of the round's average", warning=True)
            self.labels[a] = (0, excess)
        out = {a for a in rows if a in self.labels}
        for a in out:
            self.labels[a] = (self.labels[a][0] + 1, self.labels[a][1])
        return out

    def _screen_sizes(self, ctx: RoundContext, r: int, step: int, rows: Mapping[str, torch.Tensor],
                      assignments: Mapping[str, "Assignment"]) -> set[str]:
        factor = self.section.activation_factor
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
        if self._rows_round != r:
            return {}
        found: dict[str, Any] = {key: {a: [steps, x] for a, (steps, x) in mine.items()}
                                 for key, mine in (("rows", self.rows), ("labels", self.labels)) if mine}
        if self._sent:
            found["sent"] = self.sent
        return found

    def merge_worker_findings(self, ctx: RoundContext, r: int, findings: Mapping[str, Any]) -> None:
        """A worker's agents whose rows it left out: their updates are left out here, they are
        named in the leader's log and metrics and counted towards quarantine, as the leader's own."""
        if not isinstance(findings, Mapping):
            return
        self._start_round(r)
        sent = findings.get("sent")
        for a, counts in (sent.items() if isinstance(sent, Mapping) else ()):
            if isinstance(a, str) and isinstance(counts, list) and len(counts) == ctx.model.num_classes \
                    and all(isinstance(k, int) and 0 <= k for k in counts):
                self._add_counts(a, counts)
            else:
                ctx.log(f"robust: round {r}: a server worker's label counts for {a!r} are malformed; ignored",
                        warning=True)
        for key, why in (("rows", "activations {:.3g}x the typical size at its cut"),
                         ("labels", "labels disagree with its inputs, over the expected share by {:.2f}")):
            found_by = findings.get(key)
            for a, found in (found_by.items() if isinstance(found_by, Mapping) else ()):
                if not (isinstance(a, str) and isinstance(found, (list, tuple)) and len(found) == 2
                        and isinstance(found[0], int) and found[0] > 0 and isinstance(found[1], (int, float))
                        and math.isfinite(found[1]) and found[1] >= 0):
                    ctx.log(f"robust: round {r}: a server worker's finding for {a!r} is malformed; ignored",
                            warning=True)
                    continue
                steps, x = int(found[0]), float(found[1])
                ctx.log(f"robust: round {r}: a server worker left the rows of {a} out of {steps} of its steps "
                        f"({why.format(x)}); its update is left out of the round's average", warning=True)
                if key == "rows":
                    mine = self.rows.get(a, (0, 1.0))
                    self.rows[a] = (mine[0] + steps, x if _farther(x, mine[1]) else mine[1])
                else:
                    mine = self.labels.get(a, (0, 0.0))
                    self.labels[a] = (mine[0] + steps, max(x, mine[1]))

    def screen(self, ctx: RoundContext, r: int, start: Mapping[str, torch.Tensor],
               clients: dict[str, dict[str, torch.Tensor]], weights: dict[str, float],
               assignments: Mapping[str, "Assignment"],
               refused: Mapping[str, str]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float]]:
        s = self.section
        self.last = {}
        implausible: set[str] = set()   # capped claims that count towards quarantine
        if refused:   # what it sent was refused at decoding (and logged there): flagged like a clipped update
            self.last["refused"] = dict(sorted(refused.items()))
        this_round = self._rows_round == r
        rows = {a: v for a, v in self.rows.items() if a in weights and this_round}
        labelled = {a: v for a, v in self.labels.items() if a in weights and this_round}
        if rows or labelled:   # a device that lied to the server's step: its update is not let in either
            steps = {a: n for a, (n, _) in labelled.items()}
            for a, (n, _) in rows.items():
                steps[a] = steps.get(a, 0) + n
            self.last["rows_left_out"] = steps
            if rows:
                self.last["activation_scale"] = {a: round(x, 4) for a, (_, x) in rows.items()}
            if labelled:
                self.last["label_mismatch"] = {a: round(x, 4) for a, (_, x) in labelled.items()}
            clients = {a: c for a, c in clients.items() if a not in steps}
        bounded = capped_weights(weights, s.weight_cap, self._cap_median_over(ctx, weights))
        capped = sorted(a for a in weights if bounded[a] < weights[a])
        if capped:
            self.last["capped"] = {a: weights[a] for a in capped}
            implausible = {a for a in capped if weights[a] > IMPLAUSIBLE * bounded[a]}
            ctx.log(f"robust: round {r}: weight capped at {s.weight_cap:g}x the median weight for "
                    f"{', '.join(capped)} (claimed {', '.join(f'{weights[a]:g}' for a in capped)})"
                    + (f"; over {IMPLAUSIBLE:g}x the cap, counted towards quarantine: "
                       f"{', '.join(sorted(implausible))}" if implausible else ""), warning=True)
        ids = list(clients)
        if s.aggregate == "clip" and len(ids) > 1:
            changes = measure_changes(start, [clients[a] for a in ids], [change_scale(assignments[a]) for a in ids])
            typical = typical_of(changes, self.past_change)
            self.past_change.update(typical)
            sizes = sizes_of(changes, typical)
            over = {a: round(x, 4) for a, x in zip(ids, sizes) if x > s.clip_factor}
            if over:
                self.last["clipped"] = over
                ctx.log(f"robust: round {r}: left out, a change over {s.clip_factor:g}x the round's typical change: "
                        + ", ".join(f"{a} ({x:.3g}x)" for a, x in sorted(over.items())), warning=True)
            replaced = {a: round(x, 4) for a, x in zip(ids, relative_of(changes))
                        if x >= REPLACED and a not in over}
            if replaced:
                self.last["replaced"] = replaced
                ctx.log(f"robust: round {r}: left out, a change as large as the weights it started from "
                        "(they were replaced, not trained): "
                        + ", ".join(f"{a} ({x:.3g}x their size)" for a, x in sorted(replaced.items())), warning=True)
            kept = [i for i, a in enumerate(ids) if a not in over and a not in replaced]
            peers = self._clip_by_peers(ctx, r, [ids[i] for i in kept], changes.subset(kept), assignments)
            clients = {ids[i]: clients[ids[i]] for i in kept if ids[i] not in peers}
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
        if s.mix_limit and self._rows_round == r:
            self._check_mixes(ctx, r, list(weights))
        self._count(ctx, r, list(weights) + [a for a in refused if a not in weights], implausible)
        return clients, {a: bounded[a] for a in clients}

    def _clip_by_peers(self, ctx: RoundContext, r: int, ids: Sequence[str], changes: Changes,
                       assignments: Mapping[str, "Assignment"]) -> dict[str, float]:
        """The agents whose change is over ``peer_factor`` times that of their peers: the round's
        agents given the same assignment (:func:`peer_key`), :data:`PEERS` of them or more. Peers
        train alike, so their honest changes are alike, and the bound can be tight; across the
        round, cuts, widths and batches make honest changes differ tenfold and more, and a change
        scaled by less than ``clip_factor`` passes under the round's bound (named here)."""
        factor = self.section.peer_factor
        out: dict[str, float] = {}
        if not factor:
            return out
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, a in enumerate(ids):
            groups.setdefault(peer_key(assignments[a]), []).append(i)
        for key, group in groups.items():
            if len(group) < PEERS:
                continue
            theirs = changes.subset(group)
            typical = typical_of(theirs, self.past_peer_change.get(key))
            self.past_peer_change.setdefault(key, {}).update(typical)
            out.update({ids[i]: round(x, 4) for i, x in zip(group, sizes_of(theirs, typical)) if x > factor})
        if out:
            self.last["clipped_by_peers"] = dict(sorted(out.items()))
            ctx.log(f"robust: round {r}: left out, a change over {factor:g}x the typical change of its peers (the "
                    "round's agents given the same cut, width, batch and steps): "
                    + ", ".join(f"{a} ({x:.3g}x)" for a, x in sorted(out.items())), warning=True)
        return out

    def _count(self, ctx: RoundContext, r: int, took_part: Sequence[str], implausible: set[str]) -> None:
        """Each agent's flagged rounds in a row (what it sent refused as invalid, a claim over
        :data:`IMPLAUSIBLE` times the weight cap, its update clipped or replaced, a Multi-Krum
        outlier, or its rows left out of a server step); quarantine at ``quarantine`` of them.
        ``implausible``: the round's capped agents whose claims count."""
        flagged = flagged_in(self.last) | implausible
        for a in took_part:
            self.streak[a] = self.streak.get(a, 0) + 1 if a in flagged else 0
            k = self.section.quarantine
            if k and self.streak[a] >= k:
                what = ", ".join(x.replace("_", " ") for x in FLAGS if a in self.last.get(x, ()))
                ctx.quarantine(a, f"flagged by robust aggregation in {self.streak[a]} of its rounds in a row "
                                  f"(round {r}: {what})")
                self.last.setdefault("quarantined", []).append(a)
                self.streak[a] = 0
                self._label_past.pop(a, None)   # readmitted, it starts afresh
                self._label_counts.pop(a, None)

    def aggregate(self, ctx: RoundContext, states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
                  defaults: Mapping[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        if self.section.aggregate == "median":
            return coordinate_median(states, defaults)
        if self.section.aggregate == "trimmed_mean":
            return trimmed_mean(states, self.section.trim, defaults)
        return None

    def round_metrics(self) -> dict[str, Any]:
        return dict(self.last)
