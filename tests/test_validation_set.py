"""The server's validation set: how the global model is scored (coordinator/validation.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coordinator.validation import ValidationSet
from sfl_core.data.builtin import load_dataset
from sfl_core.model.zoo import build_model


def _plain_scores(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The textbook evaluation: the whole set, contiguous, in one batch."""
    model.eval()
    with torch.no_grad():
        logits = model(x)
    model.train()
    return float((logits.argmax(1) == y).float().mean()), float(F.cross_entropy(logits, y))


def _trained_cnn(x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model("small_cnn", tuple(x.shape[1:]), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in list(range(0, len(y) - 32, 32)) * 3:
        opt.zero_grad()
        F.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
        opt.step()
    return model


def test_images_are_scored_in_channels_last_order_on_a_cpu_with_the_same_result():
    """A real model trained a little on real digits: the channels-last copy scores it as the
    textbook loop does, and the model itself is neither converted nor left in eval mode."""
    data = load_dataset("digits")
    model = _trained_cnn(data.x_train, data.y_train)
    expected = _plain_scores(model, data.x_test, data.y_test)
    assert 0.3 < expected[0] < 1.0                     # trained, not chance, so the check can fail
    val = ValidationSet(data.x_test, data.y_test)
    accuracy, loss = val.evaluate(model, torch.device("cpu"), 64)
    assert val._channels_last is True
    assert accuracy == pytest.approx(expected[0], abs=1 / len(data.y_test)) and loss == pytest.approx(expected[1], rel=1e-5)
    assert model.training
    assert all(p.is_contiguous() for p in model.parameters())   # training keeps its own order


class _Viewing(torch.nn.Module):
    """A user's model whose forward calls ``.view`` on a feature map: channels-last cannot take it."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.head = torch.nn.Linear(4 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        return self.head(h.view(h.size(0), -1))


def test_a_model_that_cannot_take_channels_last_is_scored_as_it_is():
    torch.manual_seed(0)
    x, y = torch.randn(100, 1, 8, 8), torch.randint(0, 10, (100,))
    model = _Viewing()
    val = ValidationSet(x, y)
    first = val.evaluate(model, torch.device("cpu"), 32)
    assert val._channels_last is False and model.training
    assert first == pytest.approx(_plain_scores(model, x, y), rel=1e-5)
    assert val.evaluate(model, torch.device("cpu"), 32) == first      # not tried again


def test_an_empty_set_scores_nothing():
    assert ValidationSet(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)).evaluate(
        _Viewing(), torch.device("cpu")) == (None, None)
