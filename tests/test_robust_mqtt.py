"""A device that lies, over Mosquitto, with real processes: four honest agents (``sfl-agent
start``) and one liar written from docs/protocol.md alone (``tests/liar_agent.py``: well-formed
messages, activations a hundred times anyone's, random labels, noised weights). The default
defense leaves its rows out of every server step, names it, quarantines it after three rounds,
and the run learns."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import PROFILES, REPO, finish, logs, metrics, start_agents, start_coord, write_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_a_liar_written_from_the_protocol_is_screened_named_and_quarantined_while_the_run_learns(mosquitto, tmp_path):
    config = write_config(tmp_path, "liar", rounds=5, per_round=5,
                          fleet=[{"profile": PROFILES[i % 3], "count": 1} for i in range(5)])
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    honest = start_agents(mosquitto.url, "liar", tmp_path, n=4)
    with open(tmp_path / "liar.log", "w") as log:
        liar = subprocess.Popen([sys.executable, str(REPO / "tests" / "liar_agent.py"), "--broker", mosquitto.url,
                                 "--run", "liar", "--agent-id", "liar", "--index", "4", "--timeout", "240"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        assert finish([coord, *honest, liar], timeout=260) == [0] * 6, logs(tmp_path)
    finally:
        for p in (coord, *honest, liar):
            if p.poll() is None:
                p.kill()
                p.wait()
    m = metrics(tmp_path)
    assert [r["round"] for r in m] == [0, 1, 2, 3, 4, 5]
    for r in m[1:4]:     # selected, its rows screened out of every step and its update out of the average
        assert "liar" in r["selected"]
        assert r["robust"]["rows_left_out"] == {"liar": 10}, r["robust"]
        assert r["robust"]["activation_scale"]["liar"] > 20
    assert m[3]["robust"]["quarantined"] == ["liar"]
    for r in m[4:]:      # never selected again; the honest four are never flagged
        assert "liar" not in r["selected"] and len(r["completed"]) == 4
    assert all(set(a for k in ("rows_left_out", "clipped", "capped") for a in r.get("robust", {}).get(k, {}))
               <= {"liar"} for r in m[1:])
    assert m[5]["accuracy"] > m[0]["accuracy"] + 0.3, [r["accuracy"] for r in m]
    log = (tmp_path / "coord.log").read_text()
    assert "robust: round 1: rows of liar left out of the server's step 0" in log
    assert "quarantined liar: flagged by robust aggregation in 3 of its rounds in a row" in log
    assert "sfl-coord agents readmit" in log
