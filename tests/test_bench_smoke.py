"""Smoke tests for the bench scripts: each runs with ``--quick`` in a subprocess, exactly as
a user would start it, and must write a JSON result with the expected structure.

Why a subprocess: the scripts are entry points (``python bench/<name>.py``), so argument
parsing, the ``sys.path`` set-up and the file they write are part of what is tested.
Numbers are NOT asserted beyond sanity (finite, positive): performance is measured in
bench/, not asserted in timed tests.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DATASETS, bench_module

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
FASHION = DATASETS / "fashion-mnist"
# real data when this machine has it, else the bundled digits (still real images)
DATA = str(FASHION) if FASHION.is_dir() else "digits"


def _run(script: str, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, str(BENCH / script), "--quick", "--out", str(out), "--data", DATA, *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    files = list(out.glob("*.json"))
    assert len(files) == 1, f"expected one JSON file in {out}, found {files}"
    doc = json.loads(files[0].read_text())
    assert "wrote" in proc.stdout
    assert shlex.split(doc["command"])[1:] == cmd[1:], "the recorded command is not the one that ran"
    for key in ("benchmark", "command", "machine", "config", "reference", "results"):
        assert key in doc, f"{files[0].name} lacks {key!r}"
    for key in ("torch", "device_name", "cpu_count", "git_commit"):
        assert key in doc["machine"]
    assert doc["results"], "no results"
    return doc


def test_codec_quick(tmp_path: Path) -> None:
    doc = _run("codec.py", tmp_path)
    assert doc["benchmark"] == "codec"
    rows = doc["results"]
    settings = {(r["codec"], r["zstd_level"]) for r in rows}
    assert {("fp32", 0), ("fp16", 0), ("fp32", 1), ("fp16", 1)} <= settings
    for r in rows:
        for key in ("act_bytes_per_sample", "grad_bytes_per_sample", "act_ratio", "grad_ratio", "encode_MBps",
                    "decode_MBps", "memcpy_MBps", "encode_vs_memcpy", "decode_vs_memcpy",
                    "act_max_rel_err", "grad_max_rel_err"):
            assert math.isfinite(r[key]) and r[key] >= 0, (key, r[key])
        assert r["encode_MBps"] > 0 and r["memcpy_MBps"] > 0
    by = {(r["codec"], r["zstd_level"]): r for r in rows}
    # fp32 uncompressed is lossless and ~raw size; fp16 halves it and is lossy but close
    assert by["fp32", 0]["act_max_rel_err"] == 0 and by["fp32", 0]["grad_max_rel_err"] == 0
    assert 0.95 < by["fp32", 0]["act_ratio"] <= 1.0
    assert 1.9 < by["fp16", 0]["act_ratio"] <= 2.0
    assert 0 < by["fp16", 0]["act_max_rel_err"] < 1e-2


def test_server_quick(tmp_path: Path) -> None:
    doc = _run("server.py", tmp_path, "--device", "cpu")
    assert doc["benchmark"] == "server-cpu"
    assert doc["config"]["device"] == "cpu"
    for r in doc["results"]:
        assert set(r["variants"]) == {"plain", "plain+io", "merged", "per_agent", "plain+decode", "merged+decode"}
        for v in r["variants"].values():
            assert v["steps_per_s"] > 0 and math.isfinite(v["samples_per_s"])
        assert r["variants"]["plain"]["vs_plain"] == pytest.approx(1.0)
        assert r["merged_vs_plain"] > 0 and r["merged_decode_vs_plain_decode"] > 0
        assert 0 < r["wire_bytes_per_agent"] < 4 * math.prod(r["activation_shape"]) * 8   # fp16 + zstd, batch 8


def test_server_rejects_an_unknown_codec(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH / "server.py"), "--quick", "--out", str(tmp_path), "--codec", "fp12"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "fp12" in proc.stderr


def test_server_rejects_bad_input_shape(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH / "server.py"), "--quick", "--out", str(tmp_path), "--input-shape", "3,x"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "3,x" in proc.stderr


def test_planner_quick(tmp_path: Path) -> None:
    doc = _run("planner.py", tmp_path)
    timing, = doc["results"]["planning_time"]
    assert timing["agents"] == 20 and 0 < timing["plan_s"] < 10
    err = doc["results"]["prediction_error"]["virtual clock"]
    assert err["rounds"] >= 1 and math.isfinite(err["median"])


@pytest.mark.slow
def test_ray_sim_quick(tmp_path: Path) -> None:
    """The Ray simulation bench: serial and 2 actors, same results, positive times."""
    pytest.importorskip("ray")
    doc = _run("ray_sim.py", tmp_path)
    serial, ray2 = doc["results"]
    assert serial["mode"] == "serial" and ray2["mode"] == "ray 2" and ray2["workers"] == 2
    assert serial["same_as_serial"] and ray2["same_as_serial"], doc["results"]
    for row in doc["results"]:
        assert row["rounds_wall_s"] > 0 and row["total_wall_s"] >= row["rounds_wall_s"] + row["round1_wall_s"]


def test_leakage_quick(tmp_path: Path) -> None:
    if DATA == "digits":
        pytest.skip("the leakage bench needs 28x28 images (Fashion-MNIST or MNIST)")
    doc = _run("leakage.py", tmp_path)
    assert doc["benchmark"] == "leakage"
    for r in doc["results"]:
        for key in ("accuracy", "ssim", "psnr_db", "dcor2_u", "label_attack"):
            assert math.isfinite(r[key]), (r["setting"], key)
        assert -1 <= r["ssim"] <= 1 and 0 <= r["label_attack"] <= 1
    assert {s["setting"] for s in doc["summary"]} == {r["setting"] for r in doc["results"]}


@pytest.mark.skipif(not FASHION.is_dir(), reason="needs the Fashion-MNIST idx files (SFL_DATASETS)")
def test_own_data_quick(tmp_path: Path) -> None:
    doc = _run("own_data.py", tmp_path)
    assert doc["benchmark"] == "own_data"
    seed = doc["results"][0]
    assert [d["samples"] for d in seed["fleet"]["devices"]] == sorted((d["samples"] for d in seed["fleet"]["devices"]),
                                                                      reverse=True)
    assert set(seed["methods"]) == {"FedAvg", "SFL", "auto"}
    for run in (seed["central"], *seed["methods"].values()):
        assert 0 <= run["final"] <= 1 and run["wall_s"] > 0
    assert [r["method"] for r in doc["summary"]] == ["central", "FedAvg", "SFL", "auto"]


@pytest.mark.slow
@pytest.mark.skipif(not FASHION.is_dir(), reason="needs the Fashion-MNIST idx files (SFL_DATASETS)")
def test_simulate_speed_quick(tmp_path: Path) -> None:
    """The bench runs the same config simulated and deployed (real processes) and records both."""
    doc = _run("simulate_speed.py", tmp_path)
    run = doc["results"][0]
    for way in ("simulated", "deployed"):
        assert run[way]["wall_s"] > 0 and 0 <= run[way]["final"] <= 1, run
    assert run["ratio"] == pytest.approx(run["simulated"]["wall_s"] / run["deployed"]["wall_s"])


def test_identical_quick_writes_a_reference_and_finds_the_same_run_identical(tmp_path: Path) -> None:
    ref = tmp_path / "ref.json"
    for mode in ("--write", "--check"):
        proc = subprocess.run([sys.executable, str(BENCH / "identical.py"), "--quick", mode, str(ref)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "runs/demo.yaml: identical" in proc.stdout and "1 of 1 runs identical" in proc.stdout
    doc = json.loads(ref.read_text())
    doc["histories"]["runs/demo.yaml"][1]["accuracy"] += 1e-12     # one bit of one number
    ref.write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, str(BENCH / "identical.py"), "--quick", "--check", str(ref)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "runs/demo.yaml: [1].accuracy:" in proc.stdout, proc.stdout


def test_attack_signals_quick(tmp_path: Path) -> None:
    doc = _run("attack_signals.py", tmp_path, "--work", str(tmp_path / "work"))
    assert doc["benchmark"] == "attack_signals-quick"
    assert {r["statistic"] for r in doc["results"]} == {"loss", "accuracy"}
    for r in doc["results"]:
        assert 0 <= r["honest"][0] <= r["honest"][1] and 0 <= r["flippers"][0] <= r["flippers"][1]


def test_shared_scoring_quick(tmp_path: Path) -> None:
    """The bench scores the set alone and shared among one and two gloo ranks, in turns."""
    doc = _run("shared_scoring.py", tmp_path)
    assert [r["ranks"] for r in doc["results"]] == [1, 2]
    for r in doc["results"]:
        assert r["samples"] == 64 and len(r["alone_ms"]) == len(r["shared_ms"]) == 3
        assert r["alone_ms_p50"] > 0 and r["shared_ms_p50"] > 0
        assert r["x_one_process"] == pytest.approx(r["alone_ms_p50"] / r["shared_ms_p50"])


def test_attacks_quick_at_a_batch_of_eight(tmp_path: Path) -> None:
    """The attack bench trains the batch it is given (``--batch``), recorded with its result."""
    cmd = [sys.executable, str(BENCH / "attacks.py"), "--quick", "--batch", "8", "--out", str(tmp_path), "--data", DATA,
           "--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "attacks-quick.json").read_text())
    assert doc["config"]["batch"] == 8 and doc["rows"]
    assert all(r["runs"] == 1 for r in doc["rows"])


def test_pipeline_quick_records_whom_the_defense_flagged_each_round(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH / "pipeline.py"), "--quick", "--only", "demo", "--rows", "window 1", "window auto",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "pipeline-quick.json").read_text())
    for row, runs in doc["results"]["demo"].items():
        assert all(isinstance(x["flagged"], list) for r in runs for x in r["curve"])
        summary = doc["summary"]["demo"][row]
        assert summary["flagged_device_rounds"] == sum(len(x["flagged"]) for r in runs for x in r["curve"])
        # every split device-round counted once by window and once by cut
        assert sum(summary["windows"].values()) == sum(summary["cuts"].values()) > 0


def test_the_pipeline_bench_adds_up_windows_and_cuts_over_every_seed():
    tally = bench_module("common").tally
    assert tally([{2: 240}, {"2": 112, "4": 128}]) == {"2": 352, "4": 128}
    assert list(tally([{"10": 1}, {"4": 1, "2": 1}])) == ["2", "4", "10"]
    assert tally([]) == {}


def test_a_result_records_its_command_so_that_it_can_be_pasted_back(tmp_path, monkeypatch):
    """An argument with spaces (a fleet's name, a row's) comes back as one argument."""
    common = bench_module("common")
    argv = ["bench/pipeline.py", "--only", "40 boards, Dirichlet 0.3", "--rows", "window 1", "window auto",
            "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    doc = json.loads(common.write_result(tmp_path, "probe", {"results": {}}).read_text())
    assert shlex.split(doc["command"]) == [Path(sys.executable).name, *argv]


def test_a_run_is_at_its_commit_whatever_logs_and_results_it_leaves_in_the_tree():
    """Only source marks a result's tree as changed: a tracked file, or an untracked Python or YAML
    file; a log or an ``--out`` folder of JSON a run wrote into the clone does not."""
    common = bench_module("common")
    assert not common.source_changed("")
    assert not common.source_changed("?? boards.log\n?? out/pipeline.json\n?? out/paper-s2fl.md")
    assert common.source_changed("?? boards.log\n M sfl_core/timing.py")
    assert common.source_changed("?? bench/probe.py")
    assert common.source_changed("?? profiles/runs/mine.yaml")
    assert common.source_changed("D  docs/results.md")
