"""BDKS (HeteroSFL, Chen et al., Eq. 6-8) on the server: the under-represented class set R as the
paper defines it, and narrow passes that leave BatchNorm's running statistics to the wide path."""

from __future__ import annotations

import copy

import pytest
import torch

from coordinator.server_trainer import ServerTrainer
from sfl_core.losses import LossSpec
from sfl_core.methods.heterosfl.bdks import Bdks
from sfl_core.model.zoo import build_model


def _trainer(spec: LossSpec, model=None) -> ServerTrainer:
    if model is None:
        torch.manual_seed(0)
        model = build_model("small_cnn", (1, 8, 8), 3)
        model.add_bottleneck(2, 8)
    return ServerTrainer(model, lr=0.1, loss=spec)


# ------------------------------------------------------------------ R: shares, against the population
ROUND = {"w": [90, 2, 8], "n": [0, 1, 99]}      # the wide member's data: shares .90 .02 .08
POPULATION = {**ROUND, "x": [0, 200, 0]}         # an agent not selected this round holds most of class 1


def _under(population=None, theta=0.1) -> list[int]:
    trainer = _trainer(LossSpec("calibrated", term=Bdks(theta=theta)))
    kw = {} if population is None else {"population_counts": population}
    trainer.begin_round([["n", "w"]], {"n": 2, "w": 2}, widths={"n": 2, "w": 8}, label_counts=ROUND, **kw)
    return trainer.loss.term.under[8]


def test_r_compares_the_wide_groups_share_with_the_global_share():
    """Population shares .225 .5075 .2675: class 1 is 2 % of the wide group's data, below
    0.1 x 50.75 %, so it is in R. (Absolute counts would put class 2 in R — 8 < 0.1 x 107 —
    although the wide group holds it at 8 %, above 0.1 x its global share.)"""
    assert _under(POPULATION) == [1]
    assert _under(POPULATION, theta=0.2) == [1]
    assert _under(POPULATION, theta=0.0) == []


def test_r_without_population_counts_uses_the_rounds_agents():
    # the round alone: shares .45 .015 .535 -> class 1 at 2 % is above 0.1 x 1.5 %: nothing is under
    assert _under() == []


def test_population_counts_must_include_what_the_round_holds():
    # the round's agents count even if the population passed lacks them
    assert _under({"x": [0, 200, 0]}) == [1]


# ------------------------------------------------------------------ BatchNorm running statistics
def _bn_model():
    torch.manual_seed(0)
    model = build_model("resnet8", (3, 8, 8), 10)      # BatchNorm in every server block
    model.add_bottleneck(2, 8)
    return model


def _bn_batches():
    g = torch.Generator().manual_seed(1)
    narrow = (torch.randn(6, 2, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g))
    wide = (torch.randn(5, 8, 8, 8, generator=g) * 3 + 1, torch.randint(0, 10, (5,), generator=g))
    return {"n": narrow, "w": wide}


def _run(spec: LossSpec):
    trainer = ServerTrainer(_bn_model(), lr=0.1, loss=spec)
    counts = {"n": [3] * 10, "w": [3] * 5 + [0] * 5}
    trainer.begin_round([["n", "w"]], {"n": 2, "w": 2}, widths={"n": 2, "w": 8}, label_counts=counts)
    grads, _ = trainer.step(_bn_batches())
    return trainer, grads


def test_narrow_passes_leave_batchnorm_running_statistics_to_the_wide_path():
    """A BDKS step leaves BatchNorm's running mean, variance and batch count exactly where the
    same step without BDKS (the wide pass over the merged batch only) leaves them."""
    with_bdks, g_on = _run(LossSpec("calibrated", term=Bdks(alpha=1.0, theta=0.5)))
    without, g_off = _run(LossSpec("calibrated"))
    assert with_bdks.loss.term.under[8]      # the N2W term is active
    on, off = with_bdks.member_state("w", 2), without.member_state("w", 2)
    stats = [k for k in on if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(stats) >= 9
    before = _bn_model().state_dict()
    for k in stats:
        assert torch.equal(on[k], off[k]), k
    assert any(not torch.equal(on[k], before[k]) for k in stats)       # the wide pass did update them
    # the narrow passes still train: the wide member's gradient differs
    assert not torch.allclose(g_on["w"], g_off["w"])


def test_narrow_pass_logits_are_those_of_a_plain_training_forward():
    """Only the buffers are kept aside: the narrow pass normalises with its batch's statistics
    and computes what the module would in train mode."""
    trainer = ServerTrainer(_bn_model(), lr=0.1, loss=LossSpec("ce", term=Bdks()))
    trainer.begin_round([["w"]], {"w": 2}, widths={"w": 8}, label_counts={"w": [1] * 10})
    group = trainer._groups[0]
    reference = copy.deepcopy(group.model)
    z = _bn_batches()["w"][0][:, :2].requires_grad_(True)
    out = trainer._server_forward(group, z)
    h = reference.bottleneck(2).decode(z)
    for blk in reference.blocks[2:]:
        h = blk(h)
    torch.testing.assert_close(out, h)
    out.sum().backward()                     # gradients flow through the scratch-buffer forward
    assert z.grad is not None and group.model.bottlenecks["2"].decoder.weight.grad is not None
    for (k, b), (_, ref) in zip(group.model.named_buffers(), _bn_model().named_buffers()):
        assert torch.equal(b, ref), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_narrow_passes_keep_running_statistics_on_the_gpu():
    trainer = ServerTrainer(_bn_model().cuda(), lr=0.1, device="cuda",
                            loss=LossSpec("calibrated", term=Bdks(theta=0.5)))
    trainer.begin_round([["n", "w"]], {"n": 2, "w": 2}, widths={"n": 2, "w": 8},
                        label_counts={"n": [3] * 10, "w": [3] * 5 + [0] * 5})
    trainer.step(_bn_batches())
    ref, _ = _run(LossSpec("calibrated"))
    on, off = trainer.member_state("w", 2), ref.member_state("w", 2)
    for k in on:
        if k.endswith(("running_mean", "running_var", "num_batches_tracked")):
            torch.testing.assert_close(on[k], off[k], rtol=1e-4, atol=1e-5)
