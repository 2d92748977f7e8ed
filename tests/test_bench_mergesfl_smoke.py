"""bench/mergesfl.py --quick runs end to end and writes its JSON (numbers not meaningful)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_mergesfl_bench_quick(tmp_path):
    out = subprocess.run([sys.executable, "bench/mergesfl.py", "--quick", "--data", "digits", "--out", str(tmp_path),
                          "--work", str(tmp_path / "runs")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "mergesfl-quick.json").read_text())
    assert set(doc["summary"]["a=0.1"]["methods"]) == {"FedAvg", "SFL", "SFL+FM", "SFL+BR", "MergeSFL"}
    assert set(doc["summary"]["FedFC class-imbalance"]["methods"]) == {"single split", "mixed cuts"}
    for s in doc["summary"].values():
        for m in s["methods"].values():
            assert 0.0 <= m["final_accuracy_mean"] <= 1.0 and m["traffic_bytes"] > 0
    assert [r["agents"] for r in doc["ga_timing"]] == [100, 1000]
