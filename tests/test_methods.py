"""The method seam: a run's method is its strategy's base plus the layers its config asks for,
and a new method is one module registered by name (the engine needs no change)."""

from __future__ import annotations

from typing import Mapping, Sequence

import pytest

from simulation import run_simulation
from sfl_core.model.accounting import model_costs
from sfl_core.config.run import ConfigError, run_config_from_dict
from sfl_core.methods import build_method, register_method, strategies, unregister_method
from sfl_core.methods.base import Method, RoundPlan
from sfl_core.methods.fedavg import FedAvg
from sfl_core.methods.fedfc.method import FedFC
from sfl_core.methods.heterosfl.method import HeteroSFL
from sfl_core.methods.mergesfl.method import MergeSFL
from sfl_core.methods.s2fl.method import S2FL
from sfl_core.methods.sfl import SFL
from sfl_core.model.zoo import build_model

SHAPE = (1, 8, 8)


def _cfg(tmp_path, **over):
    d = {"run": "m", "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid", "seed": 0},
         "fleet": [{"profile": "s2fl-low-low", "count": 2}, {"profile": "s2fl-high-high", "count": 2}],
         "rounds": 2, "strategy": "sfl", "batch_size": 8, "lr": 0.05, "local_iters": 2,
         "output_dir": str(tmp_path / "out")}
    d.update(over)
    return run_config_from_dict(d)


def _method(cfg):
    return build_method(cfg, build_model(cfg.model, SHAPE, 10), model_costs(cfg.model, SHAPE, 10))


def test_strategy_picks_the_base_and_the_config_adds_layers(tmp_path):
    assert type(_method(_cfg(tmp_path))) is SFL
    assert type(_method(_cfg(tmp_path, strategy="fedavg"))) is FedAvg
    assert type(_method(_cfg(tmp_path, strategy="s2fl"))) is S2FL
    fedfc = _method(_cfg(tmp_path, profile_splits={"s2fl-low-low": 1, "s2fl-high-high": 2}))
    assert type(fedfc) is FedFC and type(fedfc.inner) is SFL and fedfc.configured_splits == (1, 2)
    both = _method(_cfg(tmp_path, hetero={"width": 8, "widths": [2, 8]}, mergesfl={"regulate": True}))
    # MergeSFL's batch sizes sit on top of HeteroSFL's widths, which sit on top of the fixed split
    assert type(both) is MergeSFL and type(both.inner) is HeteroSFL and type(both.inner.inner) is SFL
    # one set of per-agent estimates, however many layers: S2FL's time table and MergeSFL's
    # (mu, beta) are views of the base's fleet estimates
    assert both.fleet is both.inner.inner.fleet and both.time_table is both.fleet.time_table
    assert both.control.states is both.fleet.rates


class Alternate(Method):
    """A method written by a newcomer: every agent at split 1 in odd rounds and 2 in even ones."""

    def plan(self, r: int, selected: Sequence[str], agents: Mapping[str, object]) -> RoundPlan:
        return RoundPlan({a: 1 if r % 2 else 2 for a in selected}, [list(selected)], f"alternate {r}")

    def splits_to_time(self) -> list[int]:
        return [1, 2]


def test_a_new_method_is_one_class_and_its_registration(tmp_path):
    assert "alternate" not in strategies()
    with pytest.raises(ConfigError, match="strategy"):
        _cfg(tmp_path, strategy="alternate")
    register_method("alternate", Alternate)
    try:
        cfg = _cfg(tmp_path, strategy="alternate", server_mode="merged")
        history, _ = run_simulation(cfg)
    finally:
        unregister_method("alternate")
    rounds = [h for h in history if h["round"] >= 1]
    assert [h["phase"] for h in rounds] == ["alternate 1", "alternate 2"]
    assert [{a["split"] for a in h["agents"].values()} for h in rounds] == [{1}, {2}]
    assert all(0.0 <= h["accuracy"] <= 1.0 for h in rounds)
    assert "alternate" not in strategies()
