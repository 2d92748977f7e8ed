"""S2FL adaptive sliding split: candidates, warm-up, client time table, median rule, Eq. 1 estimate."""

from __future__ import annotations

import json
import math

import pytest

from sfl_core.model.accounting import model_costs
from sfl_core.model.zoo import MODEL_NAMES, build_model
from sfl_core.model.zoo import CANDIDATE_SPLITS, candidate_splits
from sfl_core.estimates import ClientTimeTable, TimeEntry
from sfl_core.methods.s2fl.sliding_split import median_rule, warmup_split
from sfl_core.config.run import profile_from_dict, run_config_from_dict
from sfl_core.timing import agent_round_time, fleet_round_time, price_option, profile_agent

# S2FL Table 1 device classes: FLOP/s, link bytes/s
LOW, MID, HIGH, SERVER = (5e9, 1e6), (1e10, 2e6), (2e10, 5e6), (5e10, 1e7)


def _device(flops: float, rate: float, *, down: float | None = None, latency_s: float = 0.0, measured=None):
    prof = profile_from_dict({"name": "dev", "compute_flops": flops, "link_bytes_per_s": rate,
                              "downlink_bytes_per_s": down or rate, "latency_s": latency_s})
    info = profile_agent(prof)
    info.measured = measured or {}
    return info


def _run(batch: int, tau: int, model: str = "small_cnn", **over):
    return run_config_from_dict({"model": model, "min_agents": 1, "batch_size": batch, "local_iters": tau,
                                 "server_flops": SERVER[0], **over})


def _estimate(cost, info, batch: int, tau: int, ratio: float = 1.0, **over) -> float:
    """S2FL's estimate for a cut never measured: the time model's price of the round."""
    return price_option(_run(batch, tau, **over), cost, "fp32", info, ratio=ratio).time(batch)


# ---------------------------------------------------------------- candidates


def test_every_zoo_model_has_candidates():
    assert set(CANDIDATE_SPLITS) == set(MODEL_NAMES)
    for name, cands in CANDIDATE_SPLITS.items():
        assert len(cands) >= 3 and list(cands) == sorted(set(cands)), name
        assert candidate_splits(name) == cands


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (9, 128)])
def test_candidates_valid_and_meaningfully_different(shape):
    names = ["cnn1d"] if len(shape) == 2 else [n for n in CANDIDATE_SPLITS if n != "cnn1d"]
    for name in names:
        cands = candidate_splits(name)
        model = build_model(name, shape, 10)             # once per model and shape (vgg16 is the slow one)
        for s in cands:
            model.check_split(s)
            assert s < model.num_blocks, (name, s)        # a real split: something stays on the server
        costs = model_costs(name, shape, 10)
        flops = [costs[s].client_flops for s in cands]
        acts = [costs[s].activation_bytes for s in cands]
        assert all(b > a for a, b in zip(flops, flops[1:])), (name, flops)
        assert len(set(acts)) > 1, (name, acts)
        for i in range(len(cands) - 1):                   # every step changes the work or the traffic a lot
            assert flops[i + 1] >= 1.25 * flops[i] or max(acts[i], acts[i + 1]) >= 4 * min(acts[i], acts[i + 1]), \
                (name, cands[i], flops, acts)


def test_candidate_subsets():
    assert candidate_splits("vgg16", 3) == (2, 4, 7)
    assert candidate_splits("vgg16", 2) == (2, 7)         # keeps the whole range
    assert candidate_splits("vgg16", 1) == (2,)
    for bad in (0, 4, -1, 1.5):
        with pytest.raises(ValueError, match="k must be"):
            candidate_splits("vgg16", bad)
    with pytest.raises(ValueError, match="s2fl.candidates"):
        candidate_splits("no_such_model")


# ---------------------------------------------------------------- warm-up


def test_warmup_sequence_k3():
    cands = (2, 3, 4)
    assert [warmup_split(r, cands) for r in (1, 2, 3, 4, 5)] == [2, 3, 4, None, None]
    assert warmup_split(0, cands) is None


def test_warmup_fills_every_column():
    # simulate the warm-up: after K rounds every (agent, candidate) cell is measured
    cands, agents = (1, 2, 3), ["a", "b"]
    t = ClientTimeTable()
    r = 1
    while (s := warmup_split(r, cands)) is not None:
        for a in agents:
            t.record(a, s, 1.0 + r, r)
        r += 1
    assert r == 4
    assert all(t.get(a, s) is not None and not t.get(a, s).estimated for a in agents for s in cands)


# ---------------------------------------------------------------- median rule


def _hand_table() -> ClientTimeTable:
    t = ClientTimeTable()
    rows = {"slow": (9.0, 6.0, 3.0), "mid": (5.0, 4.0, 2.5), "fast": (3.0, 2.0, 1.0)}   # times at splits 1, 2, 3
    for a, ts in rows.items():
        for s, v in zip((1, 2, 3), ts):
            t.record(a, s, v, round=s)
    return t


def test_median_rule_by_hand():
    t = _hand_table()
    # the 9 times sorted: 1, 2, 2.5, 3, 3, 4, 5, 6, 9 -> median 3
    assert sorted(t.times(["slow", "mid", "fast"], (1, 2, 3))) == [1, 2, 2.5, 3, 3, 4, 5, 6, 9]
    # slow: |9-3|,|6-3|,|3-3| -> 3; mid: 2,1,0.5 -> 3; fast: 0,1,2 -> 1
    assert median_rule(t, ["slow", "mid", "fast"], (1, 2, 3)) == {"slow": 3, "mid": 3, "fast": 1}
    # only the selected agents count: mid + fast -> 1, 2, 2.5, 3, 4, 5 -> median 2.75
    # mid: 2.25, 1.25, 0.25 -> 3; fast: 0.25, 0.75, 1.75 -> 1
    assert median_rule(t, ["mid", "fast"], (1, 2, 3)) == {"mid": 3, "fast": 1}
    # only the given candidates count: splits 1, 2 -> 2, 3, 4, 5, 6, 9 -> median 4.5
    # slow: 4.5, 1.5 -> 2; mid: 0.5, 0.5 -> tie -> smaller split 1; fast: 1.5, 2.5 -> 1
    assert median_rule(t, ["slow", "mid", "fast"], (1, 2)) == {"slow": 2, "mid": 1, "fast": 1}


def test_median_rule_ties_prefer_the_smaller_split():
    t = ClientTimeTable()
    t.record("a", 1, 2.0, 1)
    t.record("a", 2, 4.0, 2)
    # median of [2, 4] is 3: both are 1 away -> split 1
    assert median_rule(t, ["a"], (2, 1)) == {"a": 1}


def test_median_rule_missing_entries():
    t = _hand_table()
    t.set_estimate("new", 2, 3.5)                  # only one split known: that is the only option
    assert median_rule(t, ["new", "fast"], (1, 2, 3))["new"] == 2
    with pytest.raises(ValueError, match="ghost"):
        median_rule(t, ["fast", "ghost"], (1, 2, 3))
    with pytest.raises(ValueError, match="candidate"):
        median_rule(t, ["fast"], ())
    assert median_rule(t, [], (1, 2, 3)) == {}
    # a duplicated agent must not weigh twice: ["fast", "fast", "mid"] == ["fast", "mid"]
    assert median_rule(t, ["fast", "fast", "mid"], (1, 2, 3)) == median_rule(t, ["fast", "mid"], (1, 2, 3))


def test_median_rule_equalises_round_times_of_s2fl_device_classes():
    # estimates for a low, a mid and a high device on vgg11: the rule narrows the spread of round times
    cands = candidate_splits("vgg11")
    costs = model_costs("vgg11", (3, 32, 32), 10)
    t = ClientTimeTable()
    for a, (flops, rate) in {"low": LOW, "mid": MID, "high": HIGH}.items():
        for s in cands:
            t.set_estimate(a, s, _estimate(costs[s], _device(flops, rate), 32, 10, model="vgg11"))
    chosen = median_rule(t, ["low", "mid", "high"], cands)
    spread = lambda times: max(times) - min(times)  # noqa: E731
    assert spread([t.get(a, s).seconds for a, s in chosen.items()]) < min(
        spread([t.get(a, s).seconds for a in chosen]) for s in cands)


# ---------------------------------------------------------------- table


def test_measurements_override_estimates_not_the_reverse():
    t = ClientTimeTable()
    t.set_estimate("a", 2, 10.0)
    assert t.get("a", 2) == TimeEntry(10.0, True, 0)
    t.set_estimate("a", 2, 12.0)                  # a newer estimate replaces an estimate
    assert t.get("a", 2) == TimeEntry(12.0, True, 0)
    t.record("a", 2, 4.0, round=3)
    assert t.get("a", 2) == TimeEntry(4.0, False, 3)
    t.set_estimate("a", 2, 99.0)                  # ... but never a measurement
    assert t.get("a", 2) == TimeEntry(4.0, False, 3)
    t.record("a", 2, 5.0, round=7)                # a newer measurement replaces the older
    assert t.get("a", 2) == TimeEntry(5.0, False, 7)
    assert t.get("a", 3) is None and t.get("b", 2) is None
    assert t.agents() == ["a"] and t.splits() == [2] and len(t) == 1


def test_table_rejects_bad_values():
    t = ClientTimeTable()
    for bad in (-1.0, math.nan, math.inf, "3"):
        with pytest.raises(ValueError, match="seconds"):
            t.record("a", 1, bad, 1)
        with pytest.raises(ValueError, match="seconds"):
            t.set_estimate("a", 1, bad)
    with pytest.raises(ValueError, match="split"):
        t.record("a", 0, 1.0, 1)
    with pytest.raises(ValueError, match="round"):
        t.record("a", 1, 1.0, -1)
    assert len(t) == 0


def test_json_round_trip_and_format():
    t = _hand_table()
    t.set_estimate("new", 2, 3.5)
    d = json.loads(json.dumps(t.to_json()))       # through real JSON: keys become strings
    t2 = ClientTimeTable.from_json(d)
    assert t2 == t
    assert t2.get("new", 2) == TimeEntry(3.5, True, 0) and t2.get("slow", 3) == TimeEntry(3.0, False, 3)
    assert median_rule(t2, ["slow", "mid", "fast"], (1, 2, 3)) == median_rule(t, ["slow", "mid", "fast"], (1, 2, 3))
    text = t2.format([1, 2, 3])
    lines = text.splitlines()
    assert "split 1" in lines[0] and "split 3" in lines[0]
    new_row = next(line for line in lines if line.startswith("new"))
    assert "3.500*" in new_row and "-" in new_row  # estimate marked, gaps shown
    slow_row = next(line for line in lines if line.startswith("slow"))
    assert "9.000" in slow_row and "*" not in slow_row
    with pytest.raises(ValueError, match="bad entry"):
        ClientTimeTable.from_json({"a": {"1": {"seconds": 1.0}}})
    with pytest.raises(ValueError, match="bad entry"):
        ClientTimeTable.from_json({"a": {"x": {"seconds": 1.0, "estimated": False, "round": 1}}})


# ---------------------------------------------------------------- Eq. 1


def test_the_estimate_equals_eq1_by_hand_for_a_mid_device():
    c = model_costs("small_cnn", (1, 28, 28), 10)[2]
    p = 320                                       # batch 32 x 10 local iterations
    flops, rate = MID
    got = _estimate(c, _device(flops, rate), 32, 10)
    # Eq. 1: T = (2|Wc| + 2 p q) / R + F_c / Comp_c + F_s / Comp_s, per-sample FLOPs x p
    by_hand = ((2 * c.client_param_bytes + 2 * p * c.activation_bytes) / rate
               + c.client_flops * p / flops + c.server_flops * p / SERVER[0])
    assert got == pytest.approx(by_hand, rel=1e-12)
    # the same numbers, literally: |Wc| = 19200 B, q = 25088 B
    assert (c.client_param_bytes, c.activation_bytes) == (19200, 25088)
    assert by_hand == pytest.approx((2 * 19200 + 2 * 320 * 25088) / 2e6 + c.client_flops * 320 / 1e10
                                    + c.server_flops * 320 / 5e10)


def test_the_estimate_prices_what_the_clock_charges():
    c = model_costs("resnet8", (3, 32, 32), 10)[3]
    (flops, rate), batch, tau = LOW, 16, 8
    p = batch * tau
    dev = _device(flops, rate, down=4 * rate)
    t0 = _estimate(c, dev, batch, tau, model="resnet8")
    assert t0 == pytest.approx(agent_round_time(
        client_flops=c.client_flops * p, server_flops=c.server_flops * p,
        bytes_up=c.client_param_bytes + p * c.activation_bytes, bytes_down=c.client_param_bytes + p * c.activation_bytes,
        client_flops_per_s=flops, server_flops_per_s=SERVER[0], uplink_bytes_per_s=rate,
        downlink_bytes_per_s=4 * rate).total_s)
    # a compressed wire: only the activation term changes (the weights travel as they are)
    t_half = _estimate(c, dev, batch, tau, ratio=0.5, model="resnet8")
    assert t0 - t_half == pytest.approx(p * c.activation_bytes / 2 * (1 / rate + 1 / (4 * rate)))
    # a measured compute speed replaces FLOPs / FLOP/s
    measured = _device(flops, rate, down=4 * rate, measured={"compute_s_per_sample": {"3": 0.01}})
    t_meas = _estimate(c, measured, batch, tau, model="resnet8")
    assert t_meas - t0 == pytest.approx(0.01 * p - c.client_flops * p / flops)
    # a latency per message: weights down and up, activations and gradients of each step
    slow = _device(flops, rate, down=4 * rate, latency_s=0.05)
    assert _estimate(c, slow, batch, tau, model="resnet8") - t0 == pytest.approx(0.05 * (2 * tau + 2))
    # the trade-off the candidates exist for: on S2FL's link-bound low device the late cut (4x smaller
    # activations) wins despite 2.5x the client FLOPs; with a near-infinite link the early cut wins
    costs = model_costs("resnet8", (3, 32, 32), 10)
    assert _estimate(costs[4], dev, batch, tau, model="resnet8") < _estimate(costs[2], dev, batch, tau, model="resnet8")
    fast = _device(flops, 1e12)
    assert _estimate(costs[4], fast, batch, tau, model="resnet8") > _estimate(costs[2], fast, batch, tau, model="resnet8")


def test_the_fleets_round_is_its_slowest_device():
    costs = model_costs("small_cnn", (1, 28, 28), 10)
    run = _run(32, 10)
    devices = [profile_from_dict({"name": n, "compute_flops": f, "link_bytes_per_s": r, "latency_s": 0.0})
               for n, (f, r) in {"low": LOW, "mid": MID, "high": HIGH}.items()]
    for s in (1, 2):
        slowest = max(_estimate(costs[s], _device(f, r), 32, 10) for f, r in (LOW, MID, HIGH))
        assert fleet_round_time(run, costs[s], devices) == pytest.approx(slowest, rel=1e-12)