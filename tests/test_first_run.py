"""What a user sees on a first run with an untuned fleet: each rough edge pinned by a test."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordinator.cli import app
from sfl_core.config import default_profiles_dir

RUNNER = CliRunner()


def _run_config(tmp_path: Path, **changes) -> Path:
    doc = yaml.safe_load((default_profiles_dir() / "runs" / "demo.yaml").read_text())
    doc.update(changes)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_wrong_data_root_names_the_config_file_and_field(tmp_path):
    cfg = _run_config(tmp_path, data={"dataset": "mnist", "root": str(tmp_path / "mnsit")},
                      output_dir=str(tmp_path / "out"))
    res = RUNNER.invoke(app, ["simulate", "-c", str(cfg)], env={"COLUMNS": "300"})
    assert res.exit_code == 2
    line, = [l for l in res.output.splitlines() if "mnsit" in l]
    assert line.startswith(f"{cfg}: field 'data.root': ") and "no such file or directory" in line
    assert "Traceback" not in res.output
    # the --data flag overrides data.root: then the flag is what is named
    res = RUNNER.invoke(app, ["simulate", "-c", str(cfg), "--data", str(tmp_path / "nowhere")], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "--data: " in res.output and "nowhere" in res.output
    assert not (tmp_path / "out").exists()      # nothing was started or written


def test_simulate_summary_shows_the_clocks_seconds_not_the_hosts(tmp_path):
    """In a simulation the per-agent compute/transfer/waiting seconds are the time model's
    (profile FLOP/s, real bytes), identical however busy the host is."""
    import io

    from rich.console import Console

    from coordinator.cli import simulate_run
    from coordinator.console import summary_table
    from sfl_core.accounting import model_costs
    from sfl_core.config import load_run_config

    cfg = load_run_config(_run_config(tmp_path, rounds=2, output_dir=str(tmp_path / "out")))
    history, engine = simulate_run(cfg, device="cpu")
    costs = model_costs(cfg.model, (1, 8, 8), 10)
    for a, info in engine.registry.agents.items():
        rows = [rec["agents"][a] for rec in history if a in rec["agents"]]
        expected = sum(costs[r["split"]].client_flops * r["batch_size"] * cfg.local_iters for r in rows) \
            / info.profile["compute_flops"]
        assert info.client_s == pytest.approx(expected, rel=1e-3)
        assert info.transfer_s == pytest.approx(sum(r["transfer_s"] for r in rows), abs=1e-3) and info.transfer_s > 0
        assert info.wait_s >= 0
    slowest = max(engine.registry.agents.values(), key=lambda i: i.client_s + i.transfer_s)
    assert slowest.wait_s == pytest.approx(0, abs=1e-3)      # the slowest agent never waits
    out = io.StringIO()
    Console(file=out, width=200).print(summary_table(history, engine.registry))
    text = out.getvalue()
    assert "transfer s" in text and "waiting s" in text and "not this host's time" in text
