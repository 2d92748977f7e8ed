"""``strategy: auto`` with ``auto.widths``: HeteroSFL's bottleneck width as one more per-agent choice
(at the run's split), priced by the time model and bounded by ``auto.max_bottleneck``; with
``widths: auto`` switched on only where the fleet's links make it pay."""

from __future__ import annotations

import pytest
import yaml

from sfl_core.model.accounting import model_costs
from sfl_core.config.run import ConfigError, DeviceProfile, run_config_from_dict
from sfl_core.fleet import AgentInfo
from sfl_core.methods import build_method
from sfl_core.methods.auto.method import WIDTHS_PAY, decide_widths, width_ladder
from sfl_core.model.zoo import build_model

SHAPE = (1, 28, 28)


def _method(**auto):
    cfg = run_config_from_dict({"run": "w", "model": "small_cnn", "strategy": "auto", "split": 2, "min_agents": 3,
                                "batch_size": 16, "local_iters": 5, "auto": {"regulate": False, **auto}})
    model = build_model(cfg.model, SHAPE, 10)
    return build_method(cfg, model, model_costs(cfg.model, SHAPE, 10))


def _agent(name: str, compute: float, link: float) -> AgentInfo:
    return AgentInfo(name, 0, DeviceProfile(name, compute_flops=compute, link_bytes_per_s=link), {}, [10] * 10, 100)


def test_a_slow_link_gets_the_narrowest_width_and_a_fast_one_sends_more():
    method = _method(widths=[1, 4, 16, 32])
    agents = {"slow-link": _agent("slow-link", 1e10, 2e4), "fast-link": _agent("fast-link", 1e10, 1e9)}
    plan = method.joint_plan(sorted(agents), agents)
    slow = plan.agents["slow-link"]
    assert (slow.option.split, slow.option.width) == (2, 1)
    assert slow.time_s == pytest.approx(plan.round_s)    # the slow link sets the round
    # what the narrow width buys: the full width at the same cut would take far longer
    full = next(o for o in method.options("slow-link", agents["slow-link"]) if (o.split, o.codec, o.width) == (2, "fp32", 32))
    assert full.time(slow.batch) > 10 * slow.time_s
    fast = plan.agents["fast-link"].option
    assert fast.width in (0, 32)                          # no squeeze where the link has room
    round_plan = method.plan(1, sorted(agents), agents)
    assert round_plan.widths.get("slow-link") == 1 and all(round_plan.widths.get(a, 0) == 0 for a, s in
                                                             round_plan.splits.items() if s != 2)


def test_an_agent_with_time_to_spare_takes_the_widest_width_that_keeps_the_round():
    method = _method(widths=[1, 4, 16, 32])
    # the slow CPU sets the round; the slow link would make it at width 1 with room to spare
    agents = {"slow-link": _agent("slow-link", 1e10, 2e4), "slow-cpu": _agent("slow-cpu", 1e6, 1e9)}
    plan = method.joint_plan(sorted(agents), agents)
    assert plan.agents["slow-cpu"].option.split == 1      # too slow to compute more than the first block
    slow = plan.agents["slow-link"]
    assert slow.time_s <= plan.round_s < _opt(method, agents["slow-link"], 2, slow.option.codec, 1).time(slow.batch) * 1e6
    assert slow.option.width > 1                          # a wider width than the fastest one fits the round
    wider = [w for w in (4, 16, 32) if w > slow.option.width]
    for w in wider:                                       # and it is the widest that does
        assert all(_opt(method, agents["slow-link"], 2, c, w).time(slow.batch) > plan.round_s for c in ("fp32", "fp16"))
    # the round is no longer than with the fastest option
    assert plan.round_s == pytest.approx(max(min(o.time(p.batch) for o in method.options(a, agents[a]))
                                             for a, p in plan.agents.items()))


def _opt(method, info, split, codec, width):
    return next(o for o in method.options(info.agent_id, info) if (o.split, o.codec, o.width) == (split, codec, width))


def test_widths_stay_within_max_bottleneck_and_cuts_stop_at_the_bottleneck():
    method = _method(widths=[1, 8, 16, 32], max_bottleneck=2)   # 32 channels -> width >= 16
    choices = method.choices()
    assert {w for s, c, w in choices if s == 2 and c == "fp32"} == {16, 32}
    assert {w for s, c, w in choices if s == 2 and c == "fp16"} == {16, 32}   # the codec has its own cap
    assert all(s <= 2 for s, _, _ in choices)         # no later cut and no whole model with a bottleneck
    assert all(w == 0 for s, _, w in choices if s != 2)
    assert {w for s, c, w in _method(widths=[1, 8, 16, 32]).choices() if s == 2} == {1, 8, 16, 32}   # default 64x
    with pytest.raises(ValueError, match="beyond the bottleneck"):
        _method(widths=[8], candidates=[1, 2, 3])
    with pytest.raises(ValueError, match="wider than the 32 channels"):
        _method(widths=[64])
    with pytest.raises(ValueError, match="max_bottleneck"):
        _method(widths=[1], candidates=[2], max_bottleneck=4)


def test_the_width_ladder_steps_by_quarters_down_to_one_channel():
    assert width_ladder(64, 64) == (1, 4, 16, 64)
    assert width_ladder(32, 64) == (1, 2, 8, 32)
    assert width_ladder(64, 16) == (4, 16, 64)
    assert width_ladder(1, 64) == (1,)


def test_the_width_ladder_never_sends_fewer_values_than_the_floor():
    # HeteroSFL's narrowest: one 8x8 channel = 64 values, kept; 4x4 maps need 4 channels
    assert width_ladder(64, 64, positions=64, min_values=64) == (1, 4, 16, 64)
    assert width_ladder(32, 64, positions=16, min_values=64) == (8, 32)
    assert width_ladder(32, 64, positions=1, min_values=64) == (32,)   # the full width always
    assert width_ladder(64, 16, positions=64, min_values=256) == (4, 16, 64)


def _fleet_cfg(tmp_path, link: float, **auto):
    profile = tmp_path / f"dev-{link:g}.yaml"
    profile.write_text(yaml.safe_dump({"name": "dev", "compute_flops": 1e10, "link_bytes_per_s": link}))
    return run_config_from_dict({"run": "w", "model": "small_cnn", "strategy": "auto", "split": 2,
                                 "fleet": [{"profile": str(profile), "count": 3}], "batch_size": 16,
                                 "local_iters": 5, "auto": auto})


def _decide(cfg):
    return decide_widths(cfg, build_model(cfg.model, SHAPE, 10), model_costs(cfg.model, SHAPE, 10))


def test_widths_auto_switch_on_where_the_links_make_them_pay_and_say_why(tmp_path):
    slow = _decide(_fleet_cfg(tmp_path, 2e4, widths="auto"))        # activations dominate the round
    assert slow.widths == (1, 2, 8, 32) and "predicted round" in slow.why and f"{WIDTHS_PAY:g}x" in slow.why
    fast = _decide(_fleet_cfg(tmp_path, 1e9, widths="auto"))        # compute dominates: no bottleneck
    assert fast.widths == () and fast.why.startswith("bottleneck: off")
    assert _decide(_fleet_cfg(tmp_path, 2e4, widths="auto", max_bottleneck=8)).widths == (8, 32)
    assert _decide(_fleet_cfg(tmp_path, 2e4)).widths == (1, 2, 8, 32)   # the default: auto
    # 14x14 maps: one channel sends 196 values; a floor of 400 needs 8 channels
    assert _decide(_fleet_cfg(tmp_path, 2e4, min_bottleneck_values=400)).widths == (8, 32)
    assert _decide(_fleet_cfg(tmp_path, 2e4, widths=None)).widths == ()
    narrow = _decide(_fleet_cfg(tmp_path, 2e4, min_bottleneck_values=196 * 32))   # only the full width sends enough
    assert narrow.widths == () and "min_bottleneck_values" in narrow.why
    assert _decide(_fleet_cfg(tmp_path, 2e4, widths=[4, 32])).widths == (4, 32)
    # the method plans with the decision, and says it in its notes
    cfg = _fleet_cfg(tmp_path, 2e4, widths="auto", candidates=[1, 2, 3])   # cuts past the bottleneck are dropped, not refused
    method = build_method(cfg, build_model(cfg.model, SHAPE, 10), model_costs(cfg.model, SHAPE, 10))
    assert method.widths == (1, 2, 8, 32) and max(method.candidates) == 2
    assert any(n.startswith("bottleneck: widths") for n in method.notes(3))


def test_widths_auto_without_a_fleet_in_the_config_stays_off():
    cfg = run_config_from_dict({"run": "w", "model": "small_cnn", "strategy": "auto", "split": 2, "min_agents": 3,
                                "auto": {"widths": "auto"}})
    assert _decide(cfg).widths == () and "no fleet" in _decide(cfg).why


def test_widths_accept_auto_a_list_or_null_only():
    for bad in ("some", [0], []):
        with pytest.raises(ConfigError, match="auto.widths"):
            run_config_from_dict({"run": "w", "strategy": "auto", "min_agents": 1, "auto": {"widths": bad}})


def test_the_global_model_carries_the_bottleneck_auto_decided(tmp_path):
    from coordinator.export import run_model
    on, off = run_model(_fleet_cfg(tmp_path, 2e4, widths="auto"), SHAPE, 10), run_model(_fleet_cfg(tmp_path, 1e9, widths="auto"), SHAPE, 10)
    assert list(on.bottlenecks) == ["2"] and on.bottleneck(2).infer_width == 1 and not off.bottlenecks


def test_a_heterosfl_bottleneck_under_auto_is_refused_with_the_key_to_use():
    with pytest.raises(ConfigError, match="auto.widths"):
        run_config_from_dict({"run": "w", "strategy": "auto", "min_agents": 1, "hetero": {"width": 8}})


def test_a_run_with_widths_auto_trains_the_bottleneck_it_decided_on(tmp_path):
    from simulation import run_simulation

    slow_link = tmp_path / "slow-link.yaml"     # s2fl-high-low's compute on a 10x slower link
    slow_link.write_text(yaml.safe_dump({"name": "slow-link", "compute_flops": 2e10, "link_bytes_per_s": 1e5}))
    fleet = [{"profile": "s2fl-low-high", "count": 1}, {"profile": str(slow_link), "count": 1},
             {"profile": "s2fl-high-high", "count": 1}]
    cfg = run_config_from_dict({"run": "w", "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid"},
                                "fleet": fleet, "rounds": 2, "strategy": "auto", "batch_size": 16, "local_iters": 5,
                                "output_dir": str(tmp_path / "out"),  # widths: auto is the default
                                "auto": {"regulate": False}})   # equal batches: the slow link cannot shed samples
    history, engine = run_simulation(cfg, device="cpu")
    assert engine.method.widths == (8, 32) and engine.model.bottleneck(2) is not None   # 4x4 maps: >= 4 channels
    sent = [v["width"] for v in history[-1]["auto"]["assign"].values() if v["split"] == 2]
    assert all(w in engine.method.widths for w in sent) and min(sent) < max(engine.method.widths)
    # the slow link sends the narrowest width of the round
    slow = next(a for a, i in engine.registry.agents.items() if i.profile.name == "slow-link")
    assert history[-1]["auto"]["assign"][slow]["width"] == min(sent)
