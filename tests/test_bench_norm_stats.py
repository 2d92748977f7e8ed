"""bench/norm_stats.py: BatchNorm statistics recomputed from data replace the averaged ones."""

import sys
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))


def test_recomputed_statistics_are_the_data_s_and_weights_stay():
    import norm_stats

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(4, 1, 6, 6))
    bn = model[1]
    bn.running_mean.fill_(5.0)            # statistics that fit no input, as after averaging
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    x = torch.randn(600, 1, 6, 6) * 2 + 1
    norm_stats.recompute_batch_norm(model, x, batch=250)
    with torch.no_grad():
        conv = model[0](x)
    # the plain average of the batches' means (momentum None), not a moving average of the last ones
    batch_means = torch.stack([conv[i:i + 250].mean((0, 2, 3)) for i in range(0, 600, 250)])
    assert torch.allclose(bn.running_mean, batch_means.mean(0), atol=1e-5)
    assert bn.momentum == 0.1 and not model.training
    for k, v in weights.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_models_without_batch_norm_are_skipped():
    import norm_stats

    assert norm_stats.has_batch_norm(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))
    assert not norm_stats.has_batch_norm(nn.Sequential(nn.Conv2d(1, 2, 3), nn.GroupNorm(1, 2)))
