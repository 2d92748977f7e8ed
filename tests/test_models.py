"""Tests for the splittable model zoo (sfl_core.model.zoo)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sfl_core.model.zoo import MODEL_NAMES, SplitModel, build_model

IMAGE_SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]
CASES = [(n, s) for n in MODEL_NAMES if n != "cnn1d" for s in IMAGE_SHAPES] + [
    ("cnn1d", (9, 128)),
    ("cnn1d", (3, 50)),
]


def _build(name: str, shape: tuple[int, ...], classes: int = 7) -> SplitModel:
    torch.manual_seed(0)
    return build_model(name, shape, classes)


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_forward_split_equivalence_and_keys(name: str, shape: tuple[int, ...]) -> None:
    model = _build(name, shape).eval()
    assert model.name == name and model.input_shape == shape and model.num_classes == 7
    assert len(model.block_names) == model.num_blocks == len(set(model.block_names))
    assert model.split_points == tuple(range(1, model.num_blocks))
    assert model.default_split in model.split_points
    x = torch.randn(2, *shape)
    with torch.no_grad():
        y = model(x)
        assert y.shape == (2, 7)
        assert torch.isfinite(y).all()
        all_keys = set(model.state_dict())
        for s in model.split_points + (model.num_blocks,):
            act = model.client(s)(x)
            out = model.server(s)(act)
            torch.testing.assert_close(out, y, rtol=1e-5, atol=1e-6)
            ck, sk = set(model.client_keys(s)), set(model.server_keys(s))
            assert ck | sk == all_keys and not (ck & sk)
            assert set(model.client_state(s)) == ck and set(model.server_state(s)) == sk
    # whole model on the agent: server side is empty
    assert len(model.server(model.num_blocks)) == 0
    assert model.server_keys(model.num_blocks) == []


def test_train_mode_backward_through_split() -> None:
    """Gradients of the split pipeline equal those of the whole model."""
    model = _build("resnet8", (1, 8, 8), 10)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    nn.functional.cross_entropy(model(x), y).backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model2 = _build("resnet8", (1, 8, 8), 10)
    s = model2.default_split
    act = model2.client(s)(x)
    sent = act.detach().requires_grad_(True)  # what crosses the network
    nn.functional.cross_entropy(model2.server(s)(sent), y).backward()
    act.backward(sent.grad)
    for k, p in model2.named_parameters():
        torch.testing.assert_close(p.grad, ref[k], rtol=1e-4, atol=1e-6)


def test_client_server_share_modules_and_state_is_a_subset() -> None:
    model = _build("small_cnn", (1, 8, 8))
    client = model.client(2)
    assert client[0] is model.blocks[0] and client[1] is model.blocks[1]
    with torch.no_grad():
        client[0][0].weight.add_(1.0)
    sd = model.state_dict()
    cs = model.client_state(2)
    assert all(k.startswith(("blocks.0.", "blocks.1.")) for k in cs)
    for k, v in cs.items():
        assert torch.equal(v, sd[k]) and not v.requires_grad


def test_buffers_are_in_client_keys() -> None:
    model = _build("resnet8", (3, 32, 32))
    keys = model.client_keys(1)
    assert "blocks.0.1.running_mean" in keys and "blocks.0.1.num_batches_tracked" in keys


def test_deterministic_given_seed() -> None:
    a, b = _build("vgg11", (1, 8, 8)), _build("vgg11", (1, 8, 8))
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_small_cnn_learns_digits_quickly() -> None:
    """small_cnn must train fast on CPU on 8x8 sklearn digits (used by the demo)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target)
    model = _build("small_cnn", (1, 8, 8), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for idx in torch.randperm(1500, generator=g).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        acc = (model(x[1500:]).argmax(1) == y[1500:]).float().mean().item()
    assert acc > 0.85


def test_unknown_model_lists_names() -> None:
    with pytest.raises(ValueError) as e:
        build_model("resnet50", (3, 32, 32), 10)
    for n in MODEL_NAMES:
        assert n in str(e.value)


@pytest.mark.parametrize(
    "name,shape,classes",
    [
        ("cnn1d", (1, 28, 28), 10),  # image shape to the 1-D model
        ("vgg11", (9, 128), 10),  # sensor shape to an image model
        ("small_cnn", (1, 0, 8), 10),
        ("small_cnn", (1, 8, 8), 0),
        ("resnet8", (3, 32.5, 32), 10),
    ],
)
def test_bad_shapes_raise(name: str, shape: tuple, classes: int) -> None:
    with pytest.raises(ValueError, match=name):
        build_model(name, shape, classes)


@pytest.mark.parametrize("bad", [0, -1, 99, 2.0, True, "1"])
def test_bad_split_names_valid_options(bad: object) -> None:
    model = _build("alexnet", (1, 8, 8))
    for fn in (model.client, model.server, model.client_keys, model.server_keys, model.check_split):
        with pytest.raises(ValueError) as e:
            fn(bad)  # type: ignore[arg-type]
        msg = str(e.value)
        assert "alexnet" in msg and repr(bad) in msg
        assert str(list(range(1, model.num_blocks + 1))) in msg


def test_split_model_rejects_bad_construction() -> None:
    blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(ValueError, match="outside"):
        SplitModel("toy", blocks, [0, 1], 1, (2,), 2)
    with pytest.raises(ValueError, match="block names"):
        SplitModel("toy", blocks, [1], 1, (2,), 2, block_names=["a"])
    with pytest.raises(ValueError, match="invalid split point"):
        SplitModel("toy", blocks, [1], 5, (2,), 2)
