"""HeteroSFL bottleneck layers: shapes at every split of every model, end-to-end equivalence,
narrow agents as prefixes of the wide pair."""

from __future__ import annotations

import pytest
import torch

from sfl_core.model.bottleneck import Bottleneck, bottleneck_shape, slice_state
from sfl_core.model.zoo import MODEL_NAMES, build_model

SHAPES = {"cnn1d": (9, 32)}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_encoder_decoder_shapes_at_every_split(name):
    shape = SHAPES.get(name, (1, 28, 28))
    torch.manual_seed(0)
    probe = build_model(name, shape, 10)
    for s in probe.split_points:
        model = build_model(name, shape, 10)
        act = model.client(s)(torch.zeros(2, *shape)).shape[1:]
        width = max(1, act[0] // 4)
        model.add_bottleneck(s, width)
        model.eval()
        x = torch.randn(2, *shape)
        z = model.client(s)(x)
        assert tuple(z.shape[1:]) == bottleneck_shape(act, width)
        out = model.server(s)(z)
        assert out.shape == (2, 10)
        torch.testing.assert_close(out, model(x))        # the full forward passes the bottleneck too
        keys = set(model.client_keys(s)) | set(model.server_keys(s))
        assert keys == set(model.state_dict())
        assert any(k.startswith(f"bottlenecks.{s}.encoder") for k in model.client_keys(s))
        assert any(k.startswith(f"bottlenecks.{s}.decoder") for k in model.server_keys(s))


def test_narrow_agent_is_a_prefix_of_the_wide_pair():
    torch.manual_seed(0)
    wide = Bottleneck((16, 7, 7), 8)
    narrow = Bottleneck((16, 7, 7), 3)
    state = {f"b.{k}": v for k, v in wide.state_dict().items()}
    narrow.load_state_dict({k[2:]: v for k, v in slice_state(state, "b.", 3).items()})
    h = torch.randn(4, 16, 7, 7)
    torch.testing.assert_close(narrow.encode(h), wide.encode(h, 3))
    z = narrow.encode(h)
    torch.testing.assert_close(narrow.decode(z), wide.decode(z))
    # the narrow path trains exactly the first 3 encoder rows / decoder columns of the wide pair
    wide.zero_grad()
    wide.decode(wide.encode(h, 3)).sum().backward()
    assert wide.encoder.weight.grad[3:].abs().sum() == 0 and wide.encoder.weight.grad[:3].abs().sum() > 0
    assert wide.decoder.weight.grad[:, 3:].abs().sum() == 0


def test_flat_and_sequence_bottlenecks():
    for shape in ((64,), (8, 20)):
        b = Bottleneck(shape, 4)
        z = b.encode(torch.randn(3, *shape))
        assert tuple(z.shape[1:]) == bottleneck_shape(shape, 4)
        assert b.decode(z).shape == (3, *shape)
    with pytest.raises(ValueError, match="width"):
        Bottleneck((4, 2, 2), 5)


def test_client_and_server_halves_expose_exactly_their_bottleneck_parameters():
    """The agent's optimiser steps ``client(s).parameters()``: the encoder must be in it (and
    the decoder must not), or the encoder would silently never train."""
    model = build_model("small_cnn", (1, 8, 8), 10)
    pair = model.add_bottleneck(2, 4)
    client = {id(p) for p in model.client(2).parameters()}
    server = {id(p) for p in model.server(2).parameters()}
    assert {id(p) for p in pair.encoder.parameters()} <= client
    assert not {id(p) for p in pair.decoder.parameters()} & client
    assert {id(p) for p in pair.decoder.parameters()} <= server
    assert not {id(p) for p in pair.encoder.parameters()} & server


def test_a_bottleneck_is_a_layer_of_every_portion_that_spans_it():
    """With a pair at cut 2, an agent cut at 1 (or at the whole model) runs it inside its portion,
    encode and decode at the full model's width, so every cut computes the full model's forward
    and the state splits into exactly the two sides."""
    torch.manual_seed(0)
    model = build_model("small_cnn", (1, 8, 8), 10)
    pair = model.add_bottleneck(2, 8)
    pair.infer_width = 6
    model.eval()
    x = torch.randn(3, 1, 8, 8)
    for s in model.valid_splits:
        z = model.client(s)(x)
        if s == 2:   # the encoder's full width crosses the link; the full model runs the first 6 channels
            z = z[:, :6]
        torch.testing.assert_close(model.server(s)(z), model(x))
        client, server = set(model.client_keys(s)), set(model.server_keys(s))
        assert client | server == set(model.state_dict()) and not client & server
        pair_keys = {k for k in model.state_dict() if k.startswith("bottlenecks.2.")}
        assert pair_keys <= (server if s < 2 else client if s > 2 else client | server)


def test_the_model_runs_the_widest_width_trained_on_every_class():
    """Two groups: the wide one (width 16) never sees class 2, so its channels must not be
    evaluated; once a wide agent holds class 2 too (a little is enough), they are."""
    from sfl_core.model.bottleneck import covered_width

    counts = {"n1": [10, 10, 10], "n2": [0, 0, 50], "w1": [40, 40, 0]}
    assert covered_width({"n1": 1, "n2": 1, "w1": 16}, counts, [50, 50, 60]) == 1
    counts["w1"] = [40, 40, 1]
    assert covered_width({"n1": 1, "n2": 1, "w1": 16}, counts, [50, 50, 61]) == 16
    assert covered_width({"a": 4, "b": 8}, {"a": [], "b": []}, [5, 5]) == 8   # unknown counts: the widest
    assert covered_width({"a": 4, "b": 8}, {"a": [1, 1], "b": [2, 0]}, [3, 1]) == 4
