"""Robust aggregation (``robust:``), each rule against aggregates computed by hand."""

from __future__ import annotations

import pytest
import torch

from sfl_core.aggregation import layerwise_average, participants, weighted_average
from sfl_core.config.run import ConfigError, run_config_from_dict
from sfl_core.options.robust.option import capped_weights, krum_f
from sfl_core.options.robust.rules import (change_sizes, coordinate_median, measure_changes, multi_krum, relative_changes,
                                           relative_of, sizes_of, trimmed_mean, typical_changes, typical_of)


def t(*v):
    return torch.tensor(v, dtype=torch.float32)


def test_the_weight_cap_bounds_a_claim_by_the_rounds_median_and_leaves_honest_weights_alone():
    honest = {"a": 600.0, "b": 300.0, "c": 900.0, "d": 2000.0}
    assert capped_weights(honest, 10) == honest                      # 2000 < 10 x median 750
    lying = {**honest, "e": 1e9}
    assert capped_weights(lying, 10) == {**honest, "e": 9000.0}      # median of five: 900
    assert capped_weights(lying, 0) == lying                         # no cap


def test_the_weight_caps_median_can_be_the_fleets_claims_so_a_rounds_majority_of_liars_is_still_capped():
    honest = {"a": 600.0, "b": 300.0, "c": 900.0, "d": 2000.0, "e": 700.0, "f": 500.0, "g": 800.0}
    liars = {"x": 1e6, "y": 1e6, "z": 1e6}
    this_round = {"a": 600.0, "b": 300.0, **liars}                   # three of five lie: the round's median is a lie
    assert capped_weights(this_round, 10) == this_round
    fleet = {**honest, **liars}                                      # ten claims: median (800 + 900) / 2 = 850
    assert capped_weights(this_round, 10, fleet) == {"a": 600.0, "b": 300.0, "x": 8500.0, "y": 8500.0, "z": 8500.0}


def test_a_changes_size_is_against_each_layers_typical_change_combined_by_elements():
    start = {"w": t(0, 0), "b": t(0, 0), "n": torch.tensor(3)}
    states = [{"w": t(1, 0), "b": t(1, 0), "n": torch.tensor(5)}, {"w": t(0, 2), "b": t(2, 0), "n": torch.tensor(5)},
              {"w": t(0, 3), "b": t(0, 3), "n": torch.tensor(5)}, {"w": t(300, 400), "b": t(0, 0), "n": torch.tensor(5)}]
    # per layer the root mean square change over the layer's median (the lower middle of four):
    # w: 0.71, 1.41, 2.12, 353.6 over 1.41; b: 0.71, 1.41, 2.12, 0 over 0.71; combined by elements
    assert typical_changes(start, states) == pytest.approx({"w": 2 ** 0.5, "b": 0.5 ** 0.5})   # counters: none
    assert change_sizes(start, states) == pytest.approx([0.625 ** 0.5, 2.5 ** 0.5, 5.625 ** 0.5, (250 ** 2 / 2) ** 0.5])


def test_sizes_compare_states_holding_different_layers_per_element():
    start = {"a": t(0, 0, 0, 0), "b": t(0, 0)}
    states = [{"a": t(1, 1, 1, 1), "b": t(1, 1)}, {"a": t(1, 1)}, {"a": t(1, -1, 1, -1)}, {"a": t(10, 10)}]
    assert typical_changes(start, states) == {"a": 1.0}    # b: its only holder, not compared
    assert change_sizes(start, states) == pytest.approx([1.0, 1.0, 1.0, 10.0])


def test_sizes_are_per_unit_of_learning_rate():
    start = {"w": t(0, 0)}
    states = [{"w": t(1, 0)}, {"w": t(0, 1)}, {"w": t(10, 0)}]
    assert change_sizes(start, states, rates=[0.1, 0.1, 1.0]) == pytest.approx([1.0, 1.0, 1.0])   # a 10x rate
    assert change_sizes(start, states, rates=[0.1, 0.1, 0.1])[2] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="rate"):
        change_sizes(start, states, rates=[1.0, 0.0, 1.0])


def test_the_typical_change_grows_at_most_threefold_a_round_so_a_round_where_most_lie_does_not_set_it():
    start = {"w": t(0, 0)}
    honest = [{"w": t(1, 0)}, {"w": t(0, 1)}]
    liars = [{"w": t(50, 0)}, {"w": t(0, 50)}, {"w": t(50, 50)}]
    past = {"w": 0.7}
    assert typical_changes(start, honest + liars)["w"] > 30          # the median is a liar's
    assert typical_changes(start, honest + liars, past=past) == pytest.approx({"w": 3 * 0.7})
    assert change_sizes(start, honest + liars, typical={"w": 2.1})[2:] == pytest.approx([50 / 2 ** 0.5 / 2.1] * 2 + [50 / 2.1])
    assert typical_changes(start, honest + honest[:1], past={"w": 10.0}) == pytest.approx({"w": 0.5 ** 0.5})   # shrinking: free


def test_a_change_against_the_size_of_the_weights_it_started_from_by_hand():
    start = {"w": t(3, 4), "b": t(0, 0), "n": torch.tensor(3), "c": t(1, 1, 1, 1)}
    states = [{"w": t(3, 4.5), "b": t(0, 0), "n": torch.tensor(9)},   # 0.5 over 5: an ordinary step
              {"w": t(0, 0), "b": t(0, 0)},                           # zeroed: as large as the weights
              {"w": t(-3, -4)},                                       # 10 over 5
              {"b": t(1, 1)},                                         # it started from nothing: not compared
              {"c": t(2, 1)}]                                         # a narrow prefix: 1 over sqrt(2)
    assert relative_changes(start, states) == pytest.approx([0.1, 1.0, 2.0, 0.0, 0.5 ** 0.5])


def test_one_measurement_of_the_changes_serves_every_bound_and_a_subset_is_its_states_own():
    """The clip rule measures a round's changes once (the round's bound, the replaced-weights
    bound, the bound among peers): each read of it equals the rule computed afresh, and the
    changes of some of the states equal those states' own, renumbered."""
    torch.manual_seed(0)
    start = {"w": torch.randn(4, 3), "b": torch.randn(3), "n": torch.tensor(2)}
    states = [{k: v + 0.1 * (i + 1) * torch.randn_like(v.float()) if v.is_floating_point() else v
               for k, v in start.items()} for i in range(6)]
    states[2] = {"w": states[2]["w"][:2]}                     # a narrow holder of one layer
    rates = [0.1, 0.1, 0.2, 0.1, 0.05, 0.1]
    changes = measure_changes(start, states, rates)
    assert typical_of(changes) == typical_changes(start, states, rates)
    assert sizes_of(changes) == change_sizes(start, states, rates)
    assert relative_of(changes) == relative_changes(start, states)
    some = [5, 1, 2, 3]
    theirs = changes.subset(some)
    mine = [states[i] for i in some], [rates[i] for i in some]
    assert typical_of(theirs) == typical_changes(start, *mine)
    assert sizes_of(theirs, {"w": 1.0}) == change_sizes(start, *mine, typical={"w": 1.0})
    assert relative_of(theirs) == relative_changes(start, mine[0])


def test_the_changes_measured_a_state_at_a_time_equal_them_stacked(monkeypatch):
    """The layers' holders are stacked to be measured in one pass, a bounded number of elements
    at a time: in chunks of one state, and with states of mixed precision, the changes are the
    same as the whole stack's, and as each state's own by hand."""
    import sfl_core.options.robust.rules as rules

    torch.manual_seed(1)
    start = {"w": torch.randn(5, 4), "b": torch.randn(4)}
    states = [{k: v + 0.01 * (i + 1) * torch.randn_like(v) for k, v in start.items()} for i in range(5)]
    states[1] = {"w": states[1]["w"][:3]}                     # a narrow holder
    states[3] = {k: v.half() for k, v in states[3].items()}   # another precision
    whole = measure_changes(start, states)
    monkeypatch.setattr(rules, "STACK_ELEMENTS", 1)
    one_by_one = measure_changes(start, states)
    assert one_by_one.moved == pytest.approx(whole.moved, rel=1e-12) and one_by_one.size == whole.size
    for key, holders in whole.layers.items():
        for i, (v, n) in holders.items():
            d = states[i][key].double() - start[key][tuple(slice(0, m) for m in states[i][key].shape)].double()
            assert n == d.numel() and v == pytest.approx(float(d.pow(2).mean().sqrt()), rel=1e-12)
            assert one_by_one.layers[key][i] == (pytest.approx(v, rel=1e-12), n)
    assert whole.moved[1] == pytest.approx(float((states[1]["w"].double() - start["w"][:3].double()).pow(2).sum()))


def test_the_coordinate_median_and_trimmed_mean_by_hand():
    states = [{"w": t(1, 10)}, {"w": t(2, 20)}, {"w": t(3, 30)}, {"w": t(100, -1000)}]
    assert torch.allclose(coordinate_median(states)["w"], t(2.5, 15))      # mean of the middle two
    assert torch.allclose(trimmed_mean(states, 0.25)["w"], t(2.5, 15))     # 1 dropped at each end of 4
    assert torch.allclose(trimmed_mean(states, 0.0)["w"], t(26.5, -235))   # no trim: the plain mean
    assert torch.allclose(coordinate_median(states[:3])["w"], t(2, 20))


def test_coordinate_rules_go_element_by_element_over_the_holders_and_default_the_rest():
    # a narrow holder covers the first element only; the third element no one holds
    states = [{"w": t(1, 5)}, {"w": t(3, 7)}, {"w": t(100)}]
    out = coordinate_median(states, defaults={"w": t(0, 0, 9)})["w"]
    assert torch.allclose(out, t(3, 6, 9))
    assert torch.allclose(trimmed_mean(states, 0.4, defaults={"w": t(0, 0, 9)})["w"], t(3, 6, 9))


def test_multi_krum_leaves_out_the_outlying_changes():
    honest = [{"w": t(1.0, 1.0)}, {"w": t(1.1, 0.9)}, {"w": t(0.9, 1.1)}, {"w": t(1.0, 1.05)}, {"w": t(0.95, 1.0)}]
    attackers = [{"w": t(50, -50)}, {"w": t(-40, 60)}]
    keep, scores = multi_krum(honest + attackers, f=2)
    assert keep == [0, 1, 2, 3, 4]
    assert min(scores[5:]) > max(scores[:5])
    # the score by hand: n = 7, f = 2, each state's 3 nearest squared distances (mean over 2 elements)
    d = lambda a, b: float(((a["w"] - b["w"]) ** 2).mean())
    mine = sorted(d(honest[0], s) for s in honest[1:] + attackers)[:3]
    assert scores[0] == pytest.approx(sum(mine))
    assert krum_f(10, 0.3) == 3 and krum_f(5, 0.3) == 1 and krum_f(4, 0.3) == 0


def test_participants_are_what_the_layerwise_average_averages():
    clients = {"a": {"c": t(1)}, "b": {"c": t(3), "s": t(5)}}
    servers = {"a": {"s": t(10)}, "b": {"s": t(7)}}
    states, ws = participants(clients, servers, {"a": 1.0, "b": 3.0})
    assert ws == [1.0, 3.0] and states[0] == {"s": t(10), "c": t(1)}
    avg = weighted_average(states, ws)
    assert avg == layerwise_average(clients, servers, {"a": 1.0, "b": 3.0})
    assert torch.allclose(avg["c"], t(2.5)) and torch.allclose(avg["s"], t(6.25))


def test_the_robust_section_validates_itself():
    cfg = run_config_from_dict({"run": "r", "min_agents": 1, "robust": "median"})
    assert cfg.sections["robust"].aggregate == "median"
    for bad in ({"aggregate": "krum"}, {"trim": 0.5}, {"clip_factor": 0}, {"weight_cap": 0.5}, {"attackers": -0.1}):
        with pytest.raises(ConfigError, match="robust"):
            run_config_from_dict({"run": "r", "min_agents": 1, "robust": bad})
