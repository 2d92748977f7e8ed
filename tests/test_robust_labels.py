"""The label screen's rule (sfl_core/options/robust/labels.py) against hand-computed values."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from statistics import NormalDist

from sfl_core.options.robust.labels import (LabelCount, Verdict, binomial_tail, class_centroids, count_each, judge,
                                             label_outliers)


def _reference():
    # one feature; class 0 at 0, 0, 9; class 1 at 10, 10; class 2 a single row (not judged)
    rows = torch.tensor([[0.0], [0.0], [9.0], [10.0], [10.0], [50.0]])
    return class_centroids(rows, torch.tensor([0, 0, 0, 1, 1, 2]), classes=4)


def test_each_class_centroid_and_its_leave_one_out_mismatch_rate():
    ref = _reference()
    assert ref.centroids[:2].flatten().tolist() == [3.0, 10.0]
    # class 0's row at 9: its class's centroid without it is 0 (9 away), class 1's is 1 away;
    # its rows at 0: their class's centroid without them is 4.5, class 1's 10 away
    assert ref.rates[0].item() == pytest.approx(1 / 3)
    assert ref.rates[1].item() == 0.0
    assert math.isnan(ref.rates[2].item()) and math.isnan(ref.rates[3].item())   # 1 row, none: not judged


def test_a_devices_mismatches_and_the_number_expected_of_its_classes():
    ref = _reference()
    # 1 -> class 0 (2 away against 9), 9 -> class 1 (1 away against 6): a mismatch, 10 -> class 1;
    # a row of class 2 or out of range is not counted
    c, = count_each([(torch.tensor([[1.0], [9.0], [10.0], [50.0], [3.0]]), torch.tensor([0, 0, 1, 2, 7]))], ref)
    assert (c.rows, c.mismatched) == (3, 1) and c.expected == pytest.approx(2 / 3)
    assert c.excess == pytest.approx((1 - 2 / 3) / 3)
    flipped, = count_each([(torch.tensor([[0.0], [10.0]]), torch.tensor([1, 0]))], ref)
    assert (flipped.rows, flipped.mismatched) == (2, 2) and flipped.expected == pytest.approx(1 / 3)
    assert count_each([(torch.tensor([[50.0]]), torch.tensor([2]))], ref) == [LabelCount()]


def test_a_steps_devices_counted_together_are_each_counted_as_alone():
    ref = _reference()
    devices = [(torch.tensor([[1.0], [9.0], [10.0], [50.0], [3.0]]), torch.tensor([0, 0, 1, 2, 7])),
               (torch.tensor([[50.0]]), torch.tensor([2])),                 # nothing judged
               (torch.tensor([[0.0], [10.0]]), torch.tensor([1, 0]))]
    together = count_each(devices, ref)   # as test_a_devices_mismatches_and_the_number_expected_of_its_classes
    assert [(c.rows, c.mismatched) for c in together] == [(3, 1), (0, 0), (2, 2)]
    assert [c.expected for c in together] == pytest.approx([2 / 3, 0.0, 1 / 3])
    assert count_each([], ref) == []


def test_the_nearest_centroid_by_one_matrix_product_is_the_nearest_by_distance():
    """A device's rows go to the judged class whose centroid lies nearest, computed as the least
    ``|m|² - 2 x·m``: the same class the full Euclidean distances give, unjudged classes never."""
    torch.manual_seed(0)
    centres = 3 * torch.randn(10, 1, 5, 5)
    labels = torch.arange(200) % 10
    labels[labels == 7] = 3                                   # class 7 held out of the reference: not judged
    ref = class_centroids(centres[labels] + torch.randn(200, 1, 5, 5), labels, classes=10)
    rows = (centres[torch.arange(64) % 10] + torch.randn(64, 1, 5, 5)).flatten(1)
    known = ~torch.isnan(ref.rates)
    full = torch.cdist(rows, ref.centroids[known]).argmin(1)
    assert torch.equal(ref.nearest(rows), known.nonzero().flatten()[full])
    assert 7 not in ref.nearest(rows).tolist() and len(set(ref.nearest(rows).tolist())) == 9


def test_counts_add_up_over_a_rounds_steps():
    c = LabelCount(10, 2, 1.5)
    c.add(LabelCount(6, 6, 0.5))
    assert (c.rows, c.mismatched, c.expected) == (16, 8, 2.0) and c.excess == pytest.approx(6 / 16)
    assert LabelCount().excess == 0.0 and LabelCount().significance == 0.0
    assert LabelCount(16, 1, 0.0).significance == math.inf   # no mismatch expected, one found
    assert LabelCount(16, 2, 2.0).significance == 0.0        # no more than expected


def test_chance_is_the_binomials_exact_tail_in_standard_deviations_of_a_normal_tail_as_unlikely():
    def tail(k, n, p):   # the sum of the binomial's terms from k up, in exact fractions
        p = Fraction(p).limit_denominator(1000)
        return float(sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1)))

    assert binomial_tail(1, 2, 0.5) == pytest.approx(0.75) and binomial_tail(0, 5, 0.1) == 1.0
    assert binomial_tail(6, 5, 0.1) == 0.0 and binomial_tail(3, 5, 0.0) == 0.0 and binomial_tail(3, 5, 1.0) == 1.0
    for k, n, p in ((8, 16, 0.125), (31, 96, 0.1), (16, 32, 0.11), (900, 2000, 0.4)):
        assert binomial_tail(k, n, p) == pytest.approx(tail(k, n, p), rel=1e-9)
    assert 0.0 < binomial_tail(1500, 2000, 0.4) < 1e-100   # no overflow where the terms' factors would
    # 8 of 16 rows at 2 expected: a tail of 0.00030, as unlikely as 3.43 deviations
    assert LabelCount(16, 8, 2.0).significance == pytest.approx(-NormalDist().inv_cdf(tail(8, 16, 0.125)))
    # an honest device of the engine tests' fleet: 6 of 16 rows where 1.3 were expected lie 4.3
    # deviations over by the normal approximation (the binomial's standard deviation), 3.1 by the tail
    honest = LabelCount(16, 6, 1.3)
    assert (6 - 1.3) / (16 * (1.3 / 16) * (1 - 1.3 / 16)) ** 0.5 > 4 > 3.2 > honest.significance > 3.0


def test_a_share_over_the_margin_that_chance_explains_is_not_flagged():
    # 16 rows each mismatching with chance 0.11: 1.76 expected; 6 found is (6 - 1.76) / 16 = 0.265
    # over the expected share but as likely as 2.55 deviations
    chance = LabelCount(16, 6, 1.76)
    # a backdoor's 32 rows, half triggered: 16 found against 3.52 expected, 5.33 deviations
    backdoor = LabelCount(32, 16, 3.52)
    honest = {f"h{i}": LabelCount(32, 4, 3.52) for i in range(3)}
    assert label_outliers({"chance": chance, "backdoor": backdoor, **honest}, 0.2) == {"backdoor": 0.39}
    assert label_outliers({"chance": chance, "backdoor": backdoor, **honest}, 0.2, significance=2.5) == \
        {"backdoor": 0.39, "chance": 0.265}


def test_a_device_is_judged_on_this_rounds_rows_and_on_them_pooled_with_its_last_rounds():
    # a backdoor whose 32 rows of a round lie 0.25-0.45 over: alone it passes in its unlucky round
    unlucky = LabelCount(32, 12, 4.0)     # (12 - 4) / 32 = 0.25 over: under the margin
    past = {"backdoor": [LabelCount(32, 18, 4.0), LabelCount(32, 16, 4.0)],
            "honest": [LabelCount(32, 6, 4.0), LabelCount(32, 3, 4.0)],
            "flipper": [LabelCount(32, 4, 4.0)]}
    now = {"backdoor": unlucky, "honest": LabelCount(32, 5, 4.0),
           "flipper": LabelCount(32, 30, 4.0),           # over alone: judged on this round
           "new": LabelCount(32, 5, 4.0),                # no past: this round alone
           "few": LabelCount(8, 8, 0.0)}                 # too few rows yet, whatever its past
    past["few"] = [LabelCount(32, 32, 4.0)] * 2
    # pooled: (18 + 16 + 12 - 12) / 96 = 0.354 over, 8.4 deviations
    assert judge(now, past, 0.3) == {
        "backdoor": Verdict(0.3542, LabelCount(96, 46, 12.0), 3),
        "flipper": Verdict(0.8125, now["flipper"], 1)}
    assert judge(now, {}, 0.3) == {"flipper": Verdict(0.8125, now["flipper"], 1)}   # as before pooling
    # a device flagged twice whose rows of this round mismatch less than expected is not flagged
    # on its past: (32 + 32 + 3 - 12) / 96 = 0.57 over pooled, but this round's 3 are under 4
    flagged_twice = [LabelCount(32, 32, 4.0)] * 2
    assert judge({"odd": LabelCount(32, 3, 4.0), **now}, {**past, "odd": flagged_twice}, 0.3).keys() == \
        {"backdoor", "flipper"}
    # rows that mismatch more than expected are pooled: (32 + 32 + 6 - 12) / 96 = 0.604
    honest = {"h1": LabelCount(32, 5, 4.0), "h2": LabelCount(32, 4, 4.0)}
    assert judge({"odd": LabelCount(32, 6, 4.0), **honest}, {"odd": flagged_twice}, 0.3) == \
        {"odd": Verdict(0.6042, LabelCount(96, 70, 12.0), 3)}
    # the guard holds for the pooled judgement too: never most of the devices judged
    assert judge({"a": unlucky, "b": unlucky}, {"a": past["backdoor"], "b": past["backdoor"]}, 0.3) == {}


def test_outliers_are_the_devices_over_the_margin_never_most_of_them():
    counts = {"flipper": LabelCount(32, 30, 4.0),    # (30 - 4) / 32 = 0.8125 over
              "honest": LabelCount(32, 9, 6.0),      # 0.09 over
              "skewed": LabelCount(32, 2, 5.0),      # under what its classes lead to expect
              "few": LabelCount(8, 8, 0.0)}          # under MIN_ROWS rows: not judged yet
    assert label_outliers(counts, 0.3) == {"flipper": 0.8125}
    assert label_outliers(counts, 0.9) == {}
    # more than half of those judged over the margin: the held-out data is not the fleet's
    assert label_outliers({**counts, "honest": LabelCount(32, 32, 0.0)}, 0.3) == {}
    with pytest.raises(ValueError):
        label_outliers(counts, 0.0)


def test_auto_screens_labels_at_one_margin_and_a_set_margin_overrides_it():
    from sfl_core.config.run import ConfigError, run_config_from_dict

    def robust(extra=None):
        return run_config_from_dict({"model": "small_cnn", "min_agents": 2, **(extra or {})}).sections["robust"]

    auto = robust()
    assert auto.label_margin == "auto"
    assert auto.label_screen() == 0.2
    assert robust({"robust": {"label_margin": 0.5}}).label_screen() == 0.5
    assert robust({"robust": {"label_margin": 0}}).label_screen() == 0
    for bad in (1, -0.1, "on"):
        with pytest.raises(ConfigError, match="label_margin"):
            robust({"robust": {"label_margin": bad}})


def test_a_matched_reference_takes_the_devices_mix_of_classes():
    from sfl_core.options.robust.labels import matched_selection

    held = torch.tensor([0] * 10 + [1] * 10 + [2] * 3)
    # 6 of class 0 and 2 of class 1: all 10 of class 0 and 10 * 2/6 of class 1; class 2 has too
    # few held-out samples to be judged, class 3 none
    picked = matched_selection(torch.tensor([0] * 6 + [1] * 2 + [2] * 4 + [3]), held, classes=4)
    assert torch.bincount(held[picked], minlength=4).tolist() == [10, 4, 0, 0]
    one = matched_selection(torch.tensor([1, 1]), held, classes=4)
    assert held[one].tolist() == [1] * 10
    assert len(matched_selection(torch.tensor([3]), held, classes=4)) == 0


def _matched_host(frozen: bool):
    """An option host around the robust option with a BatchNorm client portion (``vgg_mini``) and
    200 held-out samples, counting the rows of each pass it runs; two agents, a0 and a1, with
    their steps' rows at split 1."""
    from types import SimpleNamespace

    from coordinator.option_host import OptionHost
    from coordinator.validation import ValidationSet
    from sfl_core.config.run import run_config_from_dict
    from sfl_core.model.zoo import build_model
    from sfl_core.options.base import ServerTerms
    from sfl_core.options.robust.option import Robust

    torch.manual_seed(0)
    model = build_model("vgg_mini:width=0.25", (1, 16, 16), _CLASSES)

    class Host(OptionHost):
        def __init__(self):
            self.model = model
            self.validation = ValidationSet(torch.randn(200, 1, 16, 16), torch.arange(200) % _CLASSES)
            self._terms = ServerTerms(frozen_norms=frozen)
            self.options = [Robust(run_config_from_dict({"model": "vgg_mini:width=0.25", "min_agents": 2}), model)]
            self.passes: list[int] = []
            self.lines: list[str] = []

        def log(self, text, *, warning=False):
            self.lines.append(text)

        @property
        def fleet(self):
            return {a: SimpleNamespace(num_samples=600) for a in ("a0", "a1")}

        def _run_portion(self, split, index, by_batch):
            self.passes.append(len(index))
            return super()._run_portion(split, index, by_batch)

        def step(self, r: int, k: int, labels: dict[str, torch.Tensor]) -> set[str]:
            assignment = SimpleNamespace(split=1, width=0)
            with torch.no_grad():
                batches = {a: (model.client(1)(torch.randn(len(y), 1, 16, 16)), y) for a, y in labels.items()}
            return self.screen_rows(r, k, {a: SimpleNamespace(assignment=assignment) for a in labels}, batches)

    return Host()


_MIXES = {"a0": torch.tensor([0, 0, 1, 2, 3, 4, 5, 6]), "a1": torch.tensor([7, 7, 7, 8, 8, 9, 9, 9])}


def test_the_matched_screen_runs_each_devices_mix_and_nothing_more():
    """Where the devices' layers normalise by their batch, each device's held-out reference is its
    own mix of classes run as one batch: the screen runs those and no pass over the whole draw
    (it reads only the draw's labels to pick them). Where the devices normalise with the model's
    statistics, a row does not depend on its batch: the whole draw is run once and each mix is
    taken from it, the rows a pass of the mix alone makes."""
    from sfl_core.options.robust.labels import matched_selection

    by_batch = _matched_host(frozen=False)
    by_batch.step(1, 0, _MIXES)
    held = by_batch.held_out_labels()
    assert held is not None and len(held) == 200
    assert by_batch.passes == [len(matched_selection(y, held, _CLASSES)) for y in _MIXES.values()]
    assert all(n < 200 for n in by_batch.passes)
    assert by_batch.options[0]._label_counts["a0"].rows == 8

    frozen = _matched_host(frozen=True)
    frozen.step(1, 0, _MIXES)
    assert sum(frozen.passes) == 200                   # the draw once, for both devices' mixes
    select = matched_selection(_MIXES["a1"], held, _CLASSES)
    rows, picked = frozen.labelled_reference(1, 0, select=select)
    alone = frozen._run_portion(1, frozen._screened()[select], by_batch=False)
    assert torch.allclose(rows, alone, atol=1e-5) and torch.equal(picked, held[select])


def test_the_log_says_once_what_the_label_screen_costs_where_it_took_most_of_a_round(monkeypatch):
    """An operator whose coordinator spends most of a round in the label screen's held-out passes
    is told once, with the choices (turning it off, frozen statistics); not where it took less
    than the notice's seconds, and not again in later rounds."""
    from sfl_core.options.robust import option

    host = _matched_host(frozen=False)
    robust = host.options[0]
    host.step(1, 0, _MIXES)
    robust.after_round(host, 1)
    assert host.lines == []                       # well under a second here
    monkeypatch.setattr(option, "SCREEN_NOTICE_S", 0.0)
    host.step(2, 0, _MIXES)
    robust.after_round(host, 2)
    assert len(host.lines) == 1
    line = host.lines[0]
    assert line.startswith("robust: round 2: the label screen took") and "BatchNorm" in line
    assert "robust.label_margin: 0" in line and "norm_stats.freeze_after" in line
    host.step(3, 0, _MIXES)
    robust.after_round(host, 3)
    assert len(host.lines) == 1                   # once a run


def test_far_rows_against_the_matched_reference_by_hand():
    from sfl_core.options.robust.labels import count_far

    # class 0's held-out rows at 0, 1, 2, 3, 4 (centroid 2); left out of it, each lies
    # |x - (10 - x) / 4| away: 2.5, 1.25, 0, 1.25, 2.5; the 0.9 quantile 2.5, none beyond it
    ref = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0]])
    c = count_far(torch.tensor([[2.0], [4.4], [5.0], [9.0]]), torch.tensor([0, 0, 0, 0]), ref, torch.zeros(5), 0.9)
    assert (c.rows, c.mismatched) == (4, 2) and c.expected == 0.0    # 5 and 9 lie beyond 2.5 from 2
    c = count_far(torch.tensor([[2.0], [8.0]]), torch.tensor([0, 1]), ref, torch.zeros(5), 0.5)
    # bound: the median 1.25; the held-out rows beyond it, 2 of 5: 0.4 expected per row; class 1 has no reference
    assert (c.rows, c.mismatched) == (1, 0) and c.expected == pytest.approx(0.4)


_CLASSES, _EYE = 10, torch.eye(10) * 10.0


def _screen_host(registered: dict[str, int]):
    """An option host around the robust option (``small_cnn``: no BatchNorm, margin 0.2) whose
    held-out rows lie per class 18 at its point and 2 at the next class's (a rate of 0.1 each),
    with the devices' ``registered`` sample counts."""
    from types import SimpleNamespace

    from coordinator.option_host import OptionHost
    from sfl_core.config.run import run_config_from_dict
    from sfl_core.model.zoo import build_model
    from sfl_core.options.robust.option import Robust

    held_y = torch.arange(_CLASSES).repeat_interleave(20)
    held_x = torch.stack([_EYE[(k + (i >= 18)) % _CLASSES] for k in range(_CLASSES) for i in range(20)])

    class Host(OptionHost):
        def __init__(self):
            self.model = build_model("small_cnn", (1, 8, 8), _CLASSES)
            self.options = [Robust(run_config_from_dict({"model": "small_cnn", "min_agents": 2}), self.model)]
            self.lines: list[str] = []

        def log(self, text, *, warning=False):
            self.lines.append(text)

        def reference_rows(self, split, width):
            return None

        def labelled_reference(self, split, width, select=None):
            return held_x, held_y

        @property
        def fleet(self):
            return {a: SimpleNamespace(num_samples=n) for a, n in registered.items()}

    return Host()


def test_the_screen_keeps_each_devices_last_rounds_and_pools_them_only_with_rows_that_lean_its_way():
    """Through the option itself: a device passing its third round alone (12 of 32 rows unlike
    their label, 0.275 over) is flagged on its three rounds together; an honest device with two
    odd rounds behind it is not flagged on them where its rows now match their labels."""
    from types import SimpleNamespace

    classes, eye = _CLASSES, _EYE
    registered: dict[str, int] = {}   # registrations unknown: no device's pooled rows are capped

    def rows(wrong: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(32) % classes
        # each row its own image (identical rows are one, test_a_row_sent_twice_is_counted_once)
        return torch.stack([eye[(k + 5 * (i < wrong)) % classes] + 0.01 * i for i, k in enumerate(y.tolist())]), y

    host, assignment = _screen_host(registered), SimpleNamespace(split=1, width=0)
    agents = {a: SimpleNamespace(assignment=assignment) for a in ("h0", "h1", "h2", "sly", "odd")}
    wrong = {"h0": [0, 0, 0], "h1": [0, 0, 0], "h2": [0, 0, 0],
             "sly": [13, 13, 9],      # 0.306 over twice, then 0.181: (35 - 9.6) / 96 = 0.2646 pooled
             "odd": [32, 32, 0]}      # pooled 0.567 over, but its third round's rows match
    out = [host.screen_rows(r, 0, agents, {a: rows(w[r - 1]) for a, w in wrong.items()}) for r in (1, 2, 3)]
    assert out == [{"sly", "odd"}, {"sly", "odd"}, {"sly"}]
    assert host.options[0].labels == {"sly": (1, 0.2646)}
    assert [line for line in host.lines if "sly" in line and "over its last 3 rounds (35 of 96 rows" in line]


def test_a_row_sent_twice_is_counted_once():
    from sfl_core.options.robust.labels import distinct

    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [2.0, 2.0], [0.0, 1.0], [1.0, 0.0]])
    labels = torch.tensor([3, 4, 3, 5, 7, 3])   # the second [0, 1] under another label: another pair
    x, y, repeated = distinct(rows, labels)
    assert repeated and x.tolist() == [[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [0.0, 1.0]] and y.tolist() == [3, 4, 5, 7]
    x, y, repeated = distinct(rows[:2], labels[:2])
    assert not repeated and x.tolist() == rows[:2].tolist() and y.tolist() == [3, 4]
    # rows that share their largest element and label but differ are not one row
    same_peak = torch.tensor([[2.0, 0.0], [2.0, 1.0], [0.5, 2.0]], dtype=torch.float16)
    x, y, repeated = distinct(same_peak, torch.tensor([6, 6, 6]))
    assert not repeated and x.tolist() == same_peak.tolist() and y.tolist() == [6, 6, 6]
    x, y, repeated = distinct(same_peak[[0, 1, 0]], torch.tensor([6, 6, 6]))
    assert repeated and x.tolist() == same_peak[:2].tolist() and y.tolist() == [6, 6]


def test_a_device_whose_batch_repeats_its_few_images_is_judged_on_them_once():
    """An honest device of 4 images (2 of them odd at the cut) in a batch of 32 sent each 8
    times: 16 of 32 rows mismatched, far over chance as rows, but 2 odd images of 4, too few to
    judge; and nothing of its later steps or past rounds is counted with them. A device of 20
    images, 10 odd, sent 32 rows a step: judged on its 20, and not pooled with its past rounds
    (the same images); a liar whose 20 images are all flipped is still flagged on them."""
    from types import SimpleNamespace

    classes, eye = _CLASSES, _EYE
    # what each registered (a large device's epoch wraps within a step too)
    registered = {"h0": 600, "h1": 600, "h2": 600, "four": 4, "twenty": 20, "liar": 20, "big": 40}

    def images(n: int, odd: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(n) % classes
        return torch.stack([eye[(k + 5 * (i < odd)) % classes] + 0.01 * i for i, k in enumerate(y.tolist())]), y

    def batch(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pick = torch.arange(32) % len(y)
        return x[pick], y[pick]

    def honest() -> tuple[torch.Tensor, torch.Tensor]:
        return images(32, 0)

    host, assignment = _screen_host(registered), SimpleNamespace(split=1, width=0)
    agents = {a: SimpleNamespace(assignment=assignment) for a in ("h0", "h1", "h2", "four", "twenty", "liar", "big")}
    x40, y40 = images(40, 0)
    wrap = (torch.cat([x40[:8], x40[:8]]), torch.cat([y40[:8], y40[:8]]))   # its epoch's end, 8 repeated
    for r in (1, 2, 3):
        for step in (0, 1):
            sent = {"h0": honest(), "h1": honest(), "h2": honest(), "four": batch(*images(4, 2)),
                    "twenty": batch(*images(20, 10)), "liar": batch(*images(20, 20)),
                    "big": wrap if step == 0 else (x40[8:24], y40[8:24])}
            out = host.screen_rows(r, step, agents, sent)
            assert out == {"twenty", "liar"}, (r, step, out)
        counts = host.options[0]._label_counts
        assert (counts["four"].rows, counts["four"].mismatched, counts["four"].whole) == (4, 2, True)
        assert (counts["twenty"].rows, counts["twenty"].mismatched) == (20, 10)
        assert (counts["big"].rows, counts["big"].whole) == (24, False)   # more to show: its next step counted
    assert not [line for line in host.lines if "over its last" in line]
    assert [line for line in host.lines if "rows of twenty" in line and "(10 of 20 rows" in line]


def test_a_device_that_showed_all_its_few_images_is_judged_on_them():
    """A device of 10 images in a batch of 32 (the digits fleet's smallest): its step showed all
    its data, and 10 distinct images are judged, short of 16 rows; a liar of 10 whose images are
    all flipped is flagged, one whose 5 triggered images mismatch where 0.5 were expected is
    flagged only where chance makes that unlikely enough, and an honest one with 2 odd images is
    not. Fewer than 8 images are not judged, however they mismatch."""
    from sfl_core.options.robust.labels import MIN_WHOLE_ROWS, LabelCount, label_outliers

    honest = {f"h{i}": LabelCount(32, 3, 3.2) for i in range(5)}

    def whole(rows: int, mismatched: int, expected: float) -> LabelCount:
        return LabelCount(rows, mismatched, expected, whole=True)

    assert MIN_WHOLE_ROWS == 8
    assert label_outliers({**honest, "flipper": whole(10, 10, 0.5)}, 0.2).keys() == {"flipper"}
    assert label_outliers({**honest, "odd": whole(10, 2, 0.5)}, 0.2) == {}
    assert label_outliers({**honest, "backdoor": whole(10, 5, 0.5)}, 0.2) == {}      # 3.8 deviations of chance
    assert label_outliers({**honest, "backdoor": whole(10, 5, 0.2)}, 0.2).keys() == {"backdoor"}   # rates fall
    assert label_outliers({**honest, "tiny": whole(6, 6, 0.3)}, 0.2) == {}
    assert label_outliers({**honest, "partial": LabelCount(10, 10, 0.5)}, 0.2) == {}   # more to come: wait


def test_a_devices_rounds_pooled_are_the_evidence_of_at_most_its_images():
    from sfl_core.options.robust.labels import LabelCount, Verdict, judge

    c = LabelCount(67, 22, 7.4)
    assert c.at_most(100) is c and c.at_most(0) is c
    scaled = c.at_most(29)
    assert (scaled.rows, scaled.mismatched) == (29, 10) and scaled.expected == pytest.approx(7.4 * 29 / 67)
    # an honest device of 29 images (the hard end's, seed 5): 8 of 22 rows this round, its two
    # rounds before 7 of 22 and 7 of 23; pooled as rows, 22 of 67, 4.4 deviations: flagged
    honest = {f"h{i}": LabelCount(32, 3, 3.2) for i in range(3)}
    now = {"small": LabelCount(22, 8, 2.4), **honest}
    past = {"small": [LabelCount(22, 7, 2.5), LabelCount(23, 7, 2.5)]}
    assert judge(now, past, 0.2).keys() == {"small"}
    assert judge(now, past, 0.2, images={"small": 29, "h0": 600}) == {}       # as 29 images: 3.4
    assert judge(now, past, 0.2, images={"small": 600}).keys() == {"small"}   # a large device: as before
    # a claim its rows belie is not believed: 22 rows this round, the claim 4 taken as 22
    liar = {"liar": LabelCount(22, 22, 2.4), **honest}
    out = judge(liar, {"liar": [LabelCount(22, 22, 2.5)]}, 0.2, images={"liar": 4})
    assert out.keys() == {"liar"} and out["liar"] == Verdict(out["liar"].excess, liar["liar"], 1)


def test_the_leave_one_out_rates_taken_at_once_are_those_of_each_row_taken_alone():
    """Each class's rate, from one sum by class and one matrix product, is the share of its rows
    that lie nearer another class's centroid than their own class's centroid without them, row
    by row with exact distances; labels out of range and a class of one row are left out."""
    torch.manual_seed(1)
    labels = torch.randint(0, 6, (120,))
    labels[:3] = torch.tensor([-1, 6, 9])       # out of range for 6 classes
    labels[labels == 5] = 4
    labels[3] = 5                               # class 5: a single row
    centres = torch.randn(10, 2, 4, 4)
    rows = 0.6 * centres[labels.clamp(0, 9)] + torch.randn(120, 2, 4, 4)
    ref = class_centroids(rows, labels, classes=6)
    f = rows.flatten(1)
    for c in range(6):
        mine = f[labels == c]
        if len(mine) < 2:
            assert math.isnan(ref.rates[c].item()) and math.isnan(ref.centroids[c, 0].item())
            continue
        assert torch.allclose(ref.centroids[c], mine.mean(0), atol=1e-6)
        others = [f[labels == k].mean(0) for k in range(6) if k != c and (labels == k).sum() >= 2]
        missed = 0
        for i in range(len(mine)):
            own = torch.dist(mine[i], torch.cat([mine[:i], mine[i + 1:]]).mean(0))
            missed += int(min(torch.dist(mine[i], m) for m in others) < own)
        assert ref.rates[c].item() == pytest.approx(missed / len(mine))
    assert 0 < ref.rates[:5].mean().item() < 1      # the classes overlap: the rates are not all 0 or 1
