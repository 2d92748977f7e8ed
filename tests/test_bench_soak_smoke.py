"""bench/soak.py --quick runs its simulated part end to end and writes its JSON (numbers not meaningful)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_soak_bench_quick_sim(tmp_path):
    out = subprocess.run([sys.executable, "bench/soak.py", "--quick", "--parts", "sim", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "soak-quick.json").read_text())
    sim = doc["sim"]
    assert sim["soak"]["rounds_completed"] == sim["undisturbed"]["rounds_completed"] == 6
    assert sim["soak"]["kills"] == sum(len(v) for v in sim["killed_at"].values())
    # every replay the chaos transport injected was counted as one
    assert sim["soak"]["rejected"].get("replayed", 0) == sim["injected"]["replay"]
    assert 0.0 <= sim["soak"]["final_accuracy"] <= 1.0
