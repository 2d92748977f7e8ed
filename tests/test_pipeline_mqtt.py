"""Steps in flight over Mosquitto, with real coordinator and agent processes on emulated links
(wall clock): agents keep a window of 4 steps in flight, the coordinator takes the ones that
come ahead in step order, every round completes and the run learns; the same run in lock-step
takes longer."""

from __future__ import annotations

import pytest

from helpers import finish, logs, metrics, start_agents, start_coord, write_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _run(mosquitto, tmp_path, name: str, **over) -> list[dict]:
    work = tmp_path / name
    work.mkdir()
    config = write_config(work, name, rounds=3, local_iters=12, **over)
    coord = start_coord(config, work, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, name, work)
    assert finish([coord, *agents], timeout=240) == [0, 0, 0, 0], logs(work)
    return metrics(work)


def test_a_window_of_four_over_mosquitto(mosquitto, tmp_path):
    piped = _run(mosquitto, tmp_path, "piped", window=4)
    assert [r["round"] for r in piped] == [0, 1, 2, 3]
    for r in piped[1:]:
        assert r["clock"] == "wall" and r["completed"] == ["a0", "a1", "a2"], r
        assert all(a["window"] == 4 for a in r["agents"].values())
        assert not r.get("rejected"), r["rejected"]      # nothing came out of order or twice
    assert piped[3]["accuracy"] > piped[0]["accuracy"] + 0.2, piped
    lockstep = _run(mosquitto, tmp_path, "lockstep")
    assert all("window" not in a for r in lockstep[1:] for a in r["agents"].values())
    # the emulated links move one message at a time beside the compute: in flight, the slow
    # device's uploads overlap its next steps and the server's
    piped_s = sum(r["round_time_s"] for r in piped[1:])
    lockstep_s = sum(r["round_time_s"] for r in lockstep[1:])
    assert piped_s < 0.9 * lockstep_s, (piped_s, lockstep_s)
