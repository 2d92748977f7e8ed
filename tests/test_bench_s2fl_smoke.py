"""bench/s2fl.py --quick runs end to end and writes its JSON and plot (numbers not meaningful)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_s2fl_bench_quick(tmp_path):
    out = subprocess.run([sys.executable, "bench/s2fl.py", "--quick", "--data", "digits", "--out", str(tmp_path),
                          "--work", str(tmp_path / "runs")], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "s2fl-quick.json").read_text())
    methods = doc["summary"]["a=0.5"]["methods"]
    assert set(methods) == {"FedAvg", "SFL", "S2FL+B", "S2FL+M", "S2FL+MB"}
    for m in methods.values():
        assert 0.0 <= m["final_accuracy_mean"] <= 1.0
    # SplitFed v1 with one server copy per agent is FedAvg in disguise: same batches, same numbers
    curves = doc["curves"]["a=0.5"]
    for a, b in zip(curves["FedAvg"][0], curves["SFL"][0]):
        assert abs(a["accuracy"] - b["accuracy"]) <= 0.01
