"""Tests for per-split cost accounting (sfl_core.model.accounting)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from sfl_core.model.accounting import SplitCost, block_flops, format_cost_table, model_costs, split_costs
from sfl_core.model.zoo import MODEL_NAMES, SplitModel, build_model

IMAGE_SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]
CASES = [(n, s) for n in MODEL_NAMES if n != "cnn1d" for s in IMAGE_SHAPES] + [("cnn1d", (9, 128))]


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_costs_consistent_with_model(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, 10).eval()
    costs = split_costs(model)
    assert sorted(costs) == list(model.split_points) + [model.num_blocks]
    totals = [c.client_flops + c.server_flops for c in costs.values()]
    assert max(totals) - min(totals) <= 0.01 * max(totals)
    ordered = [costs[s] for s in sorted(costs)]
    for a, b in zip(ordered, ordered[1:]):
        assert b.client_flops > a.client_flops  # every block has a conv or linear layer
        assert b.client_params >= a.client_params and b.client_param_bytes > a.client_param_bytes
    whole = costs[model.num_blocks]
    assert whole.server_flops == 0 and whole.activation_shape == () and whole.activation_bytes == 0
    assert whole.client_params == sum(p.numel() for p in model.parameters())
    sd_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert whole.client_param_bytes == sd_bytes
    x = torch.randn(2, *shape)
    with torch.no_grad():
        for s in model.split_points:
            act = model.client(s)(x)
            c = costs[s]
            assert c.split == s and c.activation_shape == tuple(act.shape[1:])
            assert c.activation_bytes == 4 * math.prod(act.shape[1:])
            assert c.client_params == sum(p.numel() for p in model.client(s).parameters())


def _linear_model(i: int, h: int, o: int) -> SplitModel:
    blocks = [nn.Sequential(nn.Flatten(), nn.Linear(i, h)), nn.Sequential(nn.ReLU(), nn.Linear(h, o))]
    return SplitModel("lin", blocks, [1], 1, (i,), o)


def test_linear_flops_by_hand() -> None:
    """2 FLOPs per MAC; block 0 needs no input grad: fwd + weight grad = 2 matmuls;
    block 1 also sends the gradient back: fwd + weight grad + input grad = 3 matmuls."""
    i, h, o = 20, 30, 5
    flops = block_flops(_linear_model(i, h, o))
    assert flops == [2 * i * h * 2, 2 * h * o * 3]
    c = split_costs(_linear_model(i, h, o))[1]
    assert c.client_flops == 2 * i * h * 2 and c.server_flops == 2 * h * o * 3
    assert c.client_params == i * h + h and c.client_param_bytes == 4 * (i * h + h)
    assert c.activation_shape == (h,) and c.activation_bytes == 4 * h


def test_conv_flops_by_hand() -> None:
    """First conv of VGG11 on 3x32x32: 64*27*32*32 MACs; fwd + weight grad."""
    costs = model_costs("vgg11", (3, 32, 32), 10)
    assert costs[1].client_flops == 2 * 2 * 64 * 27 * 32 * 32


def test_split_costs_does_not_touch_model_or_rng() -> None:
    torch.manual_seed(1)
    model = build_model("resnet8", (1, 8, 8), 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    split_costs(model)
    model_costs("small_cnn", (1, 8, 8), 3)
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_model_costs_cached_and_copy() -> None:
    a = model_costs("small_cnn", [1, 28, 28], 10)
    b = model_costs("small_cnn", (1, 28, 28), 10)
    assert a == b and a is not b
    a.clear()
    assert model_costs("small_cnn", (1, 28, 28), 10) == b
    assert all(isinstance(c, SplitCost) for c in b.values())
    with pytest.raises(ValueError, match="small_cnn"):
        model_costs("nope", (1, 8, 8), 10)


def test_format_cost_table() -> None:
    model = build_model("small_cnn", (1, 8, 8), 10)
    costs = split_costs(model)
    table = format_cost_table(costs, model.block_names)
    lines = table.splitlines()
    assert len(lines) == 2 + len(costs)
    assert "client FLOPs" in lines[0] and "cut after" in lines[0]
    assert "(whole model)" in lines[-1] and "conv2" in lines[3]
    assert "32x4x4" in table  # activation after conv2+pool at split 2
    assert "cut after" not in format_cost_table(costs)


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_the_torch_2_0_flop_counter_counts_what_pytorchs_does(name, shape):
    """On torch 2.0 (no FlopCounterMode) agents count FLOPs with sfl_core.model.flops: block by
    block, forward and backward, it must give PyTorch's own count, or an agent on an old board
    would price splits differently from its coordinator."""
    FlopCounterMode = pytest.importorskip("torch.utils.flop_counter",
                                          reason="torch 2.0 has no FlopCounterMode to compare with").FlopCounterMode
    from sfl_core.model.flops import FlopCounter

    model = build_model(name, shape, 10).train()
    x = torch.randn(4, *shape, generator=torch.Generator().manual_seed(0))
    for i, block in enumerate(model.blocks):
        counts = []
        for counter in (FlopCounterMode(display=False), FlopCounter()):
            inp = x.detach().requires_grad_(i > 0)
            with counter:
                out = block(inp)
                out.backward(torch.ones_like(out))
            counts.append(counter.get_total_flops())
        assert counts[0] == counts[1] and (counts[0] > 0 or i > 0), (name, i, counts)
        x = out.detach()
