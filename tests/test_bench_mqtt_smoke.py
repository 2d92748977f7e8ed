"""Smoke test of the two MQTT benchmarks (bench/data_plane.py, bench/round.py).

Runs each script with ``--quick`` as a user would (a subprocess) against a Mosquitto this
test starts through ``bench/brokers.py``, and checks that the JSON it writes has the keys
and the internal consistency the report relies on. The numbers themselves are not
asserted (performance is measured in bench/, not in timed tests) except for physics a
working product cannot violate: an emulated round cannot beat the time model's time
(docs/methods/time-model.md) of the profiles it emulates, and a chunked message must really be chunked.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import bench_module

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"

pytestmark = pytest.mark.timeout(150)


brokers = bench_module("brokers")


@pytest.fixture(scope="module")
def bench_broker():
    if brokers.find_mosquitto() is None:
        if os.environ.get("SFL_REQUIRE_MOSQUITTO") == "1":
            pytest.fail(brokers.MOSQUITTO_MISSING)
        pytest.skip(brokers.MOSQUITTO_MISSING)
    with brokers.MosquittoBroker() as b:
        yield b


def _run(script: str, out: Path, *args: str, timeout: float = 120, result: str = "") -> dict:
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--out", str(out), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    path = out / f"{result or Path(script).stem}.json"
    assert path.exists(), proc.stdout[-2000:]
    return json.loads(path.read_text())


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_data_plane_quick(bench_broker, tmp_path):
    doc = _run("data_plane.py", tmp_path, "--broker", bench_broker.url, "--data", "digits",
               "--cases", "16KiB", "2MiB")
    assert doc["benchmark"] == "data_plane" and doc["quick"] is True
    assert doc["broker_url"] == bench_broker.url
    assert [c["case"] for c in doc["cases"]] == ["16KiB", "2MiB"]
    for c in doc["cases"]:
        for side in ("raw", "product"):
            s = c[side]
            for key in ("msgs_per_s", "mb_per_s", "latency_ms_p50", "latency_ms_p90", "publish_ms_p50"):
                assert _positive(s[key]), (side, key, s)
            assert s["latency_ms_p90"] >= s["latency_ms_p50"] >= s["latency_ms_min"]
            assert s["mb_per_s"] == pytest.approx(s["msgs_per_s"] * c["payload_bytes"] / 1e6)
        assert c["ratio"]["throughput"] == pytest.approx(c["product"]["msgs_per_s"] / c["raw"]["msgs_per_s"])
        assert c["ratio"]["latency_p50"] == pytest.approx(c["product"]["latency_ms_p50"] / c["raw"]["latency_ms_p50"])
    small, big = doc["cases"]
    # batch sizes were picked to hit the target encoded size
    assert 0.5 * 16 * 1024 < small["payload_bytes"] < 2 * 16 * 1024 and small["chunks"] == 1
    assert 0.5 * 2 * 2**20 < big["payload_bytes"] < 2 * 2 * 2**20
    assert big["chunks"] == math.ceil(big["payload_bytes"] / doc["chunk_bytes"]) >= 2


def test_round_quick(bench_broker, tmp_path):
    doc = _run("round.py", tmp_path, "--broker", bench_broker.url)
    assert doc["benchmark"] == "round" and doc["quick"] is True
    (w,) = doc["workloads"]
    assert w["model"] == "small_cnn" and w["server_mode"] == "merged"
    assert [r["round"] for r in w["rounds_detail"]] == list(range(1, w["rounds"] + 1))
    for r in w["rounds_detail"]:
        assert set(r["agents"]) == {f"a{i}" for i in range(len(w["profiles"]))}
        assert r["bound_s"] == pytest.approx(max(a["bound_s"] for a in r["agents"].values()))
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["bound_s"])
        for a in r["agents"].values():
            assert a["bytes_up"] > 0 and a["bytes_down"] > 0
            assert a["bound_s"] == pytest.approx(a["bound_client_s"] + a["bound_transfer_s"] + a["bound_server_s"])
        # emulated devices sleep at least their profile's compute and transfer time
        assert r["ratio"] > 0.9, r
    later = w["rounds_detail"][1:]
    assert w["mean_ratio_excl_round1"] == pytest.approx(sum(r["ratio"] for r in later) / len(later))


@pytest.mark.slow
def test_coordinator_load_quick(bench_broker, tmp_path):
    """The load bench drives a real ``sfl-coord serve`` with protocol-speaking agents; every round
    must complete with every agent, and the figures must add up."""
    doc = _run("coordinator_load.py", tmp_path, "--data", "digits", "--agents", "3", "--registered", "5",
               "--agents-per-connection", "2", "--stages", timeout=240, result="coordinator_load_registered5")
    assert doc["benchmark"] == "coordinator_load_registered5" and doc["quick"] is True
    (lvl,) = doc["levels"]
    assert lvl["agents"] == 3 and lvl["registered"] == 5 and lvl["rounds_measured"] == 1
    for key in ("steps_per_s", "act_mb_per_s", "step_ms_p50", "coord_cpu_pct", "coord_rss_mb",
                "coord_faults_per_agent_step"):
        assert _positive(lvl[key]), (key, lvl)
    assert lvl["broker_cpu_pct"] >= 0  # a few-ms window may fall between two CPU samples of the broker
    assert lvl["agent_steps_per_s"] == pytest.approx(3 * lvl["steps_per_s"])
    assert lvl["step_ms_p99"] >= lvl["step_ms_p90"] >= lvl["step_ms_p50"]
    assert lvl["act_mb_per_s"] == pytest.approx(lvl["act_kb_per_message"] * 1e-3 * lvl["agent_steps_per_s"])
    assert 0 < lvl["server_step_pct"] < 100
    # the time between rounds (assignments out after weights in): a share of the window; the score
    # inside it, which server workers share; the bound the rest puts on four; no median from a
    # single measured round
    b, scored = lvl["boundary_pct"] / 100, lvl["scored_pct"] / 100
    assert 0 < b < 1 and 0 <= scored < b and lvl["boundary_ms_p50"] is None
    assert lvl["serial_pct"] == pytest.approx(100 * (b - scored))
    assert lvl["amdahl_4"] == pytest.approx(1 / (b - scored + (1 - b + scored) / 4)) and 1 < lvl["amdahl_4"] < 4
    assert lvl["heartbeats_per_s"] >= 0 and lvl["generators"] >= 1
    # the floor and the heartbeat's cost: measured, and the liveness rows follow from them
    assert 0 < doc["floor"]["decode_ms"] < doc["floor"]["total_ms"]
    assert doc["heartbeat_us"] > 0
    # the physical bound under the server step: its arithmetic at the rate this core sustains
    fl = doc["floor"]
    assert fl["server_step_mflop"] > 0 and fl["matmul_gflops"] > 0
    assert fl["server_step_bound_ms"] == pytest.approx(fl["server_step_mflop"] / fl["matmul_gflops"])
    assert fl["server_step_bound_ms"] < 1.5 * fl["server_step_ms"]
    # the transport's floor: a bare paho client moves messages of the run's own sizes
    bare = doc["floor"]["transport"]
    assert bare["receive_ms"] > 0 and bare["publish_ms"] > 0 and bare["link_publish_ms"] > 0
    assert bare["receive_qos0_ms"] > 0     # the same messages with no acknowledgement back (not the product's)
    assert bare["total_ms"] == pytest.approx(bare["receive_ms"] + bare["publish_ms"])
    assert doc["floor"]["act_bytes"] == pytest.approx(lvl["act_kb_per_message"] * 1e3, rel=0.01)
    # the bare coordinator: the floor's work on paho and nothing else, in lock-step with as many bare
    # agents as the level; beside it the transport alone under that traffic
    assert set(bare["lockstep_ms"]) == set(fl["bare_coordinator_ms_at"]) == {"3"}
    assert 0 < bare["lockstep_ms"]["3"] < fl["bare_coordinator_ms_at"]["3"] == lvl["bare_coordinator_ms"]
    assert lvl["bare_coordinator_ratio"] == pytest.approx(lvl["coord_cpu_ms_per_agent_step"] / lvl["bare_coordinator_ms"])
    # --stages: the coordinator's CPU per stage, from thread CPU timers on both busy threads
    stages = lvl["stage_cpu_ms"]
    for key in ("decode", "server step", "encode", "publish", "evaluate", "parse/validate", "paho"):
        assert stages[key] > 0, (key, stages)
    assert abs(stages["other threads"]) < 0.5 * sum(stages.values()), stages
    big = doc["liveness"][-1]
    assert big["registered"] == 10_000 and big["heartbeats_per_s"] == pytest.approx(10_000 / 120)
    assert big["coord_cpu_pct"] == pytest.approx(big["heartbeats_per_s"] * doc["heartbeat_us"] / 1e4)


@pytest.mark.slow
def test_coordinator_load_with_server_workers_and_steps_in_flight(bench_broker, tmp_path):
    """``--server-workers 1 2 --window 2``: one pass per worker count; with two, the load agents
    send their rows to the worker their assignment names, and with either they keep two steps in
    flight; every round completes with every agent (the bench raises otherwise), rank 0's CPU is
    read apart from the rest, and two workers are read against one at the same load."""
    doc = _run("coordinator_load.py", tmp_path, "--data", "digits", "--agents", "4", "--server-workers", "1", "2",
               "--window", "2", timeout=420, result="coordinator_load_workers1-2_window2")
    one, two = doc["levels"]
    assert (one["server_workers"], two["server_workers"]) == (1, 2)
    assert one["agents"] == two["agents"] == 4 and one["windows"] == two["windows"] == [2]
    assert one["leader_cpu_pct"] == one["coord_cpu_pct"] and 0 < two["leader_cpu_pct"] < two["coord_cpu_pct"]
    assert one["ranks_cpu_pct"] is None
    rank0, rank1 = two["ranks_cpu_pct"]   # each rank alone, found by its RANK
    assert rank0 == two["leader_cpu_pct"] and rank1 > 0
    assert rank0 + rank1 == pytest.approx(two["coord_cpu_pct"], rel=0.05, abs=1.0)
    assert _positive(two["agent_steps_per_s"]) and two["step_ms_p99"] >= two["step_ms_p50"] > 0
    (scaled,) = doc["scaling"]
    assert (scaled["agents"], scaled["server_workers"]) == (4, 2)
    assert scaled["x_one_worker"] == pytest.approx(two["agent_steps_per_s"] / one["agent_steps_per_s"])
    assert scaled["amdahl_bound"] is None or 1 < scaled["amdahl_bound"] <= 2
    assert scaled["ranks_cpu_pct"] == two["ranks_cpu_pct"]


@pytest.mark.slow
def test_coordinator_load_zstd_levels(bench_broker, tmp_path):
    """``--zstd-levels`` runs each load level once per codec setting in one invocation: the run
    and its agents really use the level (raw bytes at 0 outweigh zstd's at 3), and each level has
    its own floor."""
    doc = _run("coordinator_load.py", tmp_path, "--data", "digits", "--agents", "2", "--zstd-levels", "3", "0",
               timeout=240, result="coordinator_load_zstd3-0")
    z3, z0 = doc["levels"]
    assert (z3["zstd_level"], z0["zstd_level"]) == (3, 0) and z3["agents"] == z0["agents"] == 2
    assert z0["act_kb_per_message"] > z3["act_kb_per_message"]
    assert set(doc["floor_by_zstd_level"]) == {"3", "0"} and doc["floor"] == doc["floor_by_zstd_level"]["3"]
    for b in doc["floor_by_zstd_level"].values():
        assert 0 < b["decode_ms"] < b["total_ms"]
