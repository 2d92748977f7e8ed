"""S2FL inside the coordinator: mixed-split group training, layer-wise aggregation, the plan,
and a simulated run whose agents end up on different splits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from sfl_core.aggregation import layerwise_average
from sfl_core.config.run import run_config_from_dict
from sfl_core.model.zoo import build_model

from coordinator.server_trainer import ServerTrainer


def _model():
    torch.manual_seed(0)
    return build_model("small_cnn", (1, 8, 8), 10)


def test_mixed_split_group_matches_full_model_autograd():
    """Two agents cut at different layers, one server copy: gradients and the server update equal
    those of one full-model forward/backward over both agents' rows."""
    model = _model()
    xa, xb = torch.randn(4, 1, 8, 8), torch.randn(6, 1, 8, 8)
    ya, yb = torch.randint(0, 10, (4,)), torch.randint(0, 10, (6,))
    acts = {"a": model.client(1)(xa).detach(), "b": model.client(2)(xb).detach()}

    trainer = ServerTrainer(model, lr=0.1)
    trainer.begin_round([["a", "b"]], {"a": 1, "b": 2})
    grads, loss = trainer.step({"a": (acts["a"], ya), "b": (acts["b"], yb)})

    # reference: same rows, same order (a joins at block 1, b at block 2), plain autograd
    ref = copy.deepcopy(model)
    ha = acts["a"].clone().requires_grad_(True)
    hb = acts["b"].clone().requires_grad_(True)
    h = ref.blocks[1](ha)
    h = torch.cat([h, hb])
    for blk in ref.blocks[2:]:
        h = blk(h)
    ref_loss = F.cross_entropy(h, torch.cat([ya, yb]))
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
    n = 10
    torch.testing.assert_close(grads["a"], ha.grad * n / 4)
    torch.testing.assert_close(grads["b"], hb.grad * n / 6)
    # the group's copy took one SGD step from the global weights; the global model is untouched
    new = trainer.member_state("a", 1)
    for name, p in ref.named_parameters():
        if name in new:
            torch.testing.assert_close(new[name], (p - 0.1 * p.grad).detach())
    torch.testing.assert_close(model.state_dict()["blocks.3.linear.weight"], ref.state_dict()["blocks.3.linear.weight"])


def test_groups_train_separate_copies():
    model = _model()
    trainer = ServerTrainer(model, lr=0.5)
    trainer.begin_round([["a"], ["b"]], {"a": 2, "b": 2})
    x = model.client(2)(torch.randn(8, 1, 8, 8)).detach()
    trainer.step({"a": (x, torch.zeros(8, dtype=torch.long))})  # only group a trains
    key = "blocks.3.linear.weight"
    assert not torch.equal(trainer.member_state("a", 2)[key], model.state_dict()[key])
    torch.testing.assert_close(trainer.member_state("b", 2)[key], model.state_dict()[key])


def test_layerwise_average_is_exact_weighted_mean_for_shared_layer():
    """Layer 'blocks.1.w' is held by a's server copy (a cut at 1) and by b's client (b cut at 2):
    the result is the data-size weighted mean of exactly those two tensors."""
    a_client = {"blocks.0.w": torch.tensor([1.0])}
    a_server = {"blocks.1.w": torch.tensor([10.0]), "blocks.2.w": torch.tensor([100.0])}
    b_client = {"blocks.0.w": torch.tensor([3.0]), "blocks.1.w": torch.tensor([30.0])}
    b_server = {"blocks.2.w": torch.tensor([300.0])}
    out = layerwise_average({"a": a_client, "b": b_client}, {"a": a_server, "b": b_server}, {"a": 1.0, "b": 3.0})
    assert out["blocks.0.w"].item() == pytest.approx((1 * 1 + 3 * 3) / 4)
    assert out["blocks.1.w"].item() == pytest.approx((10 * 1 + 30 * 3) / 4)
    assert out["blocks.2.w"].item() == pytest.approx((100 * 1 + 300 * 3) / 4)


@pytest.mark.parametrize("sliding,balance,expect_groups", [(False, False, 1), (False, True, 2), (True, True, 2)])
def test_s2fl_simulation_ablations(tmp_path, sliding, balance, expect_groups):
    """The +R/+B/+MB switches: split choice and grouping follow the config; training learns."""
    from simulation import run_simulation

    cfg = run_config_from_dict({
        "run": "s2", "model": "small_cnn", "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
        "fleet": [{"profile": "s2fl-low-low", "count": 2}, {"profile": "s2fl-high-high", "count": 2}],
        "rounds": 5, "strategy": "s2fl", "batch_size": 16, "lr": 0.05, "momentum": 0.5, "local_iters": 10,
        "output_dir": str(tmp_path / f"out-{sliding}-{balance}"),
        "s2fl": {"sliding": sliding, "balance": balance, "group_size": 2, "candidates": [1, 2, 3]},
    })
    history, engine = run_simulation(cfg, device="cpu")
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.25
    for rec in history[1:]:
        sizes = sorted(len(g) for g in rec["groups"])
        assert sizes == ([1, 1, 1, 1] if not balance else [2, 2])
    splits = [sorted({a["split"] for a in rec["agents"].values()}) for rec in history[1:]]
    if not sliding:
        assert all(s == [3] for s in splits)           # largest candidate, like the paper's SFL
    else:
        assert splits[:3] == [[1], [2], [3]]            # warm-up: one candidate per round
        table = engine.method.time_table
        for a in engine.registry.agents:
            assert all(table.get(a, s) is not None and not table.get(a, s).estimated for s in (1, 2, 3))
        # after warm-up the slow-link agents take a different split from the fast ones
        last = history[-1]["agents"]
        low = {v["split"] for a, v in last.items() if engine.registry.agents[a].profile.name == "s2fl-low-low"}
        high = {v["split"] for a, v in last.items() if engine.registry.agents[a].profile.name == "s2fl-high-high"}
        assert low.isdisjoint(high), (low, high)
