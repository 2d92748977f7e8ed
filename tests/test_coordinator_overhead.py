"""The coordinator's own time in the time model: the per-agent-step overhead
(``agent_step_overhead_s``, :func:`sfl_core.timing.step_overhead_s`) that the virtual clock charges
and the planners price, the lock-step slack of step jitter (:func:`sfl_core.timing.lockstep_slack_s`),
and ``strategy: auto`` learning both from a round's measured duration."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sfl_core import timing
from sfl_core.config.run import run_config_from_dict


def _cfg(tmp_path, strategy="sfl", rounds=2, local_iters=3, **extra):
    return run_config_from_dict({
        "run": "ovh", "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid"},
        "fleet": [{"profile": "s2fl-low-low", "count": 1}, {"profile": "s2fl-mid-mid", "count": 1},
                  {"profile": "s2fl-high-high", "count": 1}],
        "rounds": rounds, "strategy": strategy, "batch_size": 16, "local_iters": local_iters,
        "output_dir": str(tmp_path / strategy), "auto": {"whole_model": False}, **extra})


def test_step_overhead_is_tau_times_agents_times_h():
    assert timing.step_overhead_s(0.002, steps=20, split_agents=4) == pytest.approx(0.16)
    assert timing.step_overhead_s(0.0, steps=20, split_agents=4) == 0.0


def test_a_cut_pays_the_overhead_in_its_fixed_part_and_the_whole_model_none(tmp_path):
    from sfl_core.fleet import AgentInfo
    from sfl_core.model.accounting import model_costs

    from sfl_core.config.run import load_profile

    cfg = _cfg(tmp_path, agent_step_overhead_s=0.003)
    costs = model_costs("small_cnn", (1, 8, 8), 10)
    info = AgentInfo("a", 0, load_profile("s2fl-mid-mid"), {}, [10] * 10, 100)
    cut, whole = costs[1], costs[max(costs)]
    base = timing.price_option(cfg, cut, "fp32", info, ratio=1.0, per_agent_step_s=0.0)
    five = timing.price_option(cfg, cut, "fp32", info, ratio=1.0, split_agents=5)
    assert five.fixed_s - base.fixed_s == pytest.approx(0.003 * cfg.local_iters * 5)
    assert five.per_sample_s == pytest.approx(base.per_sample_s)      # independent of the batch
    w0 = timing.price_option(cfg, whole, "fp32", info, ratio=1.0, per_agent_step_s=0.0)
    w5 = timing.price_option(cfg, whole, "fp32", info, ratio=1.0, split_agents=5)
    assert whole.activation_bytes == 0 and w5.fixed_s == w0.fixed_s  # no step messages, no overhead


def test_lockstep_slack_of_two_equal_agents_is_sigma_over_root_pi_per_step():
    assert timing.lockstep_slack_s([0.03, 0.03], [0.004, 0.004], steps=20) == \
        pytest.approx(20 * 0.004 / math.sqrt(math.pi), rel=1e-4)


def test_lockstep_slack_is_zero_without_jitter_or_with_one_agent():
    assert timing.lockstep_slack_s([0.03, 0.05], [0.0, 0.0], steps=20) == 0.0
    assert timing.lockstep_slack_s([], [], steps=20) == 0.0
    assert timing.lockstep_slack_s([0.03], [0.01], steps=20) == pytest.approx(0.0, abs=1e-9)
    # an agent far slower than the others: the others' bad luck never decides a step
    assert timing.lockstep_slack_s([0.1, 0.01, 0.02], [0.001, 0.002, 0.002], steps=10) == pytest.approx(0.0, abs=1e-9)


def test_lockstep_slack_matches_a_monte_carlo_of_the_steps():
    rng = np.random.default_rng(0)
    mu, sd, steps = np.array([0.030, 0.029, 0.026, 0.020]), np.array([0.002, 0.004, 0.003, 0.001]), 15
    draws = rng.normal(mu, sd, size=(200_000, steps, len(mu)))
    simulated = draws.max(axis=2).sum(axis=1).mean() - steps * mu.max()
    assert timing.lockstep_slack_s(mu, sd, steps=steps) == pytest.approx(simulated, rel=0.02)


def test_the_virtual_clock_charges_the_overhead_on_every_split_agent(tmp_path):
    from simulation import run_simulation

    plain, _ = run_simulation(_cfg(tmp_path / "a"), device="cpu", quiet=True)
    charged, _ = run_simulation(_cfg(tmp_path / "b", agent_step_overhead_s=0.002), device="cpu", quiet=True)
    for p, c in zip(plain[1:], charged[1:]):
        extra = 0.002 * 3 * len(c["completed"])
        assert c["round_time_s"] == pytest.approx(p["round_time_s"] + extra, abs=2e-4)
        assert p["accuracy"] == c["accuracy"]                 # the clock only: training is the same
        for a, row in c["agents"].items():
            assert row["coordinator_s"] == pytest.approx(extra, abs=1e-4)
            assert "coordinator_s" not in p["agents"][a]      # nothing charged, nothing recorded


def test_auto_predicts_with_the_overhead_the_virtual_clock_charges(tmp_path):
    from simulation import run_simulation

    history, _ = run_simulation(_cfg(tmp_path, strategy="auto", rounds=5, agent_step_overhead_s=0.002),
                                device="cpu", quiet=True)
    for r in history[1:]:    # what the clock charged beyond the agents is what the run said: nothing new to learn
        assert r["auto"]["overhead_s"] == pytest.approx(0.002, abs=2e-6)
        assert r["auto"]["measured_round_s"] == r["round_time_s"]
    for r in history[4:]:    # once the compute and link factors are learned
        assert abs(r["auto"]["error"]) < 0.05, r["auto"]


def test_auto_learns_the_overhead_from_a_longer_measured_round_and_keeps_it_in_the_checkpoint(tmp_path):
    from simulation import run_simulation

    cfg = _cfg(tmp_path, strategy="auto", rounds=1)
    _, engine = run_simulation(cfg, device="cpu", quiet=True)
    method = engine.method
    plan = method.current
    times = {a: p.time_s for a, p in plan.agents.items()}
    method.measured = {a: (0.5 * t, 0.5 * t, 0.0) for a, t in times.items()}
    method.unscaled = {a: (0.0, 0.0, 0.0) for a in times}
    method.overhead_s = 0.0
    beyond = 0.09                                # the round lasted 90 ms past its slowest agent
    method.record(2, times, {a: p.option.split for a, p in plan.agents.items()}, max(times.values()) + beyond)
    seen = beyond / (cfg.local_iters * len(times))
    assert method.overhead_s == pytest.approx((1 - cfg.sections["auto"].smoothing) * seen, rel=1e-3)
    assert method.last["measured_round_s"] == pytest.approx(max(times.values()) + beyond, abs=1e-4)
    method.jitter = {a: 0.003 for a in times}
    state = method.to_json()
    method.overhead_s, method.jitter = 0.0, {}
    method.load_json(state)
    assert method.overhead_s == pytest.approx((1 - cfg.sections["auto"].smoothing) * seen, rel=1e-3)
    assert method.jitter == {a: 0.003 for a in times}
    # with jitter measured, the prediction adds the lock-step slack of the plan's agents
    assert method._predicted(plan) > plan.round_s


def test_lock_step_phases_are_each_as_slow_as_their_slowest_agent(tmp_path):
    """One agent on a slow link with a deep cut (long download and upload, short steps) beside one
    with slow steps: each is the slowest in its own phases, and the round is longer than both."""
    from simulation import run_simulation
    from sfl_core.methods.auto.joint_plan import AgentPlan, JointPlan
    from sfl_core.timing import Option

    cfg = _cfg(tmp_path, strategy="auto", rounds=1, local_iters=10)
    _, engine = run_simulation(cfg, device="cpu", quiet=True)
    method = engine.method
    link = Option(split=2, codec="fp32", fixed_s=1.0, per_sample_s=0.01, weights_down_s=0.5, weights_up_s=0.5)
    steps = Option(split=1, codec="fp32", fixed_s=0.1, per_sample_s=0.1, weights_down_s=0.05, weights_up_s=0.05)
    plan = JointPlan({"a": AgentPlan(link, 10), "b": AgentPlan(steps, 10)}, deadline_s=1.1)
    assert plan.round_s == pytest.approx(1.1)
    method.jitter = {}
    assert method._phases_excess(plan) == 0.0          # no wall clock measured: the time model's sum
    method.jitter, method.weight_scales = {"a": 1e-9, "b": 1e-9}, {}
    # a: down 0.5, steps 0.01 each, up 0.5; b: down 0.05, steps 0.1 each, up 0.05 (tau = 10)
    by_hand = max(0.5 + 0.005, 0.05 + 0.05) + 9 * 0.1 + max(0.5 + 0.005, 0.05 + 0.05)
    assert method._phases_excess(plan) == pytest.approx(by_hand - 1.1)
    # measured transfers of the client portion scale its phases (here: half as long for a, whose
    # steps then take the rest of its round: (1.1 - 0.5) / 10 each)
    method.weight_scales = {"a": 0.5}
    by_hand = max(0.25 + 0.03, 0.1) + 9 * 0.1 + max(0.25 + 0.03, 0.1)
    assert method._phases_excess(plan) == pytest.approx(by_hand - 1.1)


def test_an_agents_weights_phase_is_its_first_and_last_responses_beyond_one_step():
    from coordinator.session import RoundAgent

    ra = RoundAgent("a", assignment=None, last_heard=0.0, last_sent_at=0.0)  # type: ignore[arg-type]
    assert ra.weights_phase_s == 0.0 and ra.step_jitter_s == 0.0
    ra.first_s, ra.last_s, ra.steps = 0.32, 0.27, [0.04, 0.06]
    assert ra.weights_phase_s == pytest.approx(0.32 + 0.27 - 0.05)
    assert ra.step_jitter_s == pytest.approx(np.std([0.04, 0.06], ddof=1))


def test_lockstep_phases_by_hand():
    # one agent slowest in every phase: the round is its own sum
    assert timing.lockstep_phases_s([0.5, 0.1], [0.5, 0.1], [2.0, 1.0], steps=10) == 0.0
    # a: long transfers (0.5 each way), 0.01 s steps; b: 0.05 each way, 0.1 s steps; both 1.1 s
    by_hand = (0.5 + 0.005) + 9 * 0.1 + (0.005 + 0.5)
    assert timing.lockstep_phases_s([0.5, 0.05], [0.5, 0.05], [1.1, 1.1], steps=10) == pytest.approx(by_hand - 1.1)
    assert timing.lockstep_phases_s([], [], [], steps=10) == 0.0
