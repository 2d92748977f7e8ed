"""What an operator meets outside the training loop, with real processes and a real Mosquitto:

- two agents started with the same ``--agent-id``: the second exits 2 naming the id, the first
  keeps its connection; a restarted agent (its predecessor killed) still takes the id over;
- an agent given a wrong ``--run`` says which runs the broker does announce, and keeps waiting;
- the embedded broker listens on loopback only, unless ``--insecure-listen`` (a warning);
- while the broker is down, the coordinator's publishes do not block and silence does not grow.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from conftest import free_port
from sfl_core.wire import protocol
from sfl_core.wire.protocol import Message
from helpers import PROFILES, REPO, coordinator_key, logs, wait_log, write_config

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def agent(tmp_path: Path, broker: str, run: str, agent_id: str, name: str, index: int = 0) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "cli.agent", "start", "--profile", PROFILES[0],
                             "--broker", broker, "--run", run, "--index", str(index), "--agent-id", agent_id,
                             "--verbose", "--coordinator-key", coordinator_key(tmp_path / "out")], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


# ============================================================ duplicate agent id; wrong --run

def test_duplicate_agent_id_and_wrong_run(mosquitto, tmp_path):
    """Two agents started with one id: the second exits 2 naming the id, the first keeps its
    connection. A restart after a kill, and one after a power cut (the dead process's online
    status still on the broker), take the id over. And an agent of a run nobody announces
    lists, after 10 s, the runs the broker does announce, and keeps waiting."""
    from coordinator.mqtt_transport import MqttTransport

    announcer = MqttTransport(mosquitto.url, "right-run").start()
    announcer.publish_run_info({"model": "small_cnn", "dataset": "digits", "input_shape": [1, 8, 8],
                                "num_classes": 10, "splits": [2], "num_agents": 1,
                                "partition": {"scheme": "iid", "alpha": 0.5, "seed": 0}})
    first = agent(tmp_path, mosquitto.url, "dup", "twin", "first")
    procs = [first]
    try:
        assert wait_log(tmp_path / "first.log", "waiting for the coordinator's description", 60), logs(tmp_path)
        second = agent(tmp_path, mosquitto.url, "dup", "twin", "second")
        procs.append(second)
        assert second.wait(timeout=60) == 2, logs(tmp_path)
        text = (tmp_path / "second.log").read_text()
        assert "agent id 'twin' is already in use by another running agent" in text, text
        assert "Traceback" not in text

        # the first was not disturbed, and (its run 'dup' is announced by nobody) says what it sees
        assert wait_log(tmp_path / "first.log", "runs announced there: right-run (check --run)", 30), logs(tmp_path)
        assert first.poll() is None, logs(tmp_path)
        first_log = (tmp_path / "first.log").read_text()
        assert "no coordinator announces run 'dup'" in first_log, first_log
        assert "connection lost" not in first_log and "reconnected" not in first_log, first_log
        assert "started with our agent id twin" in first_log, first_log
        assert "rejected" not in first_log                 # another run's description is not "bad input"

        # a restart is not a duplicate: the killed process's connection closed, its last will
        # (offline) fired, and the new process takes the id without a word
        first.send_signal(signal.SIGKILL)
        first.wait()
        restarted = agent(tmp_path, mosquitto.url, "dup", "twin", "restarted")
        procs.append(restarted)
        assert wait_log(tmp_path / "restarted.log", "waiting for the coordinator's description", 60), logs(tmp_path)
        assert restarted.poll() is None and "already in use" not in (tmp_path / "restarted.log").read_text()
        stop(restarted)

        # after a power cut the broker still holds the dead process's online status (its last will
        # comes only when its keep-alive runs out): nobody answers for it, and the id is taken over
        ghost = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ghost")
        ghost.connect("127.0.0.1", mosquitto.port)
        ghost.loop_start()
        status = Message("status", "dup", "twin", {"online": True, "instance": "deadbeef0000"},
                         seq=protocol.next_seq()).encode()
        ghost.publish(protocol.status_topic("dup", "twin"), status, qos=1, retain=True).wait_for_publish(10)
        ghost.loop_stop()
        ghost.disconnect()
        after_power_cut = agent(tmp_path, mosquitto.url, "dup", "twin", "after-power-cut")
        procs.append(after_power_cut)
        assert wait_log(tmp_path / "after-power-cut.log", "no longer answers: taking it over", 60), logs(tmp_path)
        assert after_power_cut.poll() is None
    finally:
        stop(*procs)
        announcer.close(finished=True)


# ============================================================ embedded broker: loopback by default

def _non_loopback_address() -> str | None:
    """An address of this host that is not loopback, if it has one (the interface to the default route)."""
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect(("10.255.255.255", 1))               # no packet is sent: this only picks a route
        addr = s.getsockname()[0]
        s.close()
    except OSError:
        return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def _anonymous_client_connects(host: str, port: int) -> bool:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="stranger")
    try:
        c.connect(host, port, keepalive=5)
    except OSError:
        return False
    rc = c.loop(timeout=2.0)
    connected = c.is_connected() and rc == mqtt.MQTT_ERR_SUCCESS
    c.disconnect()
    return connected


def _serve(tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
    config = write_config(tmp_path, "emb", register_timeout_s=60)
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "cli.coord", "serve", "--config", str(config), "--quiet",
                             *args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def test_embedded_broker_is_loopback_only_unless_insecure_flag(tmp_path):
    # default: 127.0.0.1 (the --help says so, and so does the process)
    from typer.testing import CliRunner

    from cli.coord import app
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "127.0.0.1:1883" in help_text and "0.0.0.0" not in help_text

    port = free_port()
    coord = _serve(tmp_path, "default", "--listen", f"127.0.0.1:{port}")
    try:
        assert wait_log(tmp_path / "default.log", f"listening at mqtt://127.0.0.1:{port}", 60), logs(tmp_path)
        assert _anonymous_client_connects("127.0.0.1", port)
        other = _non_loopback_address()
        if other is not None:   # a stranger on the network cannot reach it
            assert not _anonymous_client_connects(other, port), other
    finally:
        stop(coord)

    # another address without the flag: refused, exit 2, nothing listens
    port = free_port()
    coord = _serve(tmp_path, "refused", "--listen", f"0.0.0.0:{port}")
    assert coord.wait(timeout=60) == 2, logs(tmp_path)
    text = (tmp_path / "refused.log").read_text()
    assert "--insecure-listen" in text and "no TLS and no passwords" in text and "Traceback" not in text, text
    assert not _anonymous_client_connects("127.0.0.1", port)

    # with the flag: it listens, and says loudly what that means
    coord = _serve(tmp_path, "insecure", "--listen", f"0.0.0.0:{port}", "--insecure-listen")
    try:
        assert wait_log(tmp_path / "insecure.log", "listening at", 60), logs(tmp_path)
        text = (tmp_path / "insecure.log").read_text()
        assert "WARNING: the embedded broker listens on 0.0.0.0 without TLS or authentication" in text, text
        assert _anonymous_client_connects("127.0.0.1", port)
    finally:
        coord.send_signal(signal.SIGTERM)
        assert coord.wait(timeout=30) == 130, logs(tmp_path)
    assert "stopped by a signal" in (tmp_path / "insecure.log").read_text()


# ============================================================ broker down: nothing blocks

def test_publishing_while_the_broker_is_down_does_not_block(mosquitto):
    """The coordinator's transport with the broker gone: ``send`` returns at once (paho queues the
    message for the reconnect), the liveness clock stands still, and it all works again after."""
    from coordinator.mqtt_transport import MqttTransport

    got: list[bytes] = []
    listener = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="listener")
    listener.on_message = lambda c, u, m: got.append(m.payload)
    listener.on_connect = lambda c, *_: c.subscribe(protocol.down_topic("bd", "a0"), qos=1)
    listener.reconnect_delay_set(min_delay=0.2, max_delay=1)  # type: ignore[arg-type]
    listener.connect("127.0.0.1", mosquitto.port)
    listener.loop_start()
    t = MqttTransport(mosquitto.url, "bd").start()
    try:
        time.sleep(0.5)
        mosquitto.stop()
        deadline = time.monotonic() + 10
        while t.link.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        live0, wall0 = t.live_time(), time.monotonic()
        for i in range(3):
            t0 = time.monotonic()
            t.send("a0", Message("shutdown", "bd", protocol.COORDINATOR_ID, {"reason": f"r{i}"},
                                 seq=protocol.next_seq()))
            assert time.monotonic() - t0 < 1.0
        time.sleep(2.0)
        assert t.live_time() - live0 < 0.5 < time.monotonic() - wall0   # the outage does not count as silence
        mosquitto.start()
        assert t.link.wait_connected(20)
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:      # the listener is back and subscribed
            t.send("a0", Message("shutdown", "bd", protocol.COORDINATOR_ID, {"reason": "after"},
                                 seq=protocol.next_seq()))
            time.sleep(0.5)
        assert got, "nothing delivered after the broker came back"
        live1, wall1 = t.live_time(), time.monotonic()
        time.sleep(1.0)
        assert t.live_time() - live1 == pytest.approx(time.monotonic() - wall1, abs=0.1)  # runs again
    finally:
        t.close()
        listener.loop_stop()
        listener.disconnect()
