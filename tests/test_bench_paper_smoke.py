"""bench/paper.py --quick runs each paper's setting end to end and writes its JSON (numbers not meaningful)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("paper", ["fedfc", "heterosfl", "mergesfl", "noniid", "s2fl"])
def test_paper_bench_quick(tmp_path, paper):
    # one paper also recomputes its BatchNorm statistics (the diagnostic column)
    extra = ["--norm-stats"] if paper == "heterosfl" else []
    out = subprocess.run([sys.executable, "bench/paper.py", paper, "--quick", "--data", "digits", "--out", str(tmp_path),
                          "--work", str(tmp_path / "runs"), *extra], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / f"paper-{paper}-quick.json").read_text())
    # every replica but noniid's (whose model is already small) is narrower than the paper's model
    assert doc["scale"]["full"] is False and 0 < doc["scale"]["factors"]["flops"] <= 1
    assert (doc["scale"]["factors"]["flops"] < 1) == (paper != "noniid")
    (setting, summary), = doc["summary"].items()
    # the Markdown table the README quotes is written beside the JSON
    md = (tmp_path / f"paper-{paper}-quick.md").read_text()
    assert f"*{setting}*" in md
    assert ("BN stats recomputed" in md) == bool(extra)
    if extra:
        assert all(0.0 <= m["norm_stats_recomputed_mean"] <= 1.0 for m in summary["methods"].values())
    assert len(summary["methods"]) == 2
    # each round of each run records whom the defense flagged (none expected, but always a list)
    assert all(isinstance(x["flagged"], list) for runs in doc["curves"][setting].values() for r in runs for x in r)
    for m in summary["methods"].values():
        assert 0.0 <= m["final_accuracy_mean"] <= 1.0 and m["round_time_s_mean"] > 0
    # the replica's profiles were scaled by the factors the model shrank
    prof = next((tmp_path / "runs").glob("profiles-*/*.yaml")).read_text()
    assert f"x flops {doc['scale']['factors']['flops']:.4g}" in prof


def test_from_runs_reads_the_seeds_asked_for(tmp_path):
    """``--from-runs --seed S --seeds N`` reports seeds S..S+N-1 of a directory that holds more
    (fresh seeds beside the ones a sweep chose on must not be pooled with them)."""
    script = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, 'bench'); import paper\n"
        "work = Path(sys.argv[1])\n"
        "for seed in range(4):\n"
        "    d = work / paper.run_dir_name('a=0.1', 'M, x', seed); d.mkdir(parents=True)\n"
        "    rec = {'round': 1, 'accuracy': seed / 10, 'elapsed_s': 1.0, 'bytes_up': 1, 'bytes_down': 1}\n"
        "    (d / 'metrics.jsonl').write_text(json.dumps(rec) + '\\n')\n"
        "for first, n in ((0, 2), (2, 2), (1, 5)):\n"
        "    c = paper.curves_from_runs({}, work, ['a=0.1'], ['M, x'], range(first, first + n))\n"
        "    print([run[-1]['accuracy'] for run in c['a=0.1']['M, x']])\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["[0.0, 0.1]", "[0.2, 0.3]", "[0.1, 0.2, 0.3]"]
