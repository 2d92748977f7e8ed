"""``sfl-coord plan``'s per-method rows price the agents each method would select.

A 40-agent fleet whose first 20 agents are all of one (fast) class: a row priced on the first
``per_round`` agents predicts that class alone. Each row below is compared with a simulated
run of the same method over the same rounds (the engine draws the same agents)."""

from __future__ import annotations

import pytest

from sfl_core.config.run import run_config_from_dict
from sfl_core.fleet import fleet_of
from sfl_core.methods.preview import DRAWS, preview
from sfl_core.model.accounting import model_costs
from sfl_core.model.zoo import build_model
from simulation import run_simulation


@pytest.mark.parametrize("strategy, name", [("fedavg", "FedAvg"), ("sfl", "SFL")])
def test_each_row_matches_a_simulated_run_of_that_method(tmp_path, strategy, name):
    cfg = run_config_from_dict({
        "run": "rows", "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid"},
        "fleet": [{"profile": "s2fl-high-high", "count": 20}, {"profile": "s2fl-low-low", "count": 20}],
        "rounds": DRAWS, "per_round": 10, "strategy": strategy, "split": 2, "batch_size": 8, "local_iters": 2,
        "server_mode": "merged", "output_dir": str(tmp_path / name)})
    history, engine = run_simulation(cfg, device="cpu")
    measured = sum(h["round_time_s"] for h in history[1:]) / DRAWS
    model = build_model(cfg.model, engine.input_shape, 10)
    costs = model_costs(cfg.model, engine.input_shape, 10)
    counts = [engine.registry.agents[a].label_counts for a in sorted(engine.registry.agents)]
    rows = {r.method: r for r in preview(cfg, model, costs, fleet_of(cfg, counts))}
    assert rows[name].round_s == pytest.approx(measured, rel=0.15), (rows[name].round_s, measured)
    # what the rows were before: the first per_round agents (all fast here) priced alone
    first = {r.method: r for r in preview(cfg, model, costs, {a: i for a, i in fleet_of(cfg, counts).items()
                                                             if int(a[-3:]) < cfg.per_round})}
    assert first[name].round_s < 0.7 * measured


def test_scaffold_rows_price_the_correction_that_rides_with_the_weights(tmp_path):
    """Under SCAFFOLD every device downloads ``c − cᵢ`` beside its weights: on a slow downlink the
    row must price both, as the simulated run charges them (round 1's correction is all zeros and
    compresses to nothing, so the comparison starts at round 2)."""
    def run(drift: str) -> tuple[float, float]:
        cfg = run_config_from_dict({
            "run": "rows", "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid"},
            "fleet": [{"profile": "s2fl-low-low", "count": 10}], "rounds": DRAWS + 1, "per_round": 5,
            "strategy": "fedavg", "batch_size": 8, "local_iters": 2, "drift": drift,
            "output_dir": str(tmp_path / drift)})
        history, engine = run_simulation(cfg, device="cpu")
        measured = sum(h["round_time_s"] for h in history[2:]) / (len(history) - 2)
        costs = model_costs(cfg.model, engine.input_shape, 10)
        counts = [engine.registry.agents[a].label_counts for a in sorted(engine.registry.agents)]
        rows = {r.method: r for r in preview(cfg, build_model(cfg.model, engine.input_shape, 10), costs,
                                             fleet_of(cfg, counts))}
        return rows["FedAvg"].round_s, measured

    plain, plain_measured = run("none")
    scaffold, scaffold_measured = run("scaffold")
    assert scaffold == pytest.approx(scaffold_measured, rel=0.15), (scaffold, scaffold_measured)
    assert scaffold_measured > 1.3 * plain_measured          # the correction costs this fleet that much
    assert plain < 0.8 * scaffold_measured                   # a row without it would miss by as much
    assert scaffold - plain == pytest.approx(scaffold_measured - plain_measured, rel=0.3)
