"""bench/heterosfl.py --quick runs end to end and writes its JSON (numbers not meaningful)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))


def test_heterosfl_bench_quick(tmp_path):
    out = subprocess.run([sys.executable, "bench/heterosfl.py", "--quick", "--data", "digits", "--out", str(tmp_path),
                          "--work", str(tmp_path / "runs")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "heterosfl-quick.json").read_text())
    methods = doc["summary"]["a=0.3/30%"]
    assert set(methods) == {"SFL", "Top-k 64x", "HetBL 64x", "HeteroSFL 64x"}
    for m in methods.values():
        assert 0.0 <= m["final_accuracy_mean"] <= 1.0
    # compressing the slow group's link shortens the virtual round
    assert methods["HetBL 64x"]["virtual_time_s"] < methods["SFL"]["virtual_time_s"]
    by = {(r["width"], r["codec"]): r for r in doc["bytes_per_sample"]}
    assert by[(1, "fp32")]["up_bytes"] < by[(16, "fp32")]["up_bytes"] < by[("none", "fp32")]["up_bytes"]


def test_method_table_matches_the_paper_setup():
    import heterosfl as h

    m = h.methods()
    # 256x on the low group: 1 of 256 channels; the high group (16x the rate) 16 channels
    assert m["HetBL 256x"]["hetero"]["widths"] == [1, 16]
    assert m["IdBL 256x"]["hetero"]["widths"] == [1, 1]
    assert m["HeteroSFL 16x"]["hetero"]["widths"] == [16, 256] and m["HeteroSFL 16x"]["hetero"]["bdks"]
    assert m["Top-k 16x"]["hetero"]["codecs"] == ["topk4", "fp32"]
    assert m["SFL"]["loss"] == "ce" and all(v["loss"] == "calibrated" for k, v in m.items() if k != "SFL")
