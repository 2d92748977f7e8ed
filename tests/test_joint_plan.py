"""The joint planner (sfl_core.methods.auto.joint_plan) on hand-built fleets whose optimum is known."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sfl_core.methods.auto.joint_plan import label_skew, limit_skew, plan_round
from sfl_core.timing import Option, option_for

TAU = 5

# A model with two cuts: the early cut computes little on the device but sends big activations;
# the late cut computes 8x more and sends 16x less.
EARLY = dict(split=1, client_flops=1e6, server_flops=8e6, weight_bytes=1e4, activation_bytes=64e3)
LATE = dict(split=3, client_flops=8e6, server_flops=1e6, weight_bytes=1e5, activation_bytes=4e3)


def options(compute: float, link: float, *, codecs=("fp32",), mem_per_sample=(0.0, 0.0), latency=0.0):
    out = []
    for cut, mem in zip((EARLY, LATE), mem_per_sample):
        for codec, ratio in (("fp32", 1.0), ("fp16", 0.5), ("int8", 0.25)):
            if codec in codecs:
                out.append(option_for(
                    split=cut["split"], codec=codec, tau=TAU, client_flops=cut["client_flops"],
                    server_flops=cut["server_flops"], weight_bytes=cut["weight_bytes"],
                    activation_bytes=cut["activation_bytes"] * ratio, compute_flops_per_s=compute,
                    server_flops_per_s=1e12, uplink_bytes_per_s=link, downlink_bytes_per_s=link,
                    latency_s=latency, messages=2 * TAU + 2, mem_per_sample=mem))
    return out


def test_option_is_the_time_model_line():
    o = options(1e8, 1e6)[0]
    # 8 samples a step, 5 steps: compute 40 x 1e6 / 1e8, transfer 2 x (1e4 + 40 x 64e3) / 1e6, server 40 x 8e6 / 1e12
    expected = 40 * 1e6 / 1e8 + 2 * (1e4 + 40 * 64e3) / 1e6 + 40 * 8e6 / 1e12
    assert o.time(8) == pytest.approx(expected)
    assert o.compute_per_sample_s * 8 == pytest.approx(40 * 1e6 / 1e8)


def test_slow_compute_fast_link_takes_the_earliest_cut_and_the_reverse_the_latest():
    fleet = {"slow-cpu": options(1e7, 1e8), "slow-link": options(1e10, 1e5)}
    plan = plan_round(fleet, {}, total=32, lo=16, hi=16, regulate=False)
    assert plan.agents["slow-cpu"].option.split == 1
    assert plan.agents["slow-link"].option.split == 3


def test_slow_link_takes_the_strongest_allowed_codec():
    fleet = {"a": options(1e10, 1e5, codecs=("fp32", "fp16", "int8")),
             "b": options(1e10, 1e5, codecs=("fp32", "fp16"))}
    plan = plan_round(fleet, {}, total=32, lo=16, hi=16, regulate=False)
    assert plan.agents["a"].option.codec == "int8" and plan.agents["b"].option.codec == "fp16"


def test_a_portion_that_does_not_fit_memory_is_never_assigned():
    # the late cut needs 1 MB per sample; the device has 4 MB: it would prefer the late cut (slow link)
    fleet = {"small": options(1e10, 1e5, mem_per_sample=(0.0, 1e6)), "big": options(1e10, 1e5)}
    memory = {"small": 4e6, "big": None}
    for regulate in (False, True):
        plan = plan_round(fleet, memory, total=32, lo=2, hi=64, regulate=regulate)
        small = plan.agents["small"]
        assert small.option.split == 1 or small.option.memory(small.batch) <= 4e6
        assert plan.agents["big"].option.split == 3
    plan = plan_round({"tiny": options(1e10, 1e5, mem_per_sample=(1e6, 1e6))}, {"tiny": 1e6}, total=16, lo=2, hi=16)
    assert plan.infeasible == ["tiny"] and plan.agents == {}


def test_regulated_batches_keep_the_merged_batch_and_equalise_the_finish():
    fleet = {"fast": options(1e9, 1e7), "mid": options(3e8, 3e6), "slow": options(1e8, 1e6)}
    plan = plan_round(fleet, {}, total=96, lo=2, hi=96)
    batches = {a: p.batch for a, p in plan.agents.items()}
    assert sum(batches.values()) == 96
    assert batches["fast"] > batches["mid"] > batches["slow"]
    equal = plan_round(fleet, {}, total=96, lo=32, hi=32, regulate=False)
    assert plan.round_s < 0.6 * equal.round_s
    assert plan.waiting_s < equal.waiting_s


@pytest.mark.parametrize("seed", range(6))
def test_bisection_matches_brute_force_on_small_fleets(seed):
    rng = np.random.default_rng(seed)
    fleet = {f"a{i}": options(10 ** rng.uniform(7, 10), 10 ** rng.uniform(5, 7), codecs=("fp32", "fp16"))
             for i in range(3)}
    total, lo, hi = 24, 2, 16
    plan = plan_round(fleet, {}, total=total, lo=lo, hi=hi, tol=1e-9)
    best = np.inf
    ids = sorted(fleet)
    for b in itertools.product(range(lo, hi + 1), repeat=3):
        if sum(b) != total:
            continue
        best = min(best, max(min(o.time(x) for o in fleet[a]) for a, x in zip(ids, b)))
    assert plan.round_s == pytest.approx(best, rel=1e-6)


def test_limit_skew_bounds_the_label_mix():
    counts = {"a": [100, 0], "b": [0, 100]}
    target = np.array([0.5, 0.5])
    equal = {"a": 16, "b": 16}
    skewed = {"a": 30, "b": 2}
    assert label_skew(equal, counts, target) == pytest.approx(0.0, abs=1e-9)
    fixed = limit_skew(skewed, equal, counts, target, epsilon=0.05)
    assert sum(fixed.values()) == 32
    assert label_skew(fixed, counts, target) <= 0.05 + 1e-3
    assert fixed["a"] > fixed["b"]       # moved back only as far as it must
    assert limit_skew(equal, equal, counts, target, 0.05) == equal


def test_bad_batch_bounds_are_refused():
    with pytest.raises(ValueError, match="lo <= hi"):
        plan_round({"a": options(1e9, 1e6)}, {}, total=8, lo=4, hi=2)


def test_option_without_deadline_room_fits_nothing():
    o = Option(split=1, codec="fp32", fixed_s=5.0, per_sample_s=1.0)
    assert o.largest_batch(4.0, None, 10) == -1 and o.largest_batch(8.0, None, 10) == 3


def test_weights_smaller_than_activations_put_the_whole_model_on_the_agent():
    def whole(compute, link, weight_bytes):
        return option_for(split=4, codec="fp32", tau=TAU, client_flops=9e6, server_flops=0.0,
                          weight_bytes=weight_bytes, activation_bytes=0.0, compute_flops_per_s=compute,
                          server_flops_per_s=1e12, uplink_bytes_per_s=link, downlink_bytes_per_s=link,
                          latency_s=0.01, messages=2)

    fleet = {"fast-cpu": options(1e10, 1e5, latency=0.01) + [whole(1e10, 1e5, 2e5)],
             "slow-cpu": options(1e7, 1e8, latency=0.01) + [whole(1e7, 1e8, 2e5)],
             "heavy": options(1e10, 1e5, latency=0.01) + [whole(1e10, 1e5, 1e8)]}
    plan = plan_round(fleet, {}, total=48, lo=16, hi=16, regulate=False)
    assert plan.agents["fast-cpu"].option.split == 4      # 0.2 MB of weights beat 80 x 4 kB of activations
    assert plan.agents["slow-cpu"].option.split == 1      # too slow to run the whole model
    assert plan.agents["heavy"].option.split == 3         # 100 MB of weights cost more than activations


def test_an_agent_with_slack_sends_the_least_squeezed_bottleneck_that_keeps_the_round():
    # agent "b" sets the round at 10 s; "a" could finish in 2 s with width 1, in 9 s with width 8,
    # in 12 s at full width: it takes width 8 (the round stays 10 s); alone, "a" keeps width 1
    widths = {1: 2.0, 8: 9.0, 32: 12.0}
    a = [Option(split=2, codec="fp32", fixed_s=t, per_sample_s=0.0, width=w) for w, t in widths.items()]
    b = [Option(split=1, codec="fp32", fixed_s=10.0, per_sample_s=0.0)]
    plan = plan_round({"a": a, "b": b}, {}, total=2, lo=1, hi=1, regulate=False)
    assert plan.agents["a"].option.width == 8 and plan.round_s == pytest.approx(10.0)
    regulated = plan_round({"a": a, "b": b}, {}, total=2, lo=1, hi=1)
    assert regulated.agents["a"].option.width == 8 and regulated.round_s == pytest.approx(10.0)
    assert plan_round({"a": a}, {}, total=1, lo=1, hi=1).agents["a"].option.width == 1
    # without bottlenecks the fastest option stands, as before
    c = [Option(split=1, codec="fp16", fixed_s=1.0, per_sample_s=0.0), Option(split=1, codec="fp32", fixed_s=3.0, per_sample_s=0.0)]
    assert plan_round({"c": c, "b": b}, {}, total=2, lo=1, hi=1).agents["c"].option.codec == "fp16"
