"""Weighted averaging of model states against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from sfl_core.aggregation import weighted_average


def test_weighted_average_hand_computed():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(0.0)}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor(4.0)}
    out = weighted_average([a, b], [1, 3])
    # w = (1*[1,2] + 3*[3,6]) / 4 = [2.5, 5.0]; b = 3*4/4 = 3
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))
    assert torch.allclose(out["b"], torch.tensor(3.0))
    assert out["w"].dtype == torch.float32


def test_three_states_unequal_weights():
    states = [{"x": torch.tensor([v])} for v in (0.0, 10.0, 100.0)]
    out = weighted_average(states, [0.5, 0.25, 0.25])
    assert out["x"].item() == pytest.approx(0 * 0.5 + 10 * 0.25 + 100 * 0.25)


def test_keys_averaged_over_holders_only():
    # layer-wise aggregation with mixed split points: "late" only exists in two states
    s1 = {"early": torch.tensor([1.0]), "late": torch.tensor([10.0])}
    s2 = {"early": torch.tensor([2.0])}
    s3 = {"early": torch.tensor([4.0]), "late": torch.tensor([40.0])}
    out = weighted_average([s1, s2, s3], [1, 2, 3])
    assert out["early"].item() == pytest.approx((1 * 1 + 2 * 2 + 3 * 4) / 6)
    assert out["late"].item() == pytest.approx((1 * 10 + 3 * 40) / 4)  # not diluted by s2's weight
    assert list(out) == ["early", "late"]


def test_key_held_only_by_zero_weight_states_falls_back_to_uniform():
    s1 = {"a": torch.tensor([1.0]), "z": torch.tensor([2.0])}
    s2 = {"a": torch.tensor([3.0]), "z": torch.tensor([6.0])}
    s3 = {"a": torch.tensor([5.0])}
    out = weighted_average([s1, s2, s3], [0, 0, 1])
    assert out["a"].item() == pytest.approx(5.0)
    assert out["z"].item() == pytest.approx(4.0)


def test_integer_buffers_rounded():
    s1 = {"num_batches_tracked": torch.tensor(10)}
    s2 = {"num_batches_tracked": torch.tensor(13)}
    out = weighted_average([s1, s2], [1, 2])  # (10 + 26) / 3 = 12.0
    assert out["num_batches_tracked"].dtype == torch.int64
    assert out["num_batches_tracked"].item() == 12
    out = weighted_average([s1, s2], [1, 1])  # 11.5 rounds to an integer, not truncated
    assert out["num_batches_tracked"].item() in (11, 12)
    out = weighted_average([s1, s2], [1, 3])  # 12.25 -> 12
    assert out["num_batches_tracked"].item() == 12
    out = weighted_average([s1, s2], [1, 4])  # 12.4 -> 12; 12.6 would be 13
    assert out["num_batches_tracked"].item() == 12
    out = weighted_average([s1, s2], [1, 9])  # 12.7 -> 13 (rounded, not truncated)
    assert out["num_batches_tracked"].item() == 13


def test_precision_kept_in_float64_accumulator():
    big = torch.tensor([1e8], dtype=torch.float32)
    out = weighted_average([{"x": big}, {"x": big + 8}], [1, 1])
    assert out["x"].item() == pytest.approx(1e8 + 4)


def test_inputs_not_modified():
    a = {"w": torch.tensor([1.0, 2.0], requires_grad=True)}
    b = {"w": torch.tensor([3.0, 4.0])}
    out = weighted_average([a, b], [1, 1])
    assert torch.equal(b["w"], torch.tensor([3.0, 4.0]))
    assert not out["w"].requires_grad


def test_rank_mismatch_raises():
    with pytest.raises(ValueError, match="w: shapes differ"):
        weighted_average([{"w": torch.zeros(2)}, {"w": torch.zeros(2, 1)}], [1, 1])


def test_hetbl_prefix_channels_averaged_over_their_holders():
    """HetBL Eq. 4-5: widths 2, 4, 8; encoder rows (dim 0) and decoder columns (dim 1)."""
    enc = [torch.full((w, 3), float(v)) for w, v in ((2, 1.0), (4, 2.0), (8, 4.0))]
    dec = [torch.full((3, w), float(v)) for w, v in ((2, 1.0), (4, 2.0), (8, 4.0))]
    weights = [1.0, 2.0, 3.0]
    out = weighted_average([{"enc": e, "dec": d} for e, d in zip(enc, dec)], weights)
    expect = torch.tensor([(1 + 4 + 12) / 6] * 2 + [(4 + 12) / 5] * 2 + [4.0] * 4)
    torch.testing.assert_close(out["enc"], expect[:, None].expand(8, 3))
    torch.testing.assert_close(out["dec"], expect[None, :].expand(3, 8))


def test_unheld_elements_take_the_default():
    """No agent trained channels 2-3 this round (no full-width agent): they keep the global value."""
    out = weighted_average([{"w": torch.ones(2)}], [1], defaults={"w": torch.full((4,), 7.0)})
    torch.testing.assert_close(out["w"], torch.tensor([1.0, 1.0, 7.0, 7.0]))


@pytest.mark.parametrize("weights", [[1, -1], [0, 0], [], [1], [1, 2, 3], [float("nan"), 1],
                                     [float("inf"), 1]])
def test_bad_weights_raise(weights):
    states = [{"w": torch.zeros(2)}, {"w": torch.ones(2)}]
    with pytest.raises(ValueError, match="weight"):
        weighted_average(states, weights)


def test_no_states_raises():
    with pytest.raises(ValueError, match="at least one state"):
        weighted_average([], [])
