"""``strategy: auto`` with ``auto.widths``: HeteroSFL's bottleneck width as one more per-agent choice
(at the run's split), priced by the time model and bounded by ``auto.max_compression``."""

from __future__ import annotations

import pytest

from sfl_core.accounting import model_costs
from sfl_core.config import ConfigError, DeviceProfile, run_config_from_dict
from sfl_core.fleet import AgentInfo
from sfl_core.methods import build_method
from sfl_core.models import build_model

SHAPE = (1, 28, 28)


def _method(**auto):
    cfg = run_config_from_dict({"run": "w", "model": "small_cnn", "strategy": "auto", "split": 2, "min_agents": 3,
                                "batch_size": 16, "local_iters": 5, "auto": {"regulate": False, **auto}})
    model = build_model(cfg.model, SHAPE, 10)
    return build_method(cfg, model, model_costs(cfg.model, SHAPE, 10))


def _agent(name: str, compute: float, link: float) -> AgentInfo:
    return AgentInfo(name, 0, DeviceProfile(name, compute_flops=compute, link_bytes_per_s=link), {}, [10] * 10, 100)


def test_a_slow_link_gets_the_narrowest_width_and_a_fast_one_sends_more():
    method = _method(widths=[1, 4, 16, 32], max_compression=32)
    agents = {"slow-link": _agent("slow-link", 1e10, 2e4), "fast-link": _agent("fast-link", 1e10, 1e9),
              "slow-cpu": _agent("slow-cpu", 1e6, 1e9)}
    plan = method.joint_plan(sorted(agents), agents)
    slow = plan.agents["slow-link"]
    assert (slow.option.split, slow.option.width) == (2, 1)
    # what the narrow width buys: the full width at the same cut would take far longer
    full = next(o for o in method.options("slow-link", agents["slow-link"]) if (o.split, o.codec, o.width) == (2, "fp32", 32))
    assert full.time(slow.batch) > 10 * slow.time_s
    assert plan.agents["slow-cpu"].option.split == 1      # too slow to compute more than the first block
    round_plan = method.plan(1, sorted(agents), agents)
    assert round_plan.widths.get("slow-link") == 1 and all(round_plan.widths.get(a, 0) == 0 for a, s in
                                                             round_plan.splits.items() if s != 2)


def test_widths_stay_within_max_compression_and_cuts_stop_at_the_bottleneck():
    method = _method(widths=[1, 8, 16, 32])           # default max_compression 2: 32 channels -> width >= 16
    choices = method.choices()
    assert {w for s, c, w in choices if s == 2 and c == "fp32"} == {16, 32}
    assert {w for s, c, w in choices if s == 2 and c == "fp16"} == {32}
    assert all(s <= 2 for s, _, _ in choices)         # no later cut and no whole model with a bottleneck
    assert all(w == 0 for s, _, w in choices if s != 2)
    with pytest.raises(ValueError, match="beyond the bottleneck"):
        _method(widths=[8], candidates=[1, 2, 3])
    with pytest.raises(ValueError, match="wider than the 32 channels"):
        _method(widths=[64])
    with pytest.raises(ValueError, match="max_compression"):
        _method(widths=[1], candidates=[2], max_compression=4)


def test_a_heterosfl_bottleneck_under_auto_is_refused_with_the_key_to_use():
    with pytest.raises(ConfigError, match="auto.widths"):
        run_config_from_dict({"run": "w", "strategy": "auto", "min_agents": 1, "hetero": {"width": 8}})
