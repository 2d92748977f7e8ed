"""The time model of steps in flight (``window``), by hand: the pipeline's bound, what it hides
of a round, the planner's lines (exact for the largest batch by a deadline), the window
``auto`` chooses, and that the virtual clock charges what the planners predict."""

from __future__ import annotations

import dataclasses
import math

import pytest

from coordinator.clock import AgentWork
from simulation.clock import VirtualClock
from sfl_core import timing
from sfl_core.config.run import DeviceProfile, run_config_from_dict
from sfl_core.fleet import AgentInfo
from sfl_core.model.accounting import model_costs


def test_a_step_in_flight_repeats_at_the_busiest_resource_or_the_round_trip_over_the_window():
    # compute 10 ms, up 40 ms, server 2 ms, down 30 ms, latency 5 ms each way: a 92 ms chain
    step = dict(client_s=0.010, up_s=0.040, server_s=0.002, down_s=0.030, latency_s=0.005)
    assert timing.pipelined_step_s(**step, window=1) == pytest.approx(0.092)
    assert timing.pipelined_step_s(**step, window=2) == pytest.approx(0.046)   # the round trip over 2
    assert timing.pipelined_step_s(**step, window=4) == pytest.approx(0.040)   # the uplink
    assert timing.pipelined_step_s(**step, window=16) == pytest.approx(0.040)
    compute_bound = {**step, "client_s": 0.200}
    assert timing.pipelined_step_s(**compute_bound, window=4) == pytest.approx(0.200)


def test_a_full_duplex_link_both_ways_busy_bounds_the_pipeline_at_its_both_ways_rates():
    """Both directions at once, the uplink keeps 80 % of its rate: its 40 ms a step become
    50 ms, the bound at 4 in flight; lock-step, one direction at a time, is as before."""
    step = dict(client_s=0.010, up_s=0.040, server_s=0.002, down_s=0.030, latency_s=0.005)
    assert timing.pipelined_step_s(**step, window=1, both_ways=(0.8, 1.0)) == pytest.approx(0.092)
    assert timing.pipelined_step_s(**step, window=4, both_ways=(0.8, 1.0)) == pytest.approx(0.050)
    assert timing.pipelined_step_s(**step, window=4, both_ways=(1.0, 0.5)) == pytest.approx(0.060)   # the downlink
    assert timing.pipelined_step_s(**step, window=2, both_ways=(0.8, 1.0)) == pytest.approx(0.050)
    # a half-duplex medium takes turns: its directions are never busy at once
    assert timing.pipelined_step_s(**step, window=4, half_duplex=True, both_ways=(0.5, 0.5)) == pytest.approx(0.070)


def test_on_a_half_duplex_link_the_activations_and_the_gradients_take_turns():
    """A WiFi cell carries one direction at a time: the uplink and the downlink are one
    resource, busy for both transfers of every step, and a window hides only the rest."""
    step = dict(client_s=0.010, up_s=0.040, server_s=0.002, down_s=0.030, latency_s=0.005)
    assert timing.pipelined_step_s(**step, window=1, half_duplex=True) == pytest.approx(0.092)
    assert timing.pipelined_step_s(**step, window=2, half_duplex=True) == pytest.approx(0.070)   # up + down
    assert timing.pipelined_step_s(**step, window=8, half_duplex=True) == pytest.approx(0.070)
    kw = dict(client_s=0.10, up_s=0.40, server_s=0.02, down_s=0.30, latency_s=0.005)
    assert timing.pipeline_overlap_s(steps=10, window=4, half_duplex=True, **kw) == pytest.approx(9 * (0.092 - 0.070))


def test_a_window_hides_all_steps_but_the_first_ones_chain():
    # 10 steps with the totals of 10 x the chain above
    kw = dict(client_s=0.10, up_s=0.40, server_s=0.02, down_s=0.30, latency_s=0.005)
    assert timing.pipeline_overlap_s(steps=10, window=1, **kw) == 0.0
    assert timing.pipeline_overlap_s(steps=1, window=4, **kw) == 0.0
    assert timing.pipeline_overlap_s(steps=10, window=4, **kw) == pytest.approx(9 * (0.092 - 0.040))
    assert timing.pipeline_overlap_s(steps=10, window=2, **kw) == pytest.approx(9 * (0.092 - 0.046))


LINK_BOUND = dict(split=1, codec="fp32", tau=10, client_flops=1e6, server_flops=1e6, weight_bytes=1e5,
                  activation_bytes=1e4, compute_flops_per_s=1e9, server_flops_per_s=1e11,
                  uplink_bytes_per_s=1e6, downlink_bytes_per_s=2e6, latency_s=0.02, messages=22)


def by_hand(batch: int, window: int, half_duplex: bool = False, both_ways: tuple = (1.0, 1.0)) -> float:
    """LINK_BOUND's round: weights both ways, the first step's chain, then 9 pipelined steps."""
    c, u, d, v = batch * 1e-3, batch * 1e4 / 1e6, batch * 1e4 / 2e6, batch * 1e-5
    chain = c + u + d + v + 2 * 0.02
    weights = 1e5 / 1e6 + 1e5 / 2e6 + 2 * 0.02
    links = (u + d,) if half_duplex else (u / both_ways[0], d / both_ways[1])
    return weights + chain + 9 * max(chain / window, c, v, *links)


@pytest.mark.parametrize("half_duplex, both_ways", [(False, (1.0, 1.0)), (True, (1.0, 1.0)), (False, (0.7, 0.9))])
@pytest.mark.parametrize("window", [1, 2, 4, 8])
def test_the_planners_round_is_the_pipelines_by_hand_at_every_batch(window, half_duplex, both_ways):
    option = timing.option_for(**LINK_BOUND, window=window, half_duplex=half_duplex, both_ways=both_ways)
    assert option.window == window
    for batch in (0, 1, 7, 32, 500):
        assert option.time(batch) == pytest.approx(by_hand(batch, window, half_duplex, both_ways), rel=1e-9)
        assert option.serial_time(batch) == pytest.approx(by_hand(batch, 1), rel=1e-9)


@pytest.mark.parametrize("window", [1, 2, 4])
def test_the_largest_batch_by_a_deadline_is_exact_with_a_window(window):
    option = timing.option_for(**LINK_BOUND, window=window)
    for deadline in (0.5, 1.0, 3.7, 10.0):
        b = option.largest_batch(deadline, None, 10_000)
        assert option.time(b) <= deadline + 1e-9 < option.time(b + 1)
    assert option.largest_batch(0.01, None, 100) == -1   # not even the weights fit


def _cfg(**over):
    return run_config_from_dict({"run": "pt", "model": "small_cnn", "data": {"dataset": "digits"},
                                 "fleet": [{"profile": "jetson-nano", "count": 1}], "strategy": "sfl", "split": 2,
                                 "batch_size": 16, "local_iters": 10, **over})


def _agent(compute_flops: float, link: float, half_duplex: bool = False, bidir: float | None = None) -> AgentInfo:
    profile = DeviceProfile(name="x", compute_flops=compute_flops, link_bytes_per_s=link, latency_s=0.005,
                            half_duplex=half_duplex, bidir_link_bytes_per_s=bidir, bidir_downlink_bytes_per_s=bidir)
    return AgentInfo(agent_id="a", index=0, profile=profile, measured={}, label_counts=[], num_samples=0)


def test_auto_takes_the_smallest_window_within_five_percent_of_the_fastest():
    cfg = _cfg(window="auto")
    cost = model_costs("small_cnn", (1, 8, 8), 10)[2]
    slow_link = timing.price_option(cfg, cost, "fp32", _agent(1e10, 2e5), ratio=1.0)
    slow_compute = timing.price_option(cfg, cost, "fp32", _agent(1e6, 1e9), ratio=1.0)
    assert slow_compute.window == 1        # its steps are its own compute: nothing to hide
    assert slow_link.window > 1
    priced = {w: timing.price_option(cfg, cost, "fp32", _agent(1e10, 2e5), ratio=1.0, window=w).time(16)
              for w in timing.AUTO_WINDOWS}
    assert slow_link.time(16) <= min(priced.values()) * (1 + timing.WINDOW_SLACK)
    smaller = [w for w in timing.AUTO_WINDOWS if w < slow_link.window]
    assert all(priced[w] > min(priced.values()) * (1 + timing.WINDOW_SLACK) for w in smaller)
    # on a half-duplex link the same device's window hides only its compute and latency: not
    # 5 % of its round, so auto keeps it in lock-step
    assert timing.price_option(cfg, cost, "fp32", _agent(1e10, 2e5, half_duplex=True), ratio=1.0).window == 1
    # withheld labels keep an agent in lock-step whatever the window
    withheld = _agent(1e10, 2e5)
    withheld.privacy = {"withhold_labels": True}
    assert timing.price_option(_cfg(window=4), cost, "fp32", withheld, ratio=1.0).window == 1


def test_each_agents_window_is_its_plans_else_the_runs_priced_and_in_lock_step_nothing_is_priced(monkeypatch):
    from sfl_core.methods.base import RoundPlan
    costs = model_costs("small_cnn", (1, 8, 8), 10)
    plan = RoundPlan(splits={"a": 2, "b": 2}, groups=[["a", "b"]], windows={"b": 2})
    slow_link = _agent(1e10, 2e5)
    assert timing.window_for(_cfg(window="auto"), costs, plan, "a", slow_link) > 1
    assert timing.window_for(_cfg(window=4), costs, plan, "a", slow_link) == 4
    assert timing.window_for(_cfg(window=4), costs, plan, "b", slow_link) == 2       # the plan's
    monkeypatch.setattr(timing, "price_option", lambda *a, **k: pytest.fail("lock-step priced a window"))
    assert timing.window_for(_cfg(window=1), costs, plan, "a", slow_link) == 1


@pytest.mark.parametrize("half_duplex, bidir", [(False, None), (True, None), (False, 1.5e5)])
def test_the_virtual_clock_charges_what_the_planner_predicts_with_a_window(half_duplex, bidir):
    """One entry point: a round of the bytes and FLOPs the option assumes, charged by the
    virtual clock, lasts what :func:`price_option` predicted, on either kind of link and on a
    full-duplex one that moves less each way while both are busy."""
    cfg = _cfg(window=4)
    cost = model_costs("small_cnn", (1, 8, 8), 10)[2]
    info = _agent(5e8, 2e5, half_duplex=half_duplex, bidir=bidir)
    option = timing.price_option(cfg, cost, "fp32", info, ratio=1.0)
    batch, tau = 16, cfg.local_iters
    samples = batch * tau
    step_bytes = samples * cost.activation_bytes
    work = AgentWork(measured_s=0.0, compute_s=0.0, server_s=0.0, client_flops=cost.client_flops * samples,
                     server_flops=cost.server_flops * samples, bytes_up=cost.client_param_bytes + step_bytes,
                     bytes_down=cost.client_param_bytes + step_bytes, messages=2 * tau + 2, profile=info.profile,
                     server_flops_per_s=cfg.server_flops, steps=tau, window=4, step_bytes_up=step_bytes,
                     step_bytes_down=step_bytes)
    charged = VirtualClock().agent_time(work)
    assert charged.overlap_s > 0
    assert charged.total_s == pytest.approx(option.time(batch), rel=1e-9)
    assert math.isclose(charged.total_s + charged.overlap_s, option.serial_time(batch), rel_tol=1e-9)
    if bidir:   # the link both ways busy bounds the pipeline: it hides less than at one-way rates
        one_way = VirtualClock().agent_time(dataclasses.replace(work, profile=_agent(5e8, 2e5).profile))
        assert charged.total_s > one_way.total_s
