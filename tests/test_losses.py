"""HeteroSFL losses: logit calibration, distillation, N2W/W2N and BDKS gradient routing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sfl_core.losses import logit_calibrated_ce, n2w_loss, w2n_loss


def _logits(b=6, c=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, c, generator=g)


# ------------------------------------------------------------------ logit calibration
def test_calibrated_ce_equals_ce_for_equal_counts():
    z, y = _logits(), torch.tensor([0, 1, 2, 3, 4, 0])
    for n in (1, 37, 10_000):
        torch.testing.assert_close(logit_calibrated_ce(z, y, [n] * 5, tau=2.0), F.cross_entropy(z, y))
    # tau = 0 is plain CE whatever the counts
    torch.testing.assert_close(logit_calibrated_ce(z, y, [1, 5, 50, 500, 5000], tau=0.0), F.cross_entropy(z, y))


def test_calibrated_ce_direction_for_skewed_counts():
    z = torch.zeros(1, 3)
    counts = [1, 100, 10_000]           # class 0 rare, class 2 frequent
    ce = F.cross_entropy(z, torch.tensor([0]))
    rare = logit_calibrated_ce(z, torch.tensor([0]), counts, tau=1.0)
    frequent = logit_calibrated_ce(z, torch.tensor([2]), counts, tau=1.0)
    # a rare-class sample gets the largest margin subtracted from its own logit: loss goes up;
    # a frequent-class sample sees its rare competitors pushed down: loss goes down
    assert rare > ce + 0.1
    assert frequent < ce - 0.1
    # hand value: z~ = -tau * n^(-1/4)
    zc = -torch.tensor([[1.0, 100 ** -0.25, 10_000 ** -0.25]])
    torch.testing.assert_close(rare, F.cross_entropy(zc, torch.tensor([0])))
    # stronger tau, stronger effect
    assert logit_calibrated_ce(z, torch.tensor([0]), counts, tau=3.0) > rare


def test_calibrated_ce_per_row_counts():
    z, y = _logits(4, 3), torch.tensor([0, 1, 2, 0])
    a, b = [5, 50, 500], [500, 5, 50]
    rows = torch.tensor([a, a, b, b])
    per_row = logit_calibrated_ce(z, y, rows)
    split = (logit_calibrated_ce(z[:2], y[:2], a) * 2 + logit_calibrated_ce(z[2:], y[2:], b) * 2) / 4
    torch.testing.assert_close(per_row, split)
    assert not torch.isclose(per_row, logit_calibrated_ce(z, y, a))
    with pytest.raises(ValueError, match="shape"):
        logit_calibrated_ce(z, y, torch.ones(3, 3))


def test_calibrated_ce_zero_counts_are_safe():
    z = _logits(3, 4).requires_grad_()
    y = torch.tensor([0, 1, 0])
    loss = logit_calibrated_ce(z, y, [10, 3, 0, 7])
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(z.grad).all()
    assert torch.all(z.grad[:, 2] == 0)        # an absent class drops out of the softmax
    # same as plain CE over the present classes with their margins
    keep = [0, 1, 3]
    zc = z.detach()[:, keep] - torch.tensor([10, 3, 7]) ** -0.25
    torch.testing.assert_close(loss.detach(), F.cross_entropy(zc, torch.tensor([0, 1, 0])))
    with pytest.raises(ValueError, match="own label has count 0"):
        logit_calibrated_ce(z, torch.tensor([2, 0, 0]), [10, 3, 0, 7])
    with pytest.raises(ValueError):
        logit_calibrated_ce(z, y, [10, -1, 0, 7])


# ------------------------------------------------------------------ N2W / W2N
def test_n2w_matches_eq6_by_hand():
    w, n = _logits(2, 4), _logits(2, 4, seed=3)
    R, J = [1, 3], [0, 2]
    pn, pw = F.softmax(n, 1), F.softmax(w, 1)
    expect = -(pn[:, R] * pw[:, R].log()).sum(1) - pn[:, J].sum(1) * pw[:, J].sum(1).log()
    torch.testing.assert_close(n2w_loss(w, n, R), expect.mean())
    # R empty: nothing to learn (lumped bin has probability 1 on both sides)
    assert abs(float(n2w_loss(w, n, []))) < 1e-6
    # R = everything: full soft-label cross-entropy
    torch.testing.assert_close(n2w_loss(w, n, range(4)), -(pn * pw.log()).sum(1).mean())
    with pytest.raises(ValueError):
        n2w_loss(w, n, [4])


def test_w2n_is_soft_label_ce():
    n, w = _logits(), _logits(seed=2)
    torch.testing.assert_close(w2n_loss(n, w), -(F.softmax(w, 1) * F.log_softmax(n, 1)).sum(1).mean())
    # same gradient as T²·KL(softmax(w/T) ‖ softmax(n/T)) from the wide path
    a, b = n.clone().requires_grad_(), n.clone().requires_grad_()
    w2n_loss(a, w, T=2.0).backward()
    kl = F.kl_div(F.log_softmax(b / 2.0, 1), F.log_softmax(w / 2.0, 1), log_target=True, reduction="batchmean") * 4.0
    kl.backward()
    torch.testing.assert_close(a.grad, b.grad)



@pytest.mark.parametrize("loss", [lambda s, t, **k: n2w_loss(s, t, [0], **k), w2n_loss])
def test_knowledge_sharing_refuses_mismatched_logits_and_a_bad_temperature(loss):
    with pytest.raises(ValueError, match=r"\(2, 3\) and .* \(2, 4\) logits differ in shape"):
        loss(_logits(2, 3), _logits(2, 4))
    with pytest.raises(ValueError, match="must be \\(batch, classes\\)"):
        loss(_logits(2, 3)[0], _logits(2, 3)[0])
    for T in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="T must be finite and positive"):
            loss(_logits(2, 3), _logits(2, 3), T=T)


# ------------------------------------------------------------------ BDKS gradient routing
def _grads(loss, wide, narrow):
    return torch.autograd.grad(loss, [wide, narrow], retain_graph=True, allow_unused=True)


def test_bdks_gradients_follow_the_paper():
    wide = _logits(8, 5).requires_grad_()
    narrow = _logits(8, 5, seed=4).requires_grad_()
    y = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    counts = [40, 30, 20, 2, 1]
    R = [3, 4]

    def nonzero(g):
        return g is not None and bool(g.abs().sum() > 0)

    cal = logit_calibrated_ce(wide, y, counts)
    n2w = n2w_loss(wide, narrow, R)
    w2n = w2n_loss(narrow, wide)
    gw, gn = _grads(cal, wide, narrow)
    assert nonzero(gw) and not nonzero(gn)
    gw, gn = _grads(n2w, wide, narrow)          # teacher = narrow, detached
    assert nonzero(gw) and not nonzero(gn)
    gw, gn = _grads(w2n, wide, narrow)          # teacher = wide, detached
    assert not nonzero(gw) and nonzero(gn)
