"""The server's loss options (docs/methods/heterosfl.md): logit calibration per member and BDKS for wide members."""

from __future__ import annotations

import copy

import pytest

import torch
import torch.nn.functional as F

from coordinator.server_trainer import ServerTrainer
from sfl_core.losses import LossSpec
from sfl_core.methods.heterosfl.bdks import Bdks
from sfl_core.model.zoo import build_model


def _model():
    torch.manual_seed(0)
    model = build_model("small_cnn", (1, 8, 8), 10)
    model.add_bottleneck(2, 8)
    return model


def _batches():
    g = torch.Generator().manual_seed(1)
    narrow = (torch.randn(6, 2, 4, 4, generator=g), torch.randint(0, 10, (6,), generator=g))
    wide = (torch.randn(5, 8, 4, 4, generator=g), torch.randint(0, 10, (5,), generator=g))
    return {"n": narrow, "w": wide}


def _step(spec: LossSpec, counts=None, model=None):
    model = model or _model()
    trainer = ServerTrainer(model, lr=0.1, loss=spec)
    counts = counts or {"n": [3] * 10, "w": [3] * 10}
    trainer.begin_round([["n", "w"]], {"n": 2, "w": 2}, widths={"n": 2, "w": 8}, label_counts=counts)
    return trainer, trainer.step(_batches())


def test_calibration_with_uniform_counts_is_plain_cross_entropy():
    _, (g_ce, loss_ce) = _step(LossSpec("ce"))
    _, (g_cal, loss_cal) = _step(LossSpec("calibrated", tau=2.0))
    assert abs(loss_ce - loss_cal) < 1e-5
    for a in g_ce:
        torch.testing.assert_close(g_ce[a], g_cal[a])


def test_calibration_uses_each_members_own_counts():
    skewed = {"n": [100] + [1] * 9, "w": [3] * 10}
    _, (g_ce, _) = _step(LossSpec("ce"), counts=skewed)
    _, (g_cal, _) = _step(LossSpec("calibrated", tau=2.0), counts=skewed)
    assert not torch.allclose(g_ce["n"], g_cal["n"])   # skewed member: its margins differ


def test_calibration_survives_counts_that_do_not_cover_a_rows_label():
    # a member whose registered counts miss a label it sends gets a finite loss, not an error
    _, (grads, loss) = _step(LossSpec("calibrated"), counts={"n": [1] + [0] * 9, "w": [3] * 10})
    assert loss == loss and all(torch.isfinite(g).all() for g in grads.values())


def test_bdks_changes_only_the_wide_members_gradient():
    """BDKS terms are functions of the wide rows only: the narrow member's gradient is the same
    with and without them, the wide member's differs, and every channel of its code gets one."""
    _, (g_off, _) = _step(LossSpec("calibrated"))
    _, (g_on, _) = _step(LossSpec("calibrated", term=Bdks(alpha=1.0, theta=0.5)))
    torch.testing.assert_close(g_on["n"], g_off["n"])
    assert not torch.allclose(g_on["w"], g_off["w"])
    # W2N flows through the narrow sub-bottleneck: only the first 2 channels see the extra term
    diff = (g_on["w"] - g_off["w"]).abs().amax(dim=(0, 2, 3))
    assert diff[:2].min() > 0 and diff[2:].max() < 1e-6


def test_bdks_trains_the_decoder_and_server_blocks():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    trainer, _ = _step(LossSpec("calibrated", term=Bdks()), model=model)
    after = trainer.member_state("w", 2)
    for key in ("bottlenecks.2.decoder.weight", "blocks.3.linear.weight"):
        assert not torch.equal(after[key], before[key]), key


@pytest.mark.parametrize("withheld", [("w",), ("n", "w")])
def test_withheld_labels_give_the_labelled_paths_gradients(withheld):
    """MergeSFL's labels-withheld mode: the agent scores its own rows' logits and returns the
    gradient of its mean loss; agents' activation gradients, the loss and the server update
    equal those of the labelled path."""
    batches = _batches()

    def run(withhold: tuple[str, ...]):
        model = _model()
        trainer = ServerTrainer(model, lr=0.1)
        trainer.begin_round([["n", "w"]], {"n": 2, "w": 2}, widths={"n": 2, "w": 8})
        calls = []

        def exchange(logits):
            calls.append(sorted(logits))
            out = {}
            for a, z in logits.items():   # what the agent does with the labels it kept
                z = z.clone().requires_grad_(True)
                loss = F.cross_entropy(z, batches[a][1])
                loss.backward()
                out[a] = (z.grad, loss.item())
            return out

        sent = {a: (x, None if a in withhold else y) for a, (x, y) in batches.items()}
        grads, loss = trainer.step(sent, exchange)
        return grads, loss, trainer.member_state("n", 2), calls

    g_lab, loss_lab, state_lab, calls_lab = run(())
    g_wh, loss_wh, state_wh, calls_wh = run(withheld)
    assert calls_lab == [] and calls_wh == [sorted(withheld)]
    assert loss_wh == pytest.approx(loss_lab, rel=1e-5)
    for a in g_lab:
        torch.testing.assert_close(g_wh[a], g_lab[a])
    for k in state_lab:
        torch.testing.assert_close(state_wh[k], state_lab[k])


def test_rows_cut_before_the_bottleneck_pass_the_whole_pair():
    """An agent cut at 1 beside one at the pair's cut 2 (strategy auto with auto.widths): its rows
    run the encoder and decoder on the server, as the full model does, and it gets the gradient
    of that forward; the server's optimiser steps the whole pair (its encoder too)."""
    model = _model()
    g = torch.Generator().manual_seed(2)
    early = (torch.randn(4, 16, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g))
    at_cut = (torch.randn(3, 4, 4, 4, generator=g), torch.randint(0, 10, (3,), generator=g))
    ref = copy.deepcopy(model)
    trainer = ServerTrainer(model, lr=0.1)
    trainer.begin_round([["e", "c"]], {"e": 1, "c": 2}, widths={"c": 4})
    grads, _ = trainer.step({"e": early, "c": at_cut})
    h = early[0].clone().requires_grad_(True)
    logits = torch.cat([ref.server(1)(h), ref.server(2)(at_cut[0])])
    F.cross_entropy(logits, torch.cat([early[1], at_cut[1]])).backward()
    torch.testing.assert_close(grads["e"], h.grad * 7 / 4)
    new = trainer.member_state("e", 1)
    assert not torch.equal(new["bottlenecks.2.encoder.weight"], ref.state_dict()["bottlenecks.2.encoder.weight"])
