"""The server portion's screen (:mod:`sfl_core.options.robust.rows`) against hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from sfl_core.options.robust.rows import cut_sizes, far_rows, rms, typical_size


def test_sizes_are_compared_within_a_cut_that_three_devices_share():
    rows = {"a": torch.full((4, 2), 1.0), "b": torch.full((4, 2), 2.0), "c": torch.full((4, 2), -3.0),
            "d": torch.full((4, 8), 5.0), "e": torch.full((4, 8), 5.0)}
    cut = {"a": (1, 0), "b": (1, 0), "c": (1, 0), "d": (2, 0), "e": (2, 0)}
    sizes = cut_sizes(rows, cut)
    assert list(sizes) == [(1, 0)]   # (2, 0): two holders only
    assert sizes[(1, 0)] == pytest.approx({"a": 1.0, "b": 2.0, "c": 3.0}, rel=1e-6)   # a float32 norm
    assert rms(torch.empty(0)) == 0.0


def test_far_rows_lie_beyond_the_factor_either_way():
    sizes = {"a": 1.0, "b": 1.5, "c": 0.2, "d": 4.1}
    assert far_rows(sizes, 1.0, 4.0) == {"c": 0.2, "d": 4.1}
    assert far_rows(sizes, 0.0, 4.0) == far_rows(sizes, float("inf"), 4.0) == {}
    assert far_rows({"a": 1.0, "b": 9.0, "c": 10.0}, 1.0, 4.0) == {}    # never most of the cut
    with pytest.raises(ValueError):
        far_rows(sizes, 1.0, 1.0)


def test_the_typical_size_is_the_median_while_the_step_agrees_with_itself_and_its_past():
    assert typical_size([1.0, 1.2, 0.9, 10.0], history=1.1, anchor=1.0, factor=4) == pytest.approx(1.1)
    assert typical_size([1.0, 1.2, 0.9], history=None, anchor=None, factor=4) == 1.0


def test_a_step_where_half_lie_takes_the_middle_value_nearest_the_coordinators_own():
    honest, liars = [1.0, 1.1, 0.9, 1.2, 1.05], [10.0, 11.0, 9.5, 12.0, 10.5]
    # the median of ten is between the two halves (5.35): it would flag everyone
    assert typical_size(honest + liars, history=None, anchor=0.8, factor=4) == 1.2
    assert typical_size(honest + liars, history=None, anchor=None, factor=4) == pytest.approx(5.35)


def test_a_step_where_most_lie_keeps_the_past_size_the_coordinators_own_agrees_with():
    sizes = [1.0, 1.1, 10.0, 11.0, 12.0]
    assert typical_size(sizes, history=1.05, anchor=1.3, factor=4) == 1.05
    # every device's activations grew together (the coordinator's own did too): the step stands
    assert typical_size([9.0, 10.0, 11.0], history=1.0, anchor=10.5, factor=4) == 10.0


def test_the_coordinators_own_activations_leave_its_model_and_random_streams_alone(tmp_path):
    """A user's model may hold dropout and BatchNorm: the reference pass must not move the run's
    random stream nor the model's running statistics (an honest run is the same with the screen)."""
    from torch import nn

    from coordinator.option_host import OptionHost
    from coordinator.validation import ValidationSet
    from sfl_core.options.base import ServerTerms

    class Host(OptionHost):
        def __init__(self, model):
            self.model, self.validation = model, ValidationSet(torch.randn(80, 4), torch.zeros(80, dtype=torch.long))
            self._terms = ServerTerms()   # no option changes how the devices normalise

    class Model(nn.Module):   # the two methods of a SplitModel the pass uses
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5))

        def client(self, split):
            return self.body

    model = Model()
    host = Host(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    out = host.reference_rows(1, 4)
    assert out.shape == (64, 4) and torch.equal(torch.rand(3), expected)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_coordinators_pass_runs_by_the_batch_only_where_a_layer_normalises_by_its_batch():
    """The held-out rows of a client portion come out as one pass over them would give: run a
    cache-sized batch at a time, channels-last on a CPU, where no layer normalises by its batch;
    in one batch where one does (BatchNorm in training mode), as the device normalises its own."""
    import copy

    from torch import nn

    from coordinator.option_host import LABELLED_REFERENCE_ROWS, PASS_ROWS, OptionHost
    from coordinator.validation import ValidationSet, screen_draw
    from sfl_core.options.base import ServerTerms

    torch.manual_seed(0)
    images = torch.randn(3 * PASS_ROWS + 5, 1, 8, 8)

    class Host(OptionHost):
        def __init__(self, body, frozen):
            self.model, self.validation = body, ValidationSet(images, torch.arange(len(images)) % 10)
            self._terms = ServerTerms(frozen_norms=frozen)

    body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    body.client = lambda split: body
    with torch.no_grad():
        body[1].running_mean.fill_(0.5)
        as_one = copy.deepcopy(body).train()(images)
        by_chunk = torch.cat([copy.deepcopy(body).train()(images[i:i + PASS_ROWS])
                              for i in range(0, len(images), PASS_ROWS)])
        frozen = body.eval()(images)
    body.train()
    rows, labels = Host(body, frozen=False).labelled_reference(1, 0)
    order = screen_draw(len(images), LABELLED_REFERENCE_ROWS)   # all of them, in the screens' order
    assert len(images) < LABELLED_REFERENCE_ROWS and torch.equal(labels, order % 10)
    assert torch.allclose(rows, as_one[order], atol=1e-5)        # the batch's own statistics: one batch
    assert not torch.allclose(by_chunk, as_one, atol=1e-3)   # chunks would have normalised otherwise
    host = Host(body, frozen=True)
    assert torch.allclose(host.labelled_reference(1, 0)[0], frozen[order], atol=1e-5)   # running statistics: by chunks
    assert host.validation._channels_last is True and rows.is_contiguous()
    assert torch.allclose(host.labelled_reference(1, 0, select=torch.tensor([7, 2]))[0], frozen[order[[7, 2]]],
                          atol=1e-5)


def test_the_screens_read_a_fixed_random_draw_of_the_held_out_set_not_its_first_samples():
    """A held-out set read class by class (a folder of images) or by source (MNIST's test set)
    would give the screens a reference of a part of the data: every class must be judged, and a
    server worker holding the leader's set must read the leader's draw, in its order."""
    from torch import nn

    from coordinator.option_host import LABELLED_REFERENCE_ROWS, REFERENCE_ROWS, OptionHost
    from coordinator.validation import ValidationSet, screen_draw
    from sfl_core.options.base import ServerTerms

    n = 10 * LABELLED_REFERENCE_ROWS
    images, labels = torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n) * 10 // n   # sorted by class

    class Host(OptionHost):
        def __init__(self, x, y):
            self.model, self.validation = body, ValidationSet(x, y)
            self._terms = ServerTerms()

    body = nn.Linear(1, 1, bias=False)   # each row is its sample's index
    nn.init.ones_(body.weight)
    body.client = lambda split: body
    leader = Host(images, labels)
    rows, held = leader.labelled_reference(1, 0)
    assert len(rows) == LABELLED_REFERENCE_ROWS and len(set(rows.flatten().tolist())) == LABELLED_REFERENCE_ROWS
    assert torch.equal(held, labels[rows.flatten().long()])
    assert set(held.tolist()) == set(range(10))                       # the first 512 held class 0 alone
    assert min(torch.bincount(held, minlength=10).tolist()) > 20      # about 51 a class
    anchor = leader.reference_rows(1, 0)
    assert torch.equal(anchor, rows[:REFERENCE_ROWS]) and len(set(labels[anchor.flatten().long()].tolist())) >= 5
    assert torch.equal(leader.labelled_reference(1, 0)[0], rows)                   # the same draw every round
    assert torch.equal(screen_draw(n, LABELLED_REFERENCE_ROWS), screen_draw(n, LABELLED_REFERENCE_ROWS))
    assert torch.equal(leader.labelled_reference(1, 0, select=torch.tensor([7, 2]))[0], rows[[7, 2]])
    worker = Host(images.clone(), labels.clone())
    assert torch.equal(worker.labelled_reference(1, 0)[0], rows) and torch.equal(worker.reference_rows(1, 0), anchor)
    small = Host(images[:100], labels[:100])                          # fewer than the screens read: all, shuffled
    assert sorted(small.labelled_reference(1, 0)[0].flatten().tolist()) == list(range(100))


def test_the_draws_rows_are_run_once_while_the_model_stands():
    """Each round the sizes screen reads the first rows of the draw and the label screen all of
    it: the passes over the first are not run again for the second, the rows are the same as one
    pass over the whole draw (bit for bit), and any update of the model runs them afresh."""
    from torch import nn

    from coordinator.option_host import LABELLED_REFERENCE_ROWS, PASS_ROWS, REFERENCE_ROWS, OptionHost
    from coordinator.validation import ValidationSet
    from sfl_core.options.base import ServerTerms

    torch.manual_seed(0)
    images = torch.randn(LABELLED_REFERENCE_ROWS + 40, 1, 8, 8)

    class Host(OptionHost):
        def __init__(self, body):
            self.model, self.validation = body, ValidationSet(images, torch.arange(len(images)) % 10)
            self._terms = ServerTerms()

    def portion():
        body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU())
        body.client = lambda split: body
        return body

    torch.manual_seed(1)
    body = portion()
    torch.manual_seed(1)
    fresh = Host(portion()).labelled_reference(1, 0)[0]   # one pass over the whole draw
    host, ran = Host(body), []
    original = host._run_portion
    host._run_portion = lambda split, index, by_batch: ran.append(len(index)) or original(split, index, by_batch)
    anchor = host.reference_rows(1, 0)
    rows, _ = host.labelled_reference(1, 0)
    assert ran == [REFERENCE_ROWS, LABELLED_REFERENCE_ROWS - REFERENCE_ROWS] and REFERENCE_ROWS % PASS_ROWS == 0
    assert torch.equal(rows, fresh) and torch.equal(anchor, fresh[:REFERENCE_ROWS])
    assert torch.equal(host.labelled_reference(1, 0)[0], fresh) and torch.equal(host.reference_rows(1, 0), anchor)
    assert torch.equal(host.reference_rows(1, 2), anchor[:, :2])   # a narrower agent's: its first channels
    assert len(ran) == 2                                           # nothing run again
    with torch.no_grad():
        body[0].bias.add_(1.0)                                     # the round's update
    moved = host.reference_rows(1, 0)
    assert ran[2:] == [REFERENCE_ROWS] and not torch.equal(moved, anchor)


def test_only_a_portion_that_runs_alike_in_either_mode_is_scored_on_the_screens_behalf():
    """The score runs the model in inference mode; a device trains its portion: dropout, BatchNorm
    normalising by the batch, or a layer of a user's own make the two differ (or may)."""
    from torch import nn

    from sfl_core.model.norm_layers import runs_alike_in_either_mode as _alike_in_either_mode
    from sfl_core.model.zoo import build_model

    class Own(nn.Module):
        def forward(self, x):
            return x * 2 if self.training else x

    plain = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4, 2))
    assert _alike_in_either_mode(plain, frozen_norms=False)
    assert not _alike_in_either_mode(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), frozen_norms=True)
    norm = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    assert not _alike_in_either_mode(norm, frozen_norms=False) and _alike_in_either_mode(norm, frozen_norms=True)
    assert not _alike_in_either_mode(nn.Sequential(nn.Linear(4, 4), Own()), frozen_norms=True)
    assert _alike_in_either_mode(build_model("small_cnn", (1, 28, 28), 10).client(2), frozen_norms=False)
    assert _alike_in_either_mode(build_model("resnet8", (3, 32, 32), 10).client(3), frozen_norms=True)
