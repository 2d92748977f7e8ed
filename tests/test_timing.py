"""The timing model (docs/methods/time-model.md), computed by hand, and Assignment range checks."""

from __future__ import annotations

import pytest

from sfl_core import timing
from sfl_core.wire.assignment import MAX_BATCH, MAX_TAU, Assignment
from sfl_core.wire.codec import WireError

# S2FL Table 1 device classes: FLOP/s, link bytes/s
MID = (1e10, 2e6)
SERVER = (5e10, 1e7)


def test_agent_round_time_matches_s2fl_eq1_by_hand():
    # T = (2|Wc| + 2 p q) / R + F_c / Comp_c + F_s / Comp_s, for a "mid" device
    wc = 400_000          # client-portion bytes
    p, q = 32, 2048       # samples, activation bytes per sample
    f_c, f_s = 3e9, 8e9   # FLOPs for fwd+bwd
    comp_c, r = MID
    comp_s = SERVER[0]
    expected = (2 * wc + 2 * p * q) / r + f_c / comp_c + f_s / comp_s
    # = (800000 + 131072) / 2e6 + 0.3 + 0.16 = 0.465536 + 0.46 = 0.925536
    assert expected == pytest.approx(0.925536)
    t = timing.agent_round_time(client_flops=f_c, server_flops=f_s,
                                bytes_up=wc + p * q, bytes_down=wc + p * q,
                                client_flops_per_s=comp_c, server_flops_per_s=comp_s,
                                uplink_bytes_per_s=r, downlink_bytes_per_s=r)
    assert t.total_s == pytest.approx(expected, rel=1e-12)
    assert t.transfer_s == pytest.approx(0.465536)
    assert t.client_compute_s == pytest.approx(0.3)
    assert t.server_compute_s == pytest.approx(0.16)


def test_agent_round_time_asymmetric_links_latency_and_no_server():
    t = timing.agent_round_time(client_flops=5e9, server_flops=0, bytes_up=1e6, bytes_down=4e6,
                                client_flops_per_s=5e9, server_flops_per_s=5e10,
                                uplink_bytes_per_s=1e6, downlink_bytes_per_s=2e6,
                                latency_s=0.05, messages=4)
    assert t.transfer_s == pytest.approx(1.0 + 2.0 + 0.2)
    assert t.server_compute_s == 0.0  # FedAvg: nothing runs on the server
    assert t.total_s == pytest.approx(1.0 + 3.2)


def test_round_time_and_waiting_time():
    ts = [1.0, 2.0, 4.0]
    assert timing.round_time(ts) == 4.0
    assert timing.round_time([]) == 0.0
    # W = mean(max - t_i) = (3 + 2 + 0) / 3
    assert timing.waiting_time(ts) == pytest.approx(5 / 3)
    assert timing.waiting_time(iter(ts)) == pytest.approx(5 / 3)  # any iterable, consumed once
    assert timing.waiting_time([]) == 0.0
    assert timing.waiting_time([2.5]) == 0.0


# ------------------------------------------------------------------ Assignment


def _body(**over):
    b = Assignment(model="small_cnn", mode="sfl", split=2, width=0, batch_size=16, lr=0.05,
                   momentum=0.9, tau=5, codec="fp32", zstd_level=3, activation_shape=(32, 4, 4)).to_body({})
    b.update(over)
    return b


def test_assignment_round_trip():
    a = Assignment.from_body(_body())
    assert a.to_body({"w": 1}) == {**_body(), "weights": {"w": 1}}
    assert a.activation_shape == (32, 4, 4)
    assert Assignment.from_body(_body(activation_shape=[], strategy="fedavg")).activation_shape == ()


@pytest.mark.parametrize("field,value", [
    ("strategy", "magic"), ("codec", "int3"),
    ("batch_size", 0), ("batch_size", MAX_BATCH + 1),
    ("tau", 0), ("tau", MAX_TAU + 1),
    ("lr", 0.0), ("lr", -0.1), ("lr", 11.0), ("lr", float("nan")),
    ("momentum", -0.1), ("momentum", 1.0), ("momentum", float("nan")),
    ("zstd_level", -1), ("zstd_level", 23),
    ("split", 0), ("split", -2), ("width", -1),
    ("activation_shape", [0, 4]), ("activation_shape", [-1]), ("activation_shape", [1] * 7),
    ("activation_shape", [2.0]), ("activation_shape", [True]),
])
def test_from_body_rejects_out_of_range(field, value):
    with pytest.raises(WireError, match=rf"assign\.{field}:"):
        Assignment.from_body(_body(**{field: value}))


@pytest.mark.parametrize("field,value", [("batch_size", MAX_BATCH), ("tau", MAX_TAU), ("lr", 10.0),
                                         ("momentum", 0.0), ("zstd_level", 0), ("zstd_level", 22),
                                         ("width", 8), ("codec", "fp16"), ("strategy", "fedavg")])
def test_from_body_accepts_bounds(field, value):
    attr = {"strategy": "mode"}.get(field, field)     # the wire's "strategy" is the agent's mode
    assert getattr(Assignment.from_body(_body(**{field: value})), attr) == value
