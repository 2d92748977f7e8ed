"""Fleet simulation on Ray: agents in Ray actors train the same model as the serial simulation."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from typer.testing import CliRunner

from simulation import run_simulation
from cli.coord import app
from sfl_core.config.run import default_profiles_dir, load_run_config

_FIELDS = ("round", "accuracy", "test_loss", "train_loss", "round_time_s", "bytes_up", "bytes_down", "selected",
           "completed")


def _config(tmp_path, name: str, **changes):
    cfg = load_run_config(default_profiles_dir() / "runs" / "demo.yaml")
    return dataclasses.replace(cfg, output_dir=str(tmp_path / name), **changes)


@pytest.fixture
def one_thread():
    """Each Ray actor trains on one torch thread. A kernel may sum in another order on another
    number of threads (last-bit differences), so the serial run here uses one thread too,
    whatever earlier tests left behind."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_actors_train_the_same_model_as_the_serial_simulation(tmp_path, one_thread):
    """Two actors, four agents, auto's mixed cuts, codecs and batches: every round's accuracy,
    losses, virtual time and bytes equal the serial run's (on one thread, as each actor), and
    so does the final model."""
    pytest.importorskip("ray")
    import torch

    serial, serial_engine = run_simulation(_config(tmp_path, "serial", rounds=3), device="cpu")
    on_ray, ray_engine = run_simulation(_config(tmp_path, "ray", rounds=3), device="cpu", ray="local", ray_workers=2)
    assert [{k: r.get(k) for k in _FIELDS} for r in on_ray] == [{k: r.get(k) for k in _FIELDS} for r in serial]
    assert serial[-1]["accuracy"] > serial[0]["accuracy"] + 0.2
    for name, value in serial_engine.model.state_dict().items():
        assert torch.equal(value, ray_engine.model.state_dict()[name]), name


def test_ray_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)       # import ray -> ImportError
    cfg = default_profiles_dir() / "runs" / "demo.yaml"
    res = CliRunner().invoke(app, ["simulate", "-c", str(cfg), "--rounds", "1", "--output", str(tmp_path / "o"),
                                   "--ray"])
    assert res.exit_code == 2, res.output
    assert "--ray needs Ray: pip install 'sfl-edge[ray]'" in res.output and "Traceback" not in res.output
