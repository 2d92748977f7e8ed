"""Operating a fleet, with real processes and a real Mosquitto (the in-process halves are in
test_operations_engine.py):

- one coordinator per run: a second one of the same output directory, or of the same run on
  the same broker, exits 2 naming the running one and changes nothing; the first trains on;
- ``serve --resume auto`` (what the shipped unit runs): SIGKILLed, restarted the same way, the
  run continues from its last completed round and no round is recorded twice or untrained;
- a refused ``--resume`` puts nothing on the wire;
- agents stop at once on SIGTERM wherever they wait (exit 0, one line);
- agents follow only their coordinator: forged run descriptions before the start and mid-run
  are refused, and 300 invented registrations change nothing;
- an agent of the previous protocol version is answered with one reason it can read;
- the live fleet page (in headless Chromium) and the Prometheus metrics of a running run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import paho.mqtt.client as mqtt
import pytest

from conftest import free_port
from coordinator.mqtt_transport import MqttTransport
from coordinator import state as ckpt
from helpers import PROFILES, REPO, coordinator_key, finish, logs, start_agents, start_coord, wait_log, write_config
from sfl_core.wire import signing
from sfl_core.wire import protocol
from sfl_core.wire import codec as wire
from sfl_core.config.run import load_profile
from sfl_core.wire.protocol import Message

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _rounds_done(tmp_path: Path, out: str = "out") -> int:
    path = tmp_path / out / ckpt.METRICS_FILE
    if not path.exists():
        return -1
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    try:
        return json.loads(lines[-1])["round"] if lines else -1
    except ValueError:
        return -1


def _wait_round(tmp_path: Path, r: int, timeout: float, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while _rounds_done(tmp_path) < r:
        assert time.monotonic() < deadline, logs(tmp_path)
        assert all(p.poll() is None for p in procs), logs(tmp_path)
        time.sleep(0.2)


def _one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and " INFO " not in ln]
    assert "Traceback" not in text, text
    return lines[-1]


def _stop(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


# ============================================================ defects 1, 2 and item 9

def test_one_coordinator_per_run_and_resume_auto_after_sigkill(mosquitto, tmp_path):
    config = write_config(tmp_path, "ops", rounds=16, local_iters=8)   # room for three refused starts before the kill
    url = mosquitto.url
    coord = start_coord(config, tmp_path, "--broker", url, "--resume", "auto", name="coord")
    agents = start_agents(url, "ops", tmp_path, n=3, extra={i: ["--slowdown", "4"] for i in range(3)})
    procs = [coord, *agents]
    try:
        _wait_round(tmp_path, 1, 120, [coord])
        # a second `serve` of the same output directory: exit 2 naming the running one, nothing renamed
        for name, extra in (("second", ()), ("second-resume", ("--resume",))):
            p = start_coord(config, tmp_path, "--broker", url, *extra, name=name)
            assert p.wait(timeout=60) == 2, logs(tmp_path)
            line = _one_line((tmp_path / f"{name}.log").read_text())
            assert f"is in use by another coordinator (pid {coord.pid}" in line, line
        # the same run from another output directory (another host) on the same broker: the claim
        p = start_coord(config, tmp_path, "--broker", url, "--output", str(tmp_path / "elsewhere"), name="third")
        assert p.wait(timeout=60) == 2, logs(tmp_path)
        line = _one_line((tmp_path / "third.log").read_text())
        assert "another coordinator of run 'ops' is running" in line and f"pid {coord.pid}" in line, line
        assert not list((tmp_path / "out").glob("metrics.jsonl.*")), "a live run's files were renamed"
        assert coord.poll() is None, logs(tmp_path)

        # systemd's restart after a crash: SIGKILL, then the unit's own command again
        assert _rounds_done(tmp_path) < 14, "the run went too fast for this test's checks"
        coord.send_signal(signal.SIGKILL)
        coord.wait()
        restarted = start_coord(config, tmp_path, "--broker", url, "--resume", "auto", name="restarted")
        procs.append(restarted)
        codes = finish([restarted, *agents], 240)
        assert codes == [0, 0, 0, 0], (codes, logs(tmp_path))
    finally:
        _stop(*procs)
    history = [json.loads(ln) for ln in (tmp_path / "out" / ckpt.METRICS_FILE).read_text().splitlines()]
    assert [m["round"] for m in history] == list(range(17)), [m["round"] for m in history]
    assert all(m["completed"] for m in history[1:]), [m["completed"] for m in history]
    text = (tmp_path / "restarted.log").read_text()
    assert "resuming ops after round" in text and "held an earlier run" not in text, text
    assert "re-registered mid-round" not in text, text
    assert history[-1]["accuracy"] > 0.6, history[-1]


# ============================================================ defect 3

def test_a_refused_resume_puts_nothing_on_the_wire(mosquitto, tmp_path):
    from simulation import run_simulation
    from sfl_core.config.run import load_run_config

    config = write_config(tmp_path, "refused", rounds=2, local_iters=2)
    run_simulation(load_run_config(config))
    metrics = tmp_path / "out" / ckpt.METRICS_FILE
    lines = metrics.read_text().splitlines()
    lines[1] = "{corrupted"
    metrics.write_text("\n".join(lines) + "\n")

    seen: list[str] = []
    listener = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="listener")
    listener.on_message = lambda c, u, m: seen.append(m.topic)
    listener.connect("127.0.0.1", mosquitto.port)
    listener.subscribe("sfl/refused/#", qos=1)
    listener.loop_start()
    try:
        p = start_coord(config, tmp_path, "--broker", mosquitto.url, "--resume")
        assert p.wait(timeout=60) == 2, logs(tmp_path)
        time.sleep(1.0)
    finally:
        listener.loop_stop()
        listener.disconnect()
    line = _one_line((tmp_path / "coord.log").read_text())
    assert f"cannot resume: {metrics}: line 2 is not a round record" in line, line
    assert seen == [], f"announced before refusing: {seen}"


# ============================================================ defect 4

def _agent(tmp_path: Path, broker: str, run: str, name: str, *extra: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "cli.agent", "start", "--profile", PROFILES[0], "--broker",
                             broker, "--run", run, "--agent-id", name, "--verbose", *extra,
                             *([] if "--coordinator-key" in extra else
                               ["--coordinator-key", coordinator_key(tmp_path / "out")])],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def _info_body() -> dict:
    return {"model": "small_cnn", "dataset": "digits", "input_shape": [1, 8, 8], "num_classes": 10,
            "splits": [2], "num_agents": 1, "partition": {"scheme": "iid", "alpha": 0.5, "seed": 0}}


def test_agents_stop_promptly_on_sigterm_wherever_they_wait(mosquitto, tmp_path):
    """Waiting for the run description, and waiting for registration to be accepted (a
    coordinator that answers link probes but never registration): SIGTERM ends either within
    seconds, exit 0, one line. Today's main waited for the kill timeout."""
    mute = MqttTransport(mosquitto.url, "mute").start()     # announces and answers probes; never polls
    mute.publish_run_info(_info_body())
    waiting = _agent(tmp_path, mosquitto.url, "nobody", "waiting")
    registering = _agent(tmp_path, mosquitto.url, "mute", "registering", "--coordinator-key",
                         signing.public_text(mute.signer.public))
    try:
        assert wait_log(tmp_path / "waiting.log", "waiting for the coordinator's description", 60), logs(tmp_path)
        assert wait_log(tmp_path / "registering.log", "measured: link", 90), logs(tmp_path)
        time.sleep(1.0)                                       # inside the registration wait
        for p, name in ((waiting, "waiting"), (registering, "registering")):
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=10) == 0, logs(tmp_path)
            assert time.monotonic() - t0 < 5, name
            assert _one_line((tmp_path / f"{name}.log").read_text()) == f"agent {name}: stopped by a signal"
    finally:
        _stop(waiting, registering)
        mute.close(finished=True)


# ============================================================ defects 5 and 6

def _flood(port: int, run: str, n: int) -> None:
    """``n`` invented agents register within a few seconds (valid envelopes and bodies)."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="flooder")
    c.connect("127.0.0.1", port)
    c.loop_start()
    body = protocol.register_body(index=0, profile=load_profile("s2fl-high-high"), measured={},
                                  label_counts=[10] * 10, num_samples=100, emulate=False, resume={}, privacy={})
    for i in range(n):
        fake = f"fake-{i}"
        c.publish(protocol.up_topic(run, fake), Message("register", run, fake, body, seq=protocol.next_seq()).encode(),
                  qos=1)
        time.sleep(0.01)
    time.sleep(0.5)
    c.loop_stop()
    c.disconnect()


def test_agents_follow_only_their_coordinator_and_a_flood_changes_nothing(mosquitto, tmp_path):
    """A forger publishes a retained run description (another model) before the coordinator
    starts and again mid-run; 300 invented ids register mid-run. Agents 0 and 1 know the
    coordinator's key (--coordinator-key), agent 2 is given it by file after the coordinator
    started. Every forged
    description is refused with a line naming it, every round trains the three real agents,
    and the checkpoint's registry holds only them."""
    run, url = "trust", mosquitto.url
    config = write_config(tmp_path, run, rounds=6, local_iters=10)
    signing.Signer.load_or_create(tmp_path / "out" / signing.KEY_FILE)    # the key the coordinator will use
    pub = str(tmp_path / "out" / "coordinator.pub")
    forger = MqttTransport(url, run, signer=signing.Signer.generate()).start()
    forged = {**_info_body(), "model": "vgg_mini", "input_shape": [1, 8, 8]}
    forger.publish_run_info(forged)
    early = [_agent(tmp_path, url, run, f"a{i}", "--index", str(i), "--emulate", "--coordinator-key", pub)
             for i in range(2)]
    procs = list(early)
    try:
        for i in range(2):
            assert wait_log(tmp_path / f"a{i}.log", "refused", 60), logs(tmp_path)
        coord = start_coord(config, tmp_path, "--broker", url)
        procs.append(coord)
        assert wait_log(tmp_path / "coord.log", "coordinator key", 60), logs(tmp_path)
        time.sleep(1.0)
        late = _agent(tmp_path, url, run, "a2", "--index", "2", "--emulate", "--coordinator-key", pub)
        procs.append(late)
        _wait_round(tmp_path, 1, 120, [coord])
        forger._run_info = None
        forger.publish_run_info({**forged, "partition": {"scheme": "dirichlet", "alpha": 0.1, "seed": 9}})
        _flood(mosquitto.port, run, 300)
        codes = finish([coord, *early, late], 240)
        assert codes == [0, 0, 0, 0], (codes, logs(tmp_path))
    finally:
        _stop(*procs)
        forger.close(finished=False)
    history = [json.loads(ln) for ln in (tmp_path / "out" / ckpt.METRICS_FILE).read_text().splitlines()]
    real = ["a0", "a1", "a2"]
    assert all(m["completed"] == real and m["selected"] == real for m in history[1:]), \
        [(m["selected"], m["completed"]) for m in history]
    assert history[-1]["accuracy"] > 0.6, history[-1]
    rejected: dict[str, int] = {}
    for m in history:
        for k, v in (m.get("rejected") or {}).items():
            rejected[k] = rejected.get(k, 0) + v
    assert rejected.get("unprobed", 0) + rejected.get("rate_limited", 0) >= 250, rejected
    saved = json.loads((tmp_path / "out" / ckpt.STATE_FILE).read_text())
    assert sorted(saved["registry"]) == real
    for name in real:
        text = (tmp_path / f"{name}.log").read_text()
        assert "refused" in text and "'vgg_mini'" in text, (name, text)   # the mid-run forgery, with what it changes
        assert text.count("loaded shard") == 1, text      # never rebuilt its data for another run


# ============================================================ defect 7

def test_an_agent_of_the_previous_protocol_version_gets_one_reason(mosquitto):
    coord = MqttTransport(mosquitto.url, "old").start()
    got: list[dict] = []
    old = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="old-agent")
    old.on_message = lambda c, u, m: got.append(msgpack.unpackb(m.payload, raw=False))
    old.connect("127.0.0.1", mosquitto.port)
    old.subscribe(protocol.down_topic("old", "pi-1"), qos=1)
    old.loop_start()
    try:
        time.sleep(0.5)
        # its announcement first (issue 62 item 7: it would otherwise wait for a run description it
        # cannot read), then its registration, then its announcement again: answered twice a minute
        status = {"v": 1, "type": "status", "run": "old", "sender": "pi-1", "seq": 1, "round": 0, "step": 0,
                  "body": {"online": True}}
        v1 = {"v": 1, "type": "register", "run": "old", "sender": "pi-1", "seq": 2, "round": 0, "step": 0,
              "body": {"index": 0, "profile": {"name": "pi"}, "measured": {}, "label_counts": [1], "num_samples": 1,
                       "emulate": False, "resume": {}}}
        old.publish(protocol.status_topic("old", "pi-1"), wire.pack(status), qos=1)
        old.publish(protocol.up_topic("old", "pi-1"), wire.pack(v1), qos=1)
        old.publish(protocol.status_topic("old", "pi-1"), wire.pack({**status, "seq": 3}), qos=1)
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        old.loop_stop()
        old.disconnect()
        coord.close(finished=True)
    assert len(got) == 2, got
    for reply in got:
        assert reply["v"] == 1 and reply["type"] == "reject", reply     # in the agent's own version
        assert reply["body"]["reason"].startswith("protocol version 1 is not supported: this coordinator speaks "
                                                  f"version {wire.PROTOCOL_VERSION}"), reply
    assert coord.rejections.counts() == {"version": 3}


# ============================================================ items 10 and 11

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _dom(url: str) -> str:
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000",
                          "--dump-dom", url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("SFL_REQUIRE_CHROMIUM"),
                    reason="needs Chromium (apt-get install chromium)")
def test_live_fleet_page_and_metrics_of_a_running_run(mosquitto, tmp_path):
    """A 3-agent run served with --dashboard and --metrics: in headless Chromium the page has
    one row per agent and its plot's points grow with the rounds; the metrics follow the run;
    after the run, `sfl-coord dashboard` shows the finished run from its files."""
    assert CHROMIUM is not None, "SFL_REQUIRE_CHROMIUM is set but Chromium is missing"
    page, metrics = free_port(), free_port()
    # rounds of some seconds: headless Chromium takes seconds to load the page, and the points must
    # be seen to grow between two loads (with rounds of a second, the run could end in between)
    config = write_config(tmp_path, "live", rounds=10, local_iters=40)
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url, "--dashboard", f"127.0.0.1:{page}",
                        "--metrics", f"127.0.0.1:{metrics}")
    agents = start_agents(mosquitto.url, "live", tmp_path, n=3)
    procs = [coord, *agents]
    try:
        _wait_round(tmp_path, 2, 120, [coord])
        first = _dom(f"http://127.0.0.1:{page}/")
        assert first.count('class="agent"') == 3, first
        assert first.count('<td class="on">yes</td>') == 3, first
        for a in ("a0", "a1", "a2"):
            assert f"<td class=\"l\">{a}</td>" in first, first
        points_early = first.count('class="pt"')
        m = _scrape(metrics)
        assert m["sfl_round"] >= 2 and m["sfl_agents_registered"] == 3 and m["sfl_rounds_planned"] == 10, m
        assert 0 < m["sfl_accuracy"] <= 1 and m["sfl_bytes_up_total"] > 0, m
        assert sum(v for k, v in m.items() if k.startswith("sfl_agent_assignment_info{")) == 3, m
        _wait_round(tmp_path, 8, 180, [coord])
        later = _dom(f"http://127.0.0.1:{page}/")
        assert later.count('class="pt"') > points_early, (points_early, later)
        assert _scrape(metrics)["sfl_round"] >= 8
        codes = finish([coord, *agents], 180)
        assert codes == [0, 0, 0, 0], (codes, logs(tmp_path))
    finally:
        _stop(*procs)
    # over the finished run's files
    port = free_port()
    viewer = subprocess.Popen([sys.executable, "-m", "cli.coord", "dashboard", str(tmp_path / "out"),
                               "--listen", f"127.0.0.1:{port}"], stdout=open(tmp_path / "viewer.log", "w"),
                              stderr=subprocess.STDOUT, cwd=REPO)
    try:
        assert wait_log(tmp_path / "viewer.log", "fleet page of", 30), logs(tmp_path)
        done = _dom(f"http://127.0.0.1:{port}/")
        assert "finished after round 10" in done and done.count('class="agent"') == 3, done
        assert 'class="on"' not in done and 'class="off"' not in done, done   # online: unknown once it ended
    finally:
        viewer.send_signal(signal.SIGTERM)
        assert viewer.wait(timeout=10) == 0

