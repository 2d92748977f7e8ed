"""FedFC mixed cut layers (SPEC §7): agents on different splits by device profile, one merged
server pass, per-layer averaging over every holder."""

from __future__ import annotations

import pytest

from sfl_core.config import ConfigError, run_config_from_dict


def _cfg(tmp_path, **over):
    return run_config_from_dict({
        "run": "fedfc", "model": "small_cnn", "data": {"dataset": "digits", "partition": "class-imbalance"},
        "fleet": [{"profile": "s2fl-low-low", "count": 1}, {"profile": "s2fl-mid-mid", "count": 1},
                  {"profile": "s2fl-high-high", "count": 1}],
        "rounds": 4, "strategy": "sfl", "server_mode": "merged", "split": 2, "batch_size": 16, "lr": 0.05,
        "momentum": 0.5, "local_iters": 10, "output_dir": str(tmp_path / "out"), **over,
    })


def test_mixed_cut_layers_by_profile_train_in_one_server_pass(tmp_path):
    from coordinator.cli import simulate_run

    cfg = _cfg(tmp_path, profile_splits={"s2fl-low-low": 1, "s2fl-high-high": 3})
    history, engine = simulate_run(cfg, device="cpu")
    last = history[-1]
    prof = {a: engine.registry.agents[a].profile["name"] for a in last["agents"]}
    splits = {prof[a]: v["split"] for a, v in last["agents"].items()}
    assert splits == {"s2fl-low-low": 1, "s2fl-mid-mid": 2, "s2fl-high-high": 3}
    assert last["groups"] == [sorted(last["agents"])]          # one merged server batch
    assert last["accuracy"] > history[0]["accuracy"] + 0.2


def test_profile_splits_validated(tmp_path):
    with pytest.raises(ConfigError, match="profile_splits"):
        _cfg(tmp_path, profile_splits={"s2fl-low-low": 0})
    with pytest.raises(ConfigError, match="profile_splits"):
        _cfg(tmp_path, profile_splits={"s2fl-low-low": 1}, strategy="fedavg")
    from coordinator.cli import simulate_run
    with pytest.raises(ValueError, match="invalid split point"):
        simulate_run(_cfg(tmp_path, profile_splits={"s2fl-low-low": 9}), device="cpu")
