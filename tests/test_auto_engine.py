"""``strategy: auto`` inside the engine (simulation): per-agent assignments that follow the fleet,
a plan that changes after a capacity drop, the planner's error in the metrics, and real training."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import yaml

from sfl_core.config.run import run_config_from_dict


def _cfg(tmp_path, fleet, rounds=4, local_iters=5, **auto):
    return run_config_from_dict({
        "run": "auto", "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid"},
        "fleet": fleet, "rounds": rounds, "strategy": "auto", "batch_size": 16, "lr": 0.05, "momentum": 0.5,
        "local_iters": local_iters, "output_dir": str(tmp_path / "out"), "auto": auto,
    })


def _by_profile(engine, record):
    return {engine.registry.agents[a].profile.name: v for a, v in record["auto"]["assign"].items()}


def test_unequal_agents_get_different_assignments_and_the_model_learns(tmp_path):
    from simulation import run_simulation

    fleet = [{"profile": "s2fl-low-high", "count": 1}, {"profile": "s2fl-high-low", "count": 1},
             {"profile": "s2fl-high-high", "count": 1}]
    history, engine = run_simulation(_cfg(tmp_path, fleet, rounds=6), device="cpu")
    last = _by_profile(engine, history[-1])
    # agents of different classes get different assignments
    assert len({(v["split"], v["codec"], v["batch"]) for v in last.values()}) == 3
    # the fast device trains the largest batch; the merged batch keeps its size
    assert last["s2fl-high-high"]["batch"] == max(v["batch"] for v in last.values())
    assert sum(v["batch"] for v in last.values()) == 3 * 16
    # what the agents were told is what the plan says
    for a, v in history[-1]["auto"]["assign"].items():
        assert history[-1]["agents"][a]["split"] == v["split"] and history[-1]["agents"][a]["batch_size"] == v["batch"]
    # the planner's prediction is recorded next to the clock's measurement, and close to it once learned
    assert abs(history[-1]["auto"]["error"]) < 0.25
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.3


def test_a_throttled_device_gets_a_lighter_assignment_within_a_few_rounds(tmp_path):
    prof = tmp_path / "throttled.yaml"
    prof.write_text(yaml.safe_dump({"name": "throttled", "compute_flops": 2e10, "link_bytes_per_s": 5e6,
                                    "capacity": [{"from_round": 3, "compute": 0.05, "link": 1.0}]}))
    from simulation import run_simulation

    fleet = [{"profile": str(prof), "count": 1}, {"profile": "s2fl-high-high", "count": 1}]
    history, engine = run_simulation(_cfg(tmp_path, fleet, rounds=6), device="cpu")
    before, after = _by_profile(engine, history[2]), _by_profile(engine, history[6])
    # 20x less compute: a shallower cut or a smaller batch for it, more of the batch for the other
    assert (after["throttled"]["split"], after["throttled"]["batch"]) < (before["throttled"]["split"],
                                                                         before["throttled"]["batch"])
    assert after["throttled"]["batch"] < before["throttled"]["batch"]
    assert after["s2fl-high-high"]["batch"] > before["s2fl-high-high"]["batch"]
    # the speed factor it learned says "about 20x slower compute"
    assert engine.method.scales[next(a for a in engine.registry.agents
                                     if engine.registry.agents[a].profile.name == "throttled")][0] > 5


def test_memory_limit_keeps_a_device_off_the_portions_it_cannot_hold(tmp_path):
    prof = tmp_path / "small-ram.yaml"
    # the twin of s2fl-high-low with 300 kB for training: the deepest cut's weights alone do not fit,
    # and with 20 steps a round its small activations make that cut the twin's fastest
    prof.write_text(yaml.safe_dump({"name": "small-ram", "compute_flops": 2e10, "link_bytes_per_s": 1e6,
                                    "memory_bytes": 3e5}))
    from simulation import run_simulation

    fleet = [{"profile": str(prof), "count": 1}, {"profile": "s2fl-high-low", "count": 1}]
    # widths: null, so the deepest cut stays an option (a bottleneck would stop the cuts at split 2)
    history, engine = run_simulation(_cfg(tmp_path, fleet, rounds=3, local_iters=20, widths=None), device="cpu")
    cost = engine.method.costs
    twin_took_more = False
    for record in history[1:]:
        got = _by_profile(engine, record)
        s, b = got["small-ram"]["split"], got["small-ram"]["batch"]
        # weights, gradients and momentum, plus every client activation (and its gradient) per sample
        assert 3 * cost[s].client_param_bytes + 2 * b * cost[s].client_activation_bytes <= 3e5
        t, tb = got["s2fl-high-low"]["split"], got["s2fl-high-low"]["batch"]
        twin_took_more |= 3 * cost[t].client_param_bytes + 2 * tb * cost[t].client_activation_bytes > 3e5
    assert twin_took_more   # without the limit the same device is given more than 300 kB


def test_learned_speed_factors_survive_a_checkpoint(tmp_path):
    from simulation import run_simulation
    from sfl_core.methods import build_method

    prof = tmp_path / "throttled.yaml"
    prof.write_text(yaml.safe_dump({"name": "throttled", "compute_flops": 2e10, "link_bytes_per_s": 5e6,
                                    "capacity": [{"from_round": 1, "compute": 0.1, "link": 0.5}]}))
    cfg = _cfg(tmp_path, [{"profile": str(prof), "count": 1}, {"profile": "s2fl-high-high", "count": 1}], rounds=2)
    _, engine = run_simulation(cfg, device="cpu")
    state = engine.method.to_json()
    fresh = build_method(cfg, engine.method.model, engine.method.costs)
    fresh.load_json(state)
    assert fresh.scales == engine.method.scales and len(fresh.scales) == 2
    throttled = max(fresh.scales.values())
    assert throttled[0] > 5 and 1.5 < throttled[1] < 2.5     # 10x slower compute, 2x slower link, as learned


@pytest.mark.parametrize("seed", range(4))
def test_auto_never_predicts_a_longer_round_than_the_plans_it_could_have_made(seed):
    """SFL's plan (one cut, equal batches) and S2FL's (a cut per agent among the same candidates,
    equal batches) are in auto's search space, so under the time model auto's round is never
    longer; nor is it when the label-mix bound pulls its batches back towards equal ones."""
    import numpy as np

    from sfl_core.model.accounting import model_costs
    from sfl_core.fleet import fleet_of
    from sfl_core.methods.preview import preview
    from sfl_core.model.zoo import build_model

    rng = np.random.default_rng(seed)
    names = ["s2fl-low-low", "s2fl-low-high", "s2fl-high-low", "s2fl-high-high", "s2fl-mid-mid", "jetson-nano", "rpi4"]
    fleet = [{"profile": str(p), "count": int(rng.integers(1, 3))} for p in rng.choice(names, 4, replace=False)]
    # the time planner's search space: the whole model allowed and no learning option, which auto
    # would otherwise decide on these skewed label counts (trading round time for accuracy)
    cfg = run_config_from_dict({"run": "cmp", "model": "small_cnn", "fleet": fleet, "batch_size": 16,
                                "local_iters": int(rng.integers(2, 20)), "strategy": "auto",
                                "auto": {"epsilon": float(rng.choice([0.0, 0.05, 1.0])), "whole_model": True},
                                "drift": "none", "server_opt": "none", "model_ema": 0})
    shape = (1, 8, 8)
    model, costs = build_model(cfg.model, shape, 10), model_costs(cfg.model, shape, 10)
    counts = [rng.multinomial(100, rng.dirichlet([0.3] * 10)).tolist() for _ in range(cfg.num_agents)]
    rows = {r.method: r for r in preview(cfg, model, costs, fleet_of(cfg, counts))}
    for other in ("SFL", "S2FL", "FedFC", "FedAvg"):   # the whole model on the agent is in the search space too
        assert rows["auto"].round_s <= rows[other].round_s * (1 + 1e-6), other
    assert sum(a.batch for a in rows["auto"].agents.values()) == cfg.num_agents * 16


def test_weights_cheaper_than_activations_put_the_whole_model_on_the_agent(tmp_path):
    """small_cnn's whole model is 2 MB of weights; at 10 steps of batch 16 a fast device on a slow
    link sends less by training it all (FedAvg-style) than by streaming activations, while slow
    devices on the same links keep an early cut. Both kinds train in the same round."""
    from simulation import run_simulation

    fleet = [{"profile": p, "count": 1} for p in ("s2fl-low-low", "s2fl-mid-mid", "s2fl-high-high")]
    history, engine = run_simulation(_cfg(tmp_path, fleet, rounds=4, local_iters=10), device="cpu")
    whole = engine.model.num_blocks
    cost = engine.method.costs[whole]
    for record in history[1:]:
        got = _by_profile(engine, record)
        assert got["s2fl-high-high"]["split"] == whole
        assert got["s2fl-low-low"]["split"] < whole
        for a, row in record["agents"].items():
            assert row["whole_model"] == (row["split"] == whole)
            if row["whole_model"]:   # weights up and down, nothing per step
                assert row["bytes_up"] < 1.2 * cost.client_param_bytes
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.3

    # the option can be switched off: only cuts then
    history, engine = run_simulation(_cfg(tmp_path, fleet, rounds=1, local_iters=10, whole_model=False),
                                     device="cpu")
    assert all(v["split"] < engine.model.num_blocks for v in history[-1]["auto"]["assign"].values())


def test_selection_prefers_a_balanced_label_mix_and_rotates_everyone_through():
    from sfl_core.config.run import DeviceProfile
    from sfl_core.fleet import AgentInfo
    from sfl_core.methods.auto.method import select_by_label_mix

    # 8 agents, each holding one of 4 classes: a balanced round of 4 takes one of each class
    profile = DeviceProfile(name="d", compute_flops=1e9, link_bytes_per_s=1e6)
    agents = {f"a{i}": AgentInfo(f"a{i}", i, profile, {}, [100 if c == i % 4 else 0 for c in range(4)], 100)
              for i in range(8)}
    def classes(chosen):
        return len({int(a[1:]) % 4 for a in chosen})

    # a uniform sample of 4 covers all 4 classes in 16 of the 70 subsets (23 %)
    uniform = sum(classes(c) == 4 for c in itertools.combinations(agents, 4)) / 70
    seen, balanced = set(), 0
    for r in range(20):
        chosen = select_by_label_mix(list(agents), agents, 4, seed=r)
        assert len(chosen) == 4
        balanced += classes(chosen) == 4
        for a in chosen:
            agents[a].rounds += 1
        seen |= set(chosen)
    # the pool of 6 holds all 4 classes unless it misses both agents of one (about 43 % of pools)
    assert balanced / 20 > 2 * uniform
    assert seen == set(agents)
    counts = sorted(a.rounds for a in agents.values())
    assert counts[-1] - counts[0] <= 5    # a uniform sample spreads them by 6 on average


def test_the_label_mix_bound_is_dropped_only_where_label_mix_selection_chose_the_round():
    from sfl_core.methods.auto.method import LABEL_MIX_BOUND, label_mix_bound

    assert label_mix_bound("auto", by_mix=True) is None
    assert label_mix_bound("auto", by_mix=False) == LABEL_MIX_BOUND
    assert label_mix_bound(0.2, by_mix=True) == 0.2 and label_mix_bound(0.0, by_mix=False) == 0.0


def test_label_mix_selection_chooses_the_round_and_regulates_it_without_the_bound(tmp_path):
    """Six agents, three per round: label-mix selection picks the set (MergeSFL Eq. 11-13)
    and plans its batches without the label-mix bound; a uniform sample keeps the bound, and
    where every agent trains, label-mix selection has nothing to choose and the bound holds."""
    import numpy as np

    from sfl_core.model.accounting import model_costs
    from sfl_core.fleet import fleet_of
    from sfl_core.methods import build_method
    from sfl_core.model.zoo import build_model

    fleet = [{"profile": p, "count": 2} for p in ("s2fl-low-low", "s2fl-mid-mid", "s2fl-high-high")]
    shape = (1, 8, 8)
    rng = np.random.default_rng(0)
    counts = [rng.multinomial(200, rng.dirichlet([0.2] * 10)).tolist() for _ in range(6)]

    def method_and_agents(per_round, **auto):
        cfg = run_config_from_dict({"run": "sel", "model": "small_cnn", "fleet": fleet, "per_round": per_round,
                                    "batch_size": 16, "local_iters": 10, "strategy": "auto", "auto": auto})
        model = build_model(cfg.model, shape, 10)
        return build_method(cfg, model, model_costs(cfg.model, shape, 10)), fleet_of(cfg, counts)

    method, agents = method_and_agents(3, selection="kl")
    chosen, batches = method.select(1, sorted(agents), agents, sorted(agents)[:3])
    assert method.by_mix and len(chosen) == 3
    unbounded, _ = method_and_agents(3, selection="kl", epsilon=100.0)
    assert batches == {x: p.batch for x, p in unbounded.joint_plan(chosen, agents).agents.items()}
    strict, _ = method_and_agents(3, epsilon=0.0)          # a number is a bound whoever chose the round
    assert {x: p.batch for x, p in strict.joint_plan(chosen, agents, by_mix=True).agents.items()} != batches
    bounded, _ = method_and_agents(3, epsilon=0.05)
    uniform, _ = method_and_agents(3, selection="uniform")
    uniform.select(1, sorted(agents), agents, chosen)
    assert not uniform.by_mix
    assert uniform.current.agents.keys() == set(chosen)
    assert {x: p.batch for x, p in uniform.current.agents.items()} == \
        {x: p.batch for x, p in bounded.joint_plan(chosen, agents).agents.items()}
    everyone, _ = method_and_agents(None)
    everyone.select(1, sorted(agents), agents, sorted(agents))
    assert not everyone.by_mix


def test_the_server_side_follows_server_mode(tmp_path):
    from simulation import run_simulation

    fleet = [{"profile": p, "count": 1} for p in ("s2fl-low-low", "s2fl-high-high")]
    cfg = _cfg(tmp_path, fleet, rounds=1, whole_model=False)
    for mode, groups in (("merged", 1), ("per_agent", 2)):
        history, _ = run_simulation(dataclasses.replace(cfg, server_mode=mode), device="cpu")
        assert len(history[-1]["groups"]) == groups, mode


def test_bottleneck_widths_beside_earlier_cuts_train_one_model(tmp_path):
    """auto.widths: a slow-link agent sends a narrow bottleneck at the run's split while a slow-CPU
    agent cuts earlier (its rows pass the whole pair on the server) in the same rounds; the
    full model runs the pair at the widest width trained, and it learns."""
    from simulation import run_simulation

    slow_cpu, slow_link = tmp_path / "slow-cpu.yaml", tmp_path / "slow-link.yaml"
    slow_cpu.write_text(yaml.safe_dump({"name": "slow-cpu", "compute_flops": 3e6, "link_bytes_per_s": 1e9}))
    slow_link.write_text(yaml.safe_dump({"name": "slow-link", "compute_flops": 2e10, "link_bytes_per_s": 3e4}))
    fleet = [{"profile": str(slow_cpu), "count": 1}, {"profile": str(slow_link), "count": 1},
             {"profile": "s2fl-high-high", "count": 1}]
    cfg = dataclasses.replace(_cfg(tmp_path, fleet, rounds=8, widths=[8, 16, 32], max_compression=8,
                                   codecs=["fp32"]), split=2)
    history, engine = run_simulation(cfg, device="cpu")
    for record in history[1:]:
        by = _by_profile(engine, record)
        assert (by["slow-cpu"]["split"], by["slow-cpu"]["width"]) == (1, 0)
        assert (by["slow-link"]["split"], by["slow-link"]["width"]) == (2, 8)
    trained = {v["width"] for h in history[1:] for v in h["agents"].values() if v["split"] == 2}
    assert engine.model.bottleneck(2).infer_width == max(trained) < 32
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.2
    # resuming restores the width trained so far (recorded in the run state), not the narrowest
    from coordinator import state as ckpt

    weights, st = ckpt.load(tmp_path / "out")
    assert st["model_info"]["bottlenecks"] == [{"split": 2, "width": 32, "infer_width": max(trained)}]
    st["model_info"]["bottlenecks"][0]["infer_width"] = 16    # as if an agent had trained 16 channels
    ckpt.save(tmp_path / "out", weights, st)
    resumed, again = run_simulation(cfg, resume=True, device="cpu")
    assert len(resumed) == len(history) and again.model.bottleneck(2).infer_width == 16


def test_a_link_at_its_profiles_rate_learns_no_link_factor_whatever_the_codec_compresses(tmp_path):
    """The first round prices the activations at the codec's nominal ratio; the wire shows another
    (fp16 then zstd compresses ReLU activations past one half). The method learns that ratio; the
    link factor must not learn it a second time, or the agents of the first round are predicted
    too fast for as long as the factor lasts, and batch regulation gives them too much."""
    from simulation import run_simulation

    prof = tmp_path / "slow-link.yaml"
    prof.write_text(yaml.safe_dump({"name": "slow-link", "compute_flops": 2e10, "link_bytes_per_s": 5e5,
                                    "capacity": [{"from_round": 1, "compute": 1.0, "link": 0.5}]}))
    fleet = [{"profile": "s2fl-high-low", "count": 2}, {"profile": str(prof), "count": 1}]
    cfg = _cfg(tmp_path, fleet, rounds=3, codecs=["fp16"], candidates=[1], widths=None, whole_model=False)
    history, engine = run_simulation(cfg, device="cpu")
    assert engine.method.wire_ratio["1/fp16"] < 0.45     # the wire beat the nominal 0.5
    links = {engine.registry.agents[a].profile.name: s[1] for a, s in engine.method.scales.items()}
    assert links["s2fl-high-low"] == pytest.approx(1.0, abs=0.03)  # at its profile's rate
    assert links["slow-link"] == pytest.approx(2.0, abs=0.06)      # at half of it
    # once the ratio is known, the planner's round is the clock's
    assert all(abs(r["auto"]["error"]) < 0.05 for r in history[2:])
