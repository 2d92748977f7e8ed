"""What a user sees on a first run with an untuned fleet: each rough edge pinned by a test."""

from __future__ import annotations

from pathlib import Path

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
