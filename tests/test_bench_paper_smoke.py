"""bench/paper.py --quick runs each paper's setting end to end and writes its JSON (numbers not meaningful)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("paper", ["fedfc", "heterosfl", "mergesfl", "s2fl"])
def test_paper_bench_quick(tmp_path, paper):
    out = subprocess.run([sys.executable, "bench/paper.py", paper, "--quick", "--data", "digits", "--out", str(tmp_path),
                          "--work", str(tmp_path / "runs")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / f"paper-{paper}-quick.json").read_text())
    assert doc["scale"]["full"] is False and 0 < doc["scale"]["factors"]["flops"] < 1
    (setting, summary), = doc["summary"].items()
    assert len(summary["methods"]) == 2
    for m in summary["methods"].values():
        assert 0.0 <= m["final_accuracy_mean"] <= 1.0 and m["round_time_s_mean"] > 0
    # the replica's profiles were scaled by the factors the model shrank
    prof = next((tmp_path / "runs").glob("profiles-*/*.yaml")).read_text()
    assert f"x flops {doc['scale']['factors']['flops']:.4g}" in prof
