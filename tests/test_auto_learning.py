"""``strategy: auto`` decides the training options a run leaves to it (docs/methods/auto.md,
"Training options"): the evidence, each option's rule, the decisions, and the engine applying
them before a round, mid-run too, and after a resume."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import pytest

from sfl_core import option_registry
from sfl_core.config.run import run_config_from_dict
from sfl_core.config.section import OptionSection
from sfl_core.evidence import Evidence, above_chance, absent_classes, climb, evidence_of, label_skew, swing
from sfl_core.methods.auto.learning import LearningOptions
from sfl_core.methods.auto.structure import (DEPTH_COST, SELECTION_SHARE, SEQUENTIAL_SERVER_BLOCKS, selection_for,
                                             server_mode_for, shallow_cuts)
from sfl_core.options.base import Recommendation, RoundOption
from sfl_core.options.drift.option import Drift
from sfl_core.options.lr_anneal.option import LrAnneal
from sfl_core.options.lr_anneal.schedule import anneal_factor
from sfl_core.options.model_ema.option import ModelEma
from sfl_core.options.norm_stats.option import NormStats
from sfl_core.options.server_opt.option import ServerOpt

SKEWED = Evidence(agents=40, per_round=8, classes=10, label_skew=0.9, absent=0.4, batch_norm=True)
ALIKE = dataclasses.replace(SKEWED, label_skew=0.02, absent=0.0)
MILD = dataclasses.replace(SKEWED, label_skew=0.43, absent=0.1)   # the demo's fleet: Dirichlet 0.5 over 4 devices


def _cfg(**over: Any):
    return run_config_from_dict({"model": "small_cnn", "min_agents": 2, **over})


# ---------------------------------------------------------------- evidence, by hand

def test_label_skew_is_the_mean_kl_of_each_device_to_the_fleet():
    assert label_skew([[5, 5], [10, 10], [1, 1]]) == pytest.approx(0.0)
    # two devices with disjoint classes: each is KL([1, 0] || [1/2, 1/2]) = log 2 from the fleet
    assert label_skew([[8, 0], [0, 8]]) == pytest.approx(math.log(2))
    # one device of 3:1 against a fleet of 1:1 (the other device 1:3): KL = 3/4 log(3/2) + 1/4 log(1/2)
    assert label_skew([[3, 1], [1, 3]]) == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    assert label_skew([[0, 0], [4, 4]]) == pytest.approx(0.0)   # a device with no samples is left out
    assert absent_classes([[3, 0, 0, 1], [1, 1, 1, 1]], 4) == pytest.approx((0.5 + 0.0) / 2)


def test_swing_counts_falls_back_not_progress():
    assert swing([0.1, 0.3, 0.5, 0.6]) is None                        # too few scored rounds
    assert swing([0.1, 0.3, 0.5, 0.6, 0.7]) == 0.0                    # only improving
    assert swing([0.5, 0.4, 0.6, 0.5, 0.6]) == pytest.approx((0.1 + 0.1) / 4)
    assert climb([0.1, 0.3, 0.5, 0.6]) is None
    assert climb([0.5, 0.4, 0.6, 0.5, 0.6]) == pytest.approx(0.1 / 4)   # net, from the first to the last
    assert above_chance([0.1, 0.3, 0.3, 0.3, 0.3, 0.3], 10)                 # the last 5, each >= 2 / 10
    assert not above_chance([0.3, 0.3, 0.19, 0.3, 0.3], 10) and not above_chance([0.3] * 4, 10)
    ev = evidence_of(histograms={"a": [10, 0], "b": [0, 10], "c": [5, 5]}, classes=2, per_round=2,
                     batch_norm=False)
    assert (ev.agents, ev.per_round, ev.partial, ev.skewed) == (3, 2, True, True)


# ---------------------------------------------------------------- each option's rule

def test_drift_correction_pays_on_skewed_labels_only():
    assert Drift.recommend(_cfg(), SKEWED, False).changes == {"kind": "scaffold"}
    for fleet in (ALIKE, MILD):
        off = Drift.recommend(_cfg(), fleet, False)
        assert off.changes is None and "close enough" in off.reason


def test_server_momentum_wherever_a_round_trains_a_sample_of_the_fleet():
    momentum = {"kind": "momentum", "lr": 1.0, "beta1": 0.5}
    assert ServerOpt.recommend(_cfg(), SKEWED, False).changes == momentum
    # balanced labels too: the rounds' samples still differ (S2FL's setting at Dirichlet 0.5 and IID)
    alike = ServerOpt.recommend(_cfg(), ALIKE, False)
    assert alike.changes == momentum and "8 of 40 devices (mean KL 0.02" in alike.reason
    for fleet in (SKEWED, ALIKE, MILD):                # every device every round: nothing to even out
        everyone = ServerOpt.recommend(_cfg(), dataclasses.replace(fleet, per_round=40), False)
        assert everyone.changes is None and "every device trains every round" in everyone.reason


def test_federated_statistics_need_batchnorm_and_skew():
    assert NormStats.recommend(_cfg(), SKEWED, False).changes == {"mode": "federated"}
    no_bn = NormStats.recommend(_cfg(), dataclasses.replace(SKEWED, batch_norm=False), False)
    assert no_bn.changes is None and "BatchNorm" in no_bn.reason
    assert NormStats.recommend(_cfg(), ALIKE, False).changes is None
    assert NormStats.recommend(_cfg(), MILD, False).changes is None


def test_the_delivered_average_follows_the_swings_and_then_stays():
    assert ModelEma.recommend(_cfg(), SKEWED, False).changes is None        # not from the skew alone
    steady = dataclasses.replace(SKEWED, accuracy=(0.5, 0.6, 0.7, 0.75, 0.8))
    assert ModelEma.recommend(_cfg(), steady, False).changes is None
    swinging = dataclasses.replace(ALIKE, accuracy=(0.6, 0.5, 0.62, 0.52, 0.63))   # falls 10 + 10 points
    assert ModelEma.recommend(_cfg(), swinging, False).changes == {"decay": 0.8}
    everyone = dataclasses.replace(ALIKE, per_round=40)
    calmer = dataclasses.replace(everyone, accuracy=(0.60, 0.58, 0.60, 0.58, 0.60))   # falls of 1 point a round
    assert ModelEma.recommend(_cfg(), calmer, False).changes is None
    # once on, the scored accuracy is the average's: its calm is no evidence the model steadied
    assert ModelEma.recommend(_cfg(), calmer, True).changes == {"decay": 0.8}
    assert ModelEma.recommend(_cfg(), steady, True).changes == {"decay": 0.8}


def test_the_average_where_a_sample_of_the_fleet_has_stopped_climbing():
    """A round's sample moves a model that has stopped improving around where it got to: from
    there the average (not before: on a climbing run it lags)."""
    plateau = (0.84, 0.86, 0.82, 0.85, 0.86)              # falls 4 points over 4 rounds, gains 2 net
    on = ModelEma.recommend(_cfg(), dataclasses.replace(ALIKE, accuracy=plateau), False)
    assert on.changes == {"decay": 0.8}
    assert "8 of 40 devices a round and the accuracy has stopped climbing (net +0.5 points a round, " \
           "falls back 1.0)" in on.reason
    climbing = dataclasses.replace(ALIKE, accuracy=(0.70, 0.74, 0.72, 0.77, 0.78))   # falls 2, gains 8
    still = ModelEma.recommend(_cfg(), climbing, False)
    assert still.changes is None and "still climbs" in still.reason
    flat = dataclasses.replace(ALIKE, accuracy=(0.85,) * 5)                # no sample noise to average out
    assert ModelEma.recommend(_cfg(), flat, False).changes is None
    # a model stuck at chance (MergeSFL's setting, some seeds for 30 rounds) has not yet climbed
    stuck = dataclasses.replace(ALIKE, accuracy=(0.11, 0.11, 0.10, 0.10, 0.10))
    waiting = ModelEma.recommend(_cfg(), stuck, False)
    assert waiting.changes is None and "near chance" in waiting.reason
    everyone = dataclasses.replace(ALIKE, per_round=40, accuracy=plateau)  # the demo: every device every round
    assert ModelEma.recommend(_cfg(), everyone, False).changes is None


# ---------------------------------------------------------------- the server mode and the cut's depth

def test_the_server_is_sequential_except_on_strong_skew_over_a_deep_server_portion():
    mode, why = server_mode_for(SKEWED, server_blocks=4, shared=False)
    assert mode == "sequential" and "0.90 nats" in why
    assert server_mode_for(dataclasses.replace(ALIKE, absent=0.45), server_blocks=3, shared=False)[0] == "sequential"
    mode, why = server_mode_for(SKEWED, server_blocks=SEQUENTIAL_SERVER_BLOCKS + 1, shared=False)
    assert mode == "merged" and f"{SEQUENTIAL_SERVER_BLOCKS + 1} blocks" in why   # a deep server portion
    # mixes close to the fleet's: a device's batch is like the fleet's, at any depth (S2FL's VGG-16)
    for fleet in (ALIKE, MILD):
        for blocks in (3, 12):
            mode, why = server_mode_for(fleet, server_blocks=blocks, shared=False)
            assert mode == "sequential" and "close to the fleet's" in why
    for fleet in (SKEWED, ALIKE):
        mode, why = server_mode_for(fleet, server_blocks=3, shared=True)
        assert mode == "merged" and "server workers" in why


def test_label_mix_selection_where_a_round_takes_a_small_share_of_the_fleet_only():
    assert SELECTION_SHARE == 0.25
    mode, why = selection_for(SKEWED)                      # 8 of 40
    assert mode == "kl" and "8 of 40" in why
    assert selection_for(dataclasses.replace(SKEWED, agents=100, per_round=25))[0] == "kl"   # exactly a quarter
    mode, why = selection_for(dataclasses.replace(SKEWED, agents=20, per_round=10))          # MergeSFL's setting
    assert mode == "uniform" and "10 of 20" in why and "25%" in why
    assert selection_for(dataclasses.replace(SKEWED, agents=99, per_round=25))[0] == "uniform"
    mode, why = selection_for(dataclasses.replace(SKEWED, agents=4, per_round=4))
    assert mode == "uniform" and "no choice" in why


def test_auto_decides_the_selection_and_the_users_wins():
    _, lines, _, method = _auto(SKEWED_COUNTS)                       # 2 of 4 a round
    assert method.selection == "uniform" and method.round_metrics()["learning"]["selection"] == {"selection": "uniform"}
    assert any(line.startswith("auto: selection: selection uniform (round 1: a round takes 2 of 4") for line in lines)
    _, lines, _, method = _auto(SKEWED_COUNTS * 2)                   # 2 of 8
    assert method.selection == "kl"
    online = sorted(method.agents)
    method.select(1, online, method.agents, online[:2])
    assert method.by_mix                                             # label mix chose the round
    _, lines, _, method = _auto(SKEWED_COUNTS, auto={"selection": "kl"})
    assert method.selection == "kl" and not any(line.startswith("auto: selection") for line in lines)
    assert "selection" not in method.round_metrics().get("learning", {})


def test_the_shallowest_cuts_within_the_depth_cost():
    d = DEPTH_COST
    prices = {(1,): d + 0.1, (1, 2): d - 0.1, (1, 2, 3): 1.0}
    assert shallow_cuts([3, 1, 2], prices.__getitem__) == ((1, 2), d - 0.1, 1.0)
    prices[(1,)] = d - 0.01
    assert shallow_cuts([1, 2, 3], prices.__getitem__)[0] == (1,)
    assert shallow_cuts([1, 2, 3], {(1,): d + 1, (1, 2): d + 0.5, (1, 2, 3): 1.0}.__getitem__) == ((1, 2, 3), 1.0, 1.0)


def _auto(counts, shared: bool = False, **over: Any):
    from sfl_core.fleet import fleet_of
    from sfl_core.methods import build_method
    from sfl_core.model.accounting import model_costs
    from sfl_core.model.zoo import build_model

    cfg = run_config_from_dict({"model": "vgg_mini", "fleet": [{"profile": "rpi4", "count": len(counts)}],
                                "data": {"dataset": "digits"}, "per_round": 2, **over})
    shape = (1, 8, 8)
    method = build_method(cfg, build_model(cfg.model, shape, 10), model_costs(cfg.model, shape, 10))
    every = method.candidates
    method.agents = fleet_of(cfg, counts)   # the registered fleet, for the pricing below
    settled, lines = method.learning(1, method.agents, [], shared_server=shared)
    return settled, lines, every, method


SKEWED_COUNTS = [[30 if i == k else 0 for i in range(10)] for k in range(4)]
ALIKE_COUNTS = [[3] * 10] * 4


def test_auto_decides_the_server_mode_and_the_depth_from_the_skew():
    settled, lines, every, method = _auto(SKEWED_COUNTS)
    assert settled.server_mode == "sequential"
    assert any(line.startswith("auto: server: server_mode sequential (round 1: strongly label-skewed") for line in lines)
    kept = method.round_metrics()["learning"]["cut"]["candidates"]
    assert kept == sorted(kept) and kept[0] == min(every) and set(method.candidates) <= set(every)
    # the kept cuts cost at most DEPTH_COST of the round over every cut; one fewer would cost more
    assert method._round_over(tuple(kept), method.agents) <= DEPTH_COST * method._round_over(
        tuple(s for s in every if s != method.model.num_blocks), method.agents) + 1e-12
    settled, lines, every, method = _auto(ALIKE_COUNTS)
    assert settled.server_mode == "sequential" and method.candidates == every     # every cut
    assert method.round_metrics()["learning"]["server"] == {"server_mode": "sequential"}
    assert "cut" not in method.round_metrics()["learning"]


def test_a_server_portion_deeper_than_the_bound_stays_merged(monkeypatch):
    from sfl_core.methods.auto import structure

    # vgg_mini: 5 blocks, the shallowest cut 1, so 4 blocks on the server
    monkeypatch.setattr(structure, "SEQUENTIAL_SERVER_BLOCKS", 3)
    settled, lines, _, _ = _auto(SKEWED_COUNTS)
    assert settled.server_mode == "merged" and any("a server portion of 4 blocks (over 3)" in line for line in lines)


def test_the_users_server_mode_and_cuts_win_and_workers_keep_it_merged():
    settled, lines, _, method = _auto(SKEWED_COUNTS, server_mode="per_agent", auto={"candidates": [2, 3]})
    assert settled.server_mode == "per_agent" and method.candidates == (2, 3)
    assert not any(line.startswith(("auto: server: ", "auto: cut: ")) for line in lines)
    settled, lines, _, _ = _auto(SKEWED_COUNTS, shared=True)
    assert settled.server_mode == "merged" and any("server workers" in line for line in lines)


# ---------------------------------------------------------------- the decisions

def test_the_learning_rate_anneals_where_a_round_samples_skewed_devices_that_stopped_climbing():
    level = (0.80, 0.78, 0.81, 0.79, 0.80)              # falls back 1.5 points a round, gains 0 net
    climbing = (0.50, 0.60, 0.58, 0.70, 0.80)           # falls back 0.5, gains 7.5 a round
    stuck = (0.10, 0.12, 0.10, 0.11, 0.10)              # level, but at chance: not started
    on = LrAnneal.recommend(_cfg(rounds=10), dataclasses.replace(SKEWED, accuracy=level, round=5), False)
    assert on.changes == {"share": 0.5} and "8 of 40 label-skewed devices a round" in on.reason
    for accuracy in ((), climbing, stuck):
        off = LrAnneal.recommend(_cfg(), dataclasses.replace(SKEWED, accuracy=accuracy), False)
        assert off.changes is None and "still climbing" in off.reason
    for fleet in (ALIKE, MILD):                         # milder skew: not measured to pay
        off = LrAnneal.recommend(_cfg(), dataclasses.replace(fleet, accuracy=level), False)
        assert off.changes is None and "close enough" in off.reason
    late = dataclasses.replace(SKEWED, accuracy=level, round=51)          # levelled off only in the last half
    assert LrAnneal.recommend(_cfg(rounds=100), dataclasses.replace(late, round=50), False).changes == {"share": 0.5}
    assert "still climbing when the run's last half began" in LrAnneal.recommend(_cfg(rounds=100), late, False).reason
    assert LrAnneal.recommend(_cfg(rounds=100), late, True).changes == {"share": 0.5}
    everyone = LrAnneal.recommend(_cfg(), dataclasses.replace(SKEWED, per_round=40, accuracy=level), False)
    assert everyone.changes is None and "every device trains every round" in everyone.reason
    assert LrAnneal.recommend(_cfg(), SKEWED, True).changes == {"share": 0.5}   # once on, to the end


def test_the_annealed_factor_by_hand():
    # 10 rounds, the last half: 1 up to round 5, then 1 - 0.9 (r - 5) / 5, a tenth at round 10
    assert [round(anneal_factor(r, 10, 0.5), 6) for r in range(1, 12)] == [
        1, 1, 1, 1, 1, 0.82, 0.64, 0.46, 0.28, 0.1, 0.1]
    assert anneal_factor(3, 4, 0.25) == 1 and anneal_factor(4, 4, 0.25) == pytest.approx(0.1)
    assert all(anneal_factor(r, 10, 0.0) == 1 for r in range(1, 12))
    assert anneal_factor(8, 10, 0.5, floor=0.5) == pytest.approx(1 - 0.5 * 3 / 5)


def test_a_users_annealed_rate_reaches_every_device_on_any_strategy(tmp_path):
    from simulation import run_simulation

    cfg = run_config_from_dict({
        "run": "anneal", "model": "small_cnn", "strategy": "sfl", "data": {"dataset": "digits", "partition": "iid"},
        "fleet": [{"profile": "s2fl-mid-mid", "count": 2}], "rounds": 4, "batch_size": 16, "lr": 0.05,
        "local_iters": 2, "lr_anneal": 0.5, "output_dir": str(tmp_path / "out")})
    history, engine = run_simulation(cfg, device="cpu")
    # the last half of 4 rounds: 1, 1, then 1 - 0.9 x 1/2, a tenth at the last
    assert [sorted({a["lr"] for a in h["agents"].values()}) for h in history[1:]] == [
        [0.05], [0.05], [pytest.approx(0.05 * 0.55)], [pytest.approx(0.005)]]
    assert "LrAnneal" in {type(o).__name__ for o in engine.options}


def test_auto_decides_only_what_the_config_leaves_to_it():
    cfg = _cfg(drift="none", server_opt={"kind": "adam", "lr": 0.03})   # the user's settings win
    assert {o.SECTION.KEY for o in option_registry.left_to_auto(cfg)} == {"norm_stats", "model_ema", "lr_anneal"}
    learner = LearningOptions(cfg)
    changed = learner.decide(1, SKEWED)
    assert {d.key for d in changed} == {"norm_stats", "model_ema", "lr_anneal"}   # lr_anneal: off for now
    settled = learner.config()
    assert Drift.settings(settled).kind == "none" and ServerOpt.settings(settled).kind == "adam"
    assert NormStats.settings(settled).mode == "federated" and ModelEma.settings(settled).decay == "auto"
    assert learner.decide(2, SKEWED) == []                     # nothing new: nothing said again
    assert learner.summary() == {"norm_stats": {"mode": "federated"}, "model_ema": "off", "lr_anneal": "off"}
    swings = dataclasses.replace(SKEWED, accuracy=(0.6, 0.5, 0.62, 0.52, 0.63))
    assert [d.line() for d in learner.decide(7, swings)] == [
        "auto: model_ema: decay 0.8 (round 7: the accuracy falls back 5.0 points a round: the delivered model "
        "averages the last rounds' (decay 0.8))",
        "auto: lr_anneal: share 0.5 (round 7: 8 of 40 label-skewed devices a round (mean KL 0.90 nats) and the "
        "accuracy has stopped climbing: the learning rate falls to a tenth over the last half of the run, "
        "shrinking each round's pull towards its sample's classes)"]
    line = next(d.line() for d in changed if d.key == "norm_stats")
    assert line.startswith("auto: norm_stats: mode federated (round 1: BatchNorm layers on label-skewed devices")
    again = LearningOptions(cfg)
    again.load_json(learner.to_json())
    assert again.config() == learner.config()
    # a field the user set beside "auto" stays: FedProx's mu would, SCAFFOLD ignores it
    assert Drift.settings(LearningOptions(_cfg(drift={"mu": 0.5})).config()).mu == 0.5


def test_an_option_left_to_auto_is_off_under_any_other_strategy():
    cfg = _cfg(strategy="sfl")
    assert [o.SECTION.KEY for o in option_registry.wanted(cfg)] == ["robust"]   # on by default, not auto's
    assert [o.SECTION.KEY for o in option_registry.left_to_auto(cfg)] == ["drift", "server_opt", "norm_stats",
                                                                           "model_ema", "lr_anneal"]


# ---------------------------------------------------------------- the engine

def _probe_option():
    """An option whose rule switches it on once the scored accuracy passes 0.5."""
    from pydantic.dataclasses import dataclass

    from sfl_core.config.fields import STRICT

    @dataclass(frozen=True, config=STRICT)
    class ProbeConfig(OptionSection):
        KEY: ClassVar[str] = "probe"
        DOCS: ClassVar[tuple[tuple[str, str], ...]] = (("", "test"), ("state", "auto | on | off"))
        SHORTHAND: ClassVar[str] = "state"
        state: str = "auto"

    class Probe(RoundOption):
        SECTION = ProbeConfig
        built: ClassVar[list[int]] = []

        @classmethod
        def wanted(cls, cfg) -> bool:
            return cls.settings(cfg).state == "on"

        @classmethod
        def recommend(cls, cfg, evidence, on) -> Recommendation:
            best = max(evidence.accuracy, default=0.0)
            return Recommendation({"state": "on"} if best > 0.5 else None, f"best accuracy {best:.2f}")

        def after_round(self, ctx, r: int) -> None:
            type(self).built.append(r)

    return Probe


def test_the_engine_switches_an_option_on_mid_run_when_the_evidence_changes(tmp_path):
    from simulation import run_simulation

    probe = _probe_option()
    option_registry.register_option(probe)
    try:
        cfg = run_config_from_dict({
            "run": "learning", "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid"},
            "fleet": [{"profile": "s2fl-mid-mid", "count": 3}], "rounds": 6, "batch_size": 16, "lr": 0.05,
            "momentum": 0.5, "local_iters": 10, "output_dir": str(tmp_path / "out"),
            "drift": "none", "server_opt": "none", "norm_stats": "averaged", "model_ema": 0})
        history, engine = run_simulation(cfg, device="cpu")
    finally:
        option_registry.unregister_option("probe")
    states = [h.get("learning", {}).get("probe") for h in history[1:]]
    first_on = next(i for i, h in enumerate(history) if (h.get("learning") or {}).get("probe") == {"state": "on"})
    assert states[0] == "off" and states[-1] == {"state": "on"}            # off at first, on later
    assert max(h["accuracy"] for h in history[:first_on]) > 0.5           # because the evidence said so
    assert probe.built == list(range(first_on, 7))                         # the option ran from then on
    assert [type(o).__name__ for o in engine.options] == ["Robust", "Probe"]   # robust: on by default


def test_a_skewed_demo_fleet_gets_its_options_and_keeps_them_across_a_resume(tmp_path):
    from simulation import run_simulation

    spec = {"run": "learning", "model": "small_cnn", "data": {"dataset": "digits", "partition": "dirichlet",
                                                              "alpha": 0.1},
            "fleet": [{"profile": "s2fl-mid-mid", "count": 4}], "per_round": 3, "rounds": 2, "batch_size": 16,
            "lr": 0.05, "local_iters": 5, "output_dir": str(tmp_path / "out")}
    history, engine = run_simulation(run_config_from_dict(spec), device="cpu")
    decided = history[-1]["learning"]
    assert decided["drift"] == {"kind": "scaffold"} and decided["server_opt"]["kind"] == "momentum"
    assert decided["server"] == {"server_mode": "sequential"} and engine.cfg.server_mode == "sequential"
    assert decided["norm_stats"] == "off"                                   # small_cnn has no BatchNorm
    assert decided["selection"] == {"selection": "uniform"}                # 3 of 4 a round
    assert decided["lr_anneal"] == "off"                                   # no scored climb to judge yet
    assert {type(o).__name__ for o in engine.options} == {"Drift", "ServerOpt", "Robust"}
    held = {a: dict(c) for a, c in engine.option(Drift).variates.ci.items()}
    assert held
    resumed, engine2 = run_simulation(run_config_from_dict({**spec, "rounds": 3}), resume=True, device="cpu")
    assert [h["round"] for h in resumed] == [0, 1, 2, 3]
    assert resumed[-1]["learning"] == decided
    assert engine2.cfg.server_mode == "sequential" and engine2.method.candidates == engine.method.candidates
    drift = engine2.option(Drift)
    assert drift is not None and drift.variates is not None
    assert set(drift.variates.ci) >= set(held)                              # restored, not started afresh


def test_a_rule_never_switches_on_what_the_run_refuses():
    """Federated statistics are not covered by DP-SGD's accounting: under DP-SGD the rule says so."""
    dp = _cfg(privacy={"dp_sgd": "1,1"})
    rec = NormStats.recommend(dp, SKEWED, False)
    assert rec.changes is None and "DP-SGD" in rec.reason
    learner = LearningOptions(dp)
    learner.decide(1, SKEWED)
    assert NormStats.settings(learner.config()).mode == "auto"     # left off: the config stays valid


def test_the_whole_model_stays_a_choice_only_where_the_labels_look_alike():
    from sfl_core.fleet import fleet_of
    from sfl_core.methods import build_method
    from sfl_core.model.accounting import model_costs
    from sfl_core.model.zoo import build_model

    cfg = run_config_from_dict({"model": "small_cnn", "fleet": [{"profile": "rpi4", "count": 3}],
                                "data": {"dataset": "digits"}})
    shape = (1, 8, 8)

    def candidates(counts, **auto):
        c = cfg if not auto else cfg.sections["auto"].replace_in(cfg, **auto)
        method = build_method(c, build_model(c.model, shape, 10), model_costs(c.model, shape, 10))
        lines = method.learning(1, fleet_of(c, counts), [])[1]
        return method.model.num_blocks in method.candidates, lines

    skewed = [[30, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 30, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 30, 0, 0, 0, 0, 0, 0, 0]]
    alike = [[3] * 10] * 3
    whole, lines = candidates(skewed)
    assert not whole and any(line.startswith("auto: whole model: off") for line in lines)
    assert candidates(alike)[0]
    assert candidates(skewed, whole_model=True)[0]                 # the user's word wins
    assert not candidates(alike, whole_model=False)[0]
