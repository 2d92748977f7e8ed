"""``strategy: auto`` over Mosquitto with real coordinator and agent processes (wall clock): the
planner works from the agents' measurements and the round times the coordinator measures."""

from __future__ import annotations

import pytest

from helpers import finish, logs, metrics, start_agents, start_coord, write_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_auto_runs_with_agent_processes(mosquitto, tmp_path):
    config = write_config(tmp_path, "auto", strategy="auto", rounds=3)
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "auto", tmp_path)
    assert finish([coord, *agents], timeout=200) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    assert [r["round"] for r in m] == [0, 1, 2, 3]
    assert m[3]["accuracy"] > m[0]["accuracy"] + 0.2, m
    for r in m[1:]:
        plan = r["auto"]
        assert r["clock"] == "wall" and len(r["completed"]) == 3
        assert sum(a["batch"] for a in plan["assign"].values()) == 3 * 16   # the merged batch keeps its size
        for agent, a in plan["assign"].items():             # the agents trained what the plan said
            assert r["agents"][agent]["split"] == a["split"] and r["agents"][agent]["batch_size"] == a["batch"]
        assert plan["measured_round_s"] > 0 and plan["predicted_round_s"] > 0
        # measured: the round by the wall clock, the coordinator's own work included
        assert plan["measured_round_s"] == r["round_time_s"]
        assert plan["measured_round_s"] >= max(a["time_s"] for a in r["agents"].values()) - 1e-3
    # ... which auto learns as the coordinator's seconds per split agent per step
    assert any(r["auto"].get("overhead_s", 0) > 0 for r in m[2:]), [r["auto"] for r in m[1:]]
    # high-high's fast compute trains the whole model (weights only), low-low keeps a cut, in the same round
    whole = [{a: v["whole_model"] for a, v in r["agents"].items()} for r in m[1:]]
    assert any(len(set(w.values())) == 2 for w in whole), whole


def test_auto_bottleneck_widths_with_agent_processes(mosquitto, tmp_path):
    """auto.widths over the wire: agents cut at the run's split build the narrow encoder they are
    assigned, train it, and the coordinator merges their rows through the full pair."""
    config = write_config(tmp_path, "autow", strategy="auto", rounds=4, split=2,
                          auto={"widths": [8, 16, 32], "max_compression": 4, "codecs": ["fp32"]})
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "autow", tmp_path)
    assert finish([coord, *agents], timeout=200) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    assert [r["round"] for r in m] == [0, 1, 2, 3, 4] and all(len(r["completed"]) == 3 for r in m[1:])
    rows = [a for r in m[1:] for a in r["agents"].values()]
    assert all(a["split"] <= 2 for a in rows)
    assert all(a["width"] in (8, 16, 32) for a in rows if a["split"] == 2)
    assert any(a["split"] == 2 and a["width"] < 32 for a in rows), rows
    assert m[4]["accuracy"] > m[0]["accuracy"] + 0.2, [(r["accuracy"], r["agents"]) for r in m[1:]]


def test_the_default_decides_the_learning_options_of_a_skewed_fleet_over_mosquitto(mosquitto, tmp_path):
    """No learning switch in the config: on three devices holding a few classes each (Dirichlet
    0.05), 2 of them a round, auto switches SCAFFOLD and server momentum
    on before round 1, says why in the log, records them every round, and the run learns."""
    config = write_config(tmp_path, "skewed", strategy="auto", rounds=6, per_round=2,
                          data={"dataset": "digits", "partition": "dirichlet", "alpha": 0.05, "seed": 1})
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "skewed", tmp_path)
    assert finish([coord, *agents], timeout=200) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    assert [r["round"] for r in m] == [0, 1, 2, 3, 4, 5, 6]
    for r in m[1:]:
        assert r["learning"]["drift"] == {"kind": "scaffold"}
        assert r["learning"]["server_opt"] == {"kind": "momentum", "lr": 1.0, "beta1": 0.5}
        assert r["learning"]["norm_stats"] == "off"
        assert r["learning"]["lr_anneal"] == "off"       # six rounds: no levelled-off first half to judge
    log = (tmp_path / "coord.log").read_text()
    assert "auto: lr_anneal: off (round 1: the accuracy is still climbing (or not yet scored)" in log
    assert "auto: drift: kind scaffold (round 1: label-skewed devices" in log
    assert "auto: norm_stats: off (round 1: the model has no BatchNorm layers)" in log
    assert m[6]["accuracy"] > m[0]["accuracy"] + 0.25, [r["accuracy"] for r in m]
