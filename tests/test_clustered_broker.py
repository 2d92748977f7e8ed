"""The product against a broker that clusters: RabbitMQ with its MQTT plugin.

Nothing in the product is Mosquitto-specific; these runs prove it on the broker most unlike
Mosquitto that installs here. RabbitMQ 3.x differs in three ways that matter: its retained
messages live on one node only and reach only exact-topic subscriptions, and it routes MQTT
topics through AMQP (``/`` becomes ``.``, so ids must not contain dots — ours cannot). The
coordinator repeats its run description when an agent comes online, so agents on any node
learn what to train.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from sfl_core.wire import protocol
from helpers import PROFILES, REPO, coordinator_key, finish, logs, metrics, start_agents, start_coord, write_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _agent(url: str, run: str, i: int, tmp_path) -> subprocess.Popen:
    log = open(tmp_path / f"agent-{i}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "cli.agent", "start", "--profile", PROFILES[i],
                             "--broker", url, "--run", run, "--index", str(i), "--agent-id", f"a{i}",
                             "--verbose", "--emulate", "--coordinator-key", coordinator_key(tmp_path / "out")], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


class _Watcher:
    """A plain MQTT client on one node that records what arrives on exact topics."""

    def __init__(self, port: int, topics: list[str]) -> None:
        self.got: list[tuple[str, bytes, bool]] = []
        self.arrived = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"watch-{time.monotonic_ns()}")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        for t in topics:
            self.client.subscribe(t, qos=1)

    def _on_message(self, client, userdata, m) -> None:
        self.got.append((m.topic, bytes(m.payload), bool(m.retain)))
        self.arrived.set()

    def wait(self, pred, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(pred(*g) for g in list(self.got)):
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_training_through_one_rabbitmq_node(rabbitmq_cluster, tmp_path):
    """Coordinator and three agent processes on one RabbitMQ node train the same model, round by
    round, as the serial simulation of the same config (and so as the run over Mosquitto)."""
    node, _ = rabbitmq_cluster
    config = write_config(tmp_path, "rmq1")
    coord = start_coord(config, tmp_path, "--broker", node.url)
    agents = start_agents(node.url, "rmq1", tmp_path)
    assert finish([coord, *agents], timeout=180) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    assert [r["round"] for r in m] == [0, 1, 2]
    assert all(len(r["completed"]) == 3 for r in m[1:])
    from simulation import run_simulation
    from sfl_core.config.run import load_run_config
    cfg = dataclasses.replace(load_run_config(config), output_dir=str(tmp_path / "sim"))
    history, _ = run_simulation(cfg, device="cpu")
    assert [h["accuracy"] for h in history] == [r["accuracy"] for r in m]


def test_training_across_a_two_node_cluster(rabbitmq_cluster, tmp_path):
    """The coordinator on node A, agents on A and B, started after the run was announced (so the
    retained description, held by A only, cannot reach B's agents: the repeat must). An agent
    killed on B fires its last will, which a client on A receives; the run completes without it."""
    a, b = rabbitmq_cluster
    run = "rmq2"
    config = write_config(tmp_path, run, rounds=3, step_timeout_s=6, register_timeout_s=60)
    watcher = _Watcher(a.port, [protocol.info_topic(run), protocol.status_topic(run, "a2")])
    try:
        coord = start_coord(config, tmp_path, "--broker", a.url)
        assert watcher.wait(lambda t, p, r: t == protocol.info_topic(run) and p, 60), logs(tmp_path)
        # the retained copy: a client subscribing on A now gets it (RabbitMQ: exact topic only)
        late = _Watcher(a.port, [protocol.info_topic(run)])
        assert late.wait(lambda t, p, r: r and p, 10), "node A did not keep the retained run description"
        late.close()
        agents = [_agent(a.url, run, 0, tmp_path), _agent(b.url, run, 1, tmp_path), _agent(b.url, run, 2, tmp_path)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (tmp_path / "out" / "metrics.jsonl").exists() \
                or len(metrics(tmp_path)) < 2:
            assert time.monotonic() < deadline and coord.poll() is None, logs(tmp_path)
            time.sleep(0.2)
        agents[2].send_signal(signal.SIGKILL)
        offline = lambda t, p, r: t == protocol.status_topic(run, "a2") and p and \
            not protocol.decode(p, run=run, allowed=frozenset({"status"})).body["online"]
        assert watcher.wait(offline, 20), "a2's last will did not reach node A"
        assert finish([coord, agents[0], agents[1]], timeout=180) == [0, 0, 0], logs(tmp_path)
    finally:
        watcher.close()
    m = metrics(tmp_path)
    assert [r["round"] for r in m] == [0, 1, 2, 3]
    assert sorted(m[1]["completed"]) == ["a0", "a1", "a2"]
    assert sorted(m[-1]["completed"]) == ["a0", "a1"]
    assert m[-1]["accuracy"] > m[0]["accuracy"] + 0.2, m
