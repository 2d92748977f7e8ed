"""What the person at a device sees, and what a device's stop costs the fleet, with real
coordinator and agent processes over a real Mosquitto: a cleanly stopped agent leaves its round
at once (it says so as it goes), and a training agent logs one line per round and answers
``sfl-agent status``."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import PROFILES, REPO, finish, logs, metrics, start_agents, start_coord, wait_rounds, write_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.agent", "status", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"})


def test_a_stopped_agent_leaves_its_round_at_once_and_a_training_one_says_how_it_goes(mosquitto, tmp_path):
    """a1 gets SIGTERM in round 2 (rounds take ~2 s; the step timeout is 60 s): the coordinator
    drops it at once, so round 2 lasts about as long as round 1 (today's main waited 60 s).
    a0 logs one line per round and `sfl-agent status` reads its state and last round."""
    run, url = "stop", mosquitto.url
    config = write_config(tmp_path, run, fleet=[{"profile": PROFILES[0], "count": 2}], rounds=4, local_iters=30,
                          step_timeout_s=60)
    coord = start_coord(config, tmp_path, "--broker", url)
    agents = start_agents(url, run, tmp_path, n=2, extra={i: ["--status-file", str(tmp_path / f"a{i}.json")]
                                                          for i in range(2)})
    try:
        wait_rounds(tmp_path, 1, coord, 150)
        time.sleep(1.0)                                                  # inside round 2
        agents[1].send_signal(signal.SIGTERM)
        live = _status("--status-file", str(tmp_path / "a0.json"))
        assert live.returncode == 0, live.stdout + live.stderr
        assert agents[1].wait(timeout=20) == 0, logs(tmp_path)
        assert finish([coord, agents[0]], 200) == [0, 0], logs(tmp_path)
    finally:
        for p in (coord, *agents):
            if p.poll() is None:
                p.kill()
                p.wait()
    history = metrics(tmp_path)
    assert history[2]["completed"] == ["a0"], history[2]
    assert history[2]["wall_s"] < history[1]["wall_s"] + 15, (history[1]["wall_s"], history[2]["wall_s"])
    assert "dropping a1 from the round: left (its process said it is offline)" in (tmp_path / "coord.log").read_text()
    # the device's view: one line per round, and its status
    assert re.search(r"agent a0 in run stop: (training \(round \d\)|waiting for a round); pid \d+ running",
                     live.stdout), live.stdout
    text = (tmp_path / "agent-0.log").read_text()
    done = re.findall(r"INFO sfl.agent: round (\d) done: split 2, batch 16, 30 steps, loss on the server, "
                      r"[\d.]+ [kM]B up, [\d.]+ [kM]B down, [\d.]+ s", text)
    assert done == ["1", "2", "3", "4"], text[-3000:]
    after = _status("--status-file", str(tmp_path / "a0.json"))
    assert after.returncode == 0, after.stderr
    lines = after.stdout.splitlines()
    assert re.match(r"agent a0 in run stop: stopped; pid \d+ not running; updated \d+ s ago", lines[0]), lines
    assert lines[1] == "rounds done: 4" and lines[2].startswith("last round 4 done: split 2, batch 16"), lines
    doc = json.loads(_status("--status-file", str(tmp_path / "a0.json"), "--format", "json").stdout)
    assert doc["state"] == "stopped" and doc["last_round"]["steps"] == 30 and doc["last_round"]["bytes_up"] > 0
    missing = _status("--status-file", str(tmp_path / "nobody.json"))
    assert missing.returncode == 2 and "no status file" in missing.stderr + missing.stdout


def test_on_a_terminal_the_agent_shows_its_rounds_steps_live(mosquitto, tmp_path):
    """An agent whose standard error is a terminal (a pseudo-terminal here, as a person's shell
    gives it) shows a live line of the round's steps, with the per-round lines above it."""
    import os
    import threading

    run, url = "tty", mosquitto.url
    config = write_config(tmp_path, run, fleet=[{"profile": PROFILES[2], "count": 1}], rounds=2, local_iters=20)
    coord = start_coord(config, tmp_path, "--broker", url)
    master, slave = os.openpty()
    key = __import__("helpers").coordinator_key(tmp_path / "out")
    agent = subprocess.Popen([sys.executable, "-m", "cli.agent", "start", "--profile", PROFILES[2], "--broker", url,
                              "--run", run, "--agent-id", "a0", "--coordinator-key", key,
                              "--status-file", str(tmp_path / "a0.json")],
                             stdin=slave, stdout=slave, stderr=slave, cwd=REPO,
                             env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "160"})
    os.close(slave)
    screen = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            screen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert finish([coord, agent], 180) == [0, 0], logs(tmp_path) + screen.decode(errors="replace")
    finally:
        for p in (coord, agent):
            if p.poll() is None:
                p.kill()
                p.wait()
        reader.join(timeout=5)
        os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace"))
    assert re.search(r"round 1 .*\d+/20", text), text[-3000:]          # the live line: round, steps of 20
    assert "round 2 done: split 2, batch 16, 20 steps" in text, text[-3000:]
    assert "Traceback" not in text
