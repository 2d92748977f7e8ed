"""Faults and forgeries that earlier defenses let through, each with real processes over a real
Mosquitto: a forger's retained run description, a lying ``seq`` in both directions, a probe
flood, a coordinator killed while agents probe it, a run that finishes while an agent joins it,
an agent restarted mid-round, a straggler, a device that stays busy without answering, and one
agent's signed assignment replayed on another's topic."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from coordinator.mqtt_transport import MqttTransport
from sfl_core.config.run import load_profile
from sfl_core.wire import protocol, signing
from sfl_core.wire.protocol import COORDINATOR_ID, Message
from helpers import (PROFILES, REPO, coordinator_key, finish, logs, metrics, start_agents, start_coord, wait_log,
                     wait_rounds, write_config)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

ONE = [{"profile": PROFILES[2], "count": 1}]
HUGE_SEQ = 2 ** 62


def _publisher(port: int, name: str) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name)
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def _close(c: mqtt.Client) -> None:
    c.loop_stop()
    c.disconnect()


def _last_line(path: Path) -> str:
    text = path.read_text()
    assert "Traceback" not in text, text
    return [ln for ln in text.splitlines() if ln.strip() and " INFO " not in ln][-1]


def _kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _agent(tmp_path: Path, broker: str, run: str, name: str, *extra: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "cli.agent", "start", "--profile", PROFILES[2], "--broker", broker,
                             "--run", run, "--agent-id", name, "--verbose", *extra],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def _info_body() -> dict:
    return {"model": "small_cnn", "dataset": "digits", "input_shape": [1, 8, 8], "num_classes": 10,
            "splits": [2], "num_agents": 1, "partition": {"scheme": "iid", "alpha": 0.5, "seed": 0}}


# ============================================================ item 1: trust from outside the broker

def test_a_forged_retained_description_is_never_pinned(mosquitto, tmp_path):
    """A forger's signed description is retained before any agent starts. An agent without a
    key, and one asked to trust on first use over a broker that does not authenticate devices,
    both stop at once with one line and exit 2 (today's main pinned the forger's key)."""
    run = "forged"
    forger = MqttTransport(mosquitto.url, run, signer=signing.Signer.generate()).start()
    forger.publish_run_info(_info_body())
    bare = _agent(tmp_path, mosquitto.url, run, "bare")
    tofu = _agent(tmp_path, mosquitto.url, run, "tofu", "--trust-first-use", "--trust-file",
                  str(tmp_path / "trust.json"))
    try:
        assert bare.wait(timeout=60) == 2, logs(tmp_path)
        assert tofu.wait(timeout=60) == 2, logs(tmp_path)
    finally:
        _kill(bare, tofu)
        forger.close(finished=True)
    assert _last_line(tmp_path / "bare.log").startswith("no coordinator key for run 'forged': give --coordinator-key")
    assert "--trust-first-use on mqtt://127.0.0.1:" in _last_line(tmp_path / "tofu.log")
    assert "does not authenticate this device" in _last_line(tmp_path / "tofu.log")
    assert not (tmp_path / "trust.json").exists()


def test_trust_comes_from_a_key_given_or_pinned_and_first_use_needs_an_authenticated_broker(tmp_path):
    from cli.agent.run import trust_problem
    from sfl_core.transport.broker_url import parse_broker_url

    coord, forger = signing.Signer.generate(), signing.Signer.generate()
    anonymous, device = parse_broker_url("mqtt://127.0.0.1:1883"), parse_broker_url("mqtts://pi-1@broker:8883")
    assert "no coordinator key" in trust_problem(signing.Trust(), "r", anonymous)
    assert "does not authenticate" in trust_problem(signing.Trust(first_use=True), "r", anonymous)
    assert "needs --trust-file" in trust_problem(signing.Trust(first_use=True), "r", device)
    assert trust_problem(signing.Trust(trust_file=tmp_path / "t.json", first_use=True), "r", device) is None
    assert trust_problem(signing.Trust(coord.public), "r", anonymous) is None
    no_first_use = signing.Trust()
    assert "no key is trusted" in no_first_use.decide("r", forger.public)
    assert no_first_use.pinned("r") is None                                  # nothing pinned by refusing
    path = tmp_path / "trust.json"
    assert signing.Trust(trust_file=path, first_use=True).decide("r", coord.public) is None
    restarted = signing.Trust(trust_file=path)                               # a restart, no flag
    assert trust_problem(restarted, "r", anonymous) is None                  # uses its pinned key
    assert restarted.decide("r", coord.public) is None
    assert "not the trusted" in restarted.decide("r", forger.public)         # never the forged retained copy


# ============================================================ item 2: the replay bar

def test_a_lying_seq_locks_nobody_out_in_either_direction(mosquitto, tmp_path):
    """After round 1, one message with seq 2**62 on the agent's up topic (a stale evaluation) and
    one unsigned gradients with seq 2**62 on its down topic: neither passes the receiver's
    checks, so neither raises its replay bar, and every later round trains the agent. Today's
    main refused all the agent's later messages, and the agent every later assignment."""
    run, url = "seq", mosquitto.url
    config = write_config(tmp_path, run, fleet=ONE, rounds=4, local_iters=3, step_timeout_s=15)
    coord = start_coord(config, tmp_path, "--broker", url)
    agents = start_agents(url, run, tmp_path, n=1, emulate=False)
    liar = _publisher(mosquitto.port, "liar")
    try:
        wait_rounds(tmp_path, 1, coord, 120)
        up = Message("evaluation", run, "a0", {"loss": 0.0, "correct": 0, "count": 0, "compute_s": 0.0},
                     round=99, seq=HUGE_SEQ)
        down = Message("gradients", run, COORDINATOR_ID, {"g": {}}, round=99, seq=HUGE_SEQ)
        liar.publish(protocol.up_topic(run, "a0"), up.encode(), qos=1).wait_for_publish(5)
        liar.publish(protocol.down_topic(run, "a0"), down.encode(), qos=1).wait_for_publish(5)
        assert finish([coord, *agents], 180) == [0, 0], logs(tmp_path)
    finally:
        _close(liar)
        _kill(coord, *agents)
    history = metrics(tmp_path)
    assert [m["round"] for m in history[1:]] == [1, 2, 3, 4]
    assert all(m["completed"] == ["a0"] for m in history[1:]), [(m["round"], m["completed"]) for m in history]
    text = (tmp_path / "coord.log").read_text() + (tmp_path / "agent-0.log").read_text()
    assert "is older than 4611686018427387904" not in text


def test_an_assignment_replayed_on_another_agents_topic_is_refused(mosquitto, tmp_path):
    """An eavesdropper on a broker without per-topic ACLs reads both agents' signed assignments of
    round 2 and publishes the later one, whose ``seq`` passes the other agent's replay bar, on
    that agent's topic. The signature names the agent it was for, so the other agent refuses it
    with one line and trains its own; every round trains both. Before, the signature bound no
    recipient: the agent took it as its round restarted, on the other's assignment, and dropped
    out of round 2, which waited for it until its resends ran out."""
    run, url = "addressed", mosquitto.url
    config = write_config(tmp_path, run, fleet=[{"profile": PROFILES[2], "count": 2}], rounds=3, local_iters=20)
    captured: dict[str, tuple[int, bytes]] = {}    # agent -> its round-2 assignment's (seq, payload)
    both = threading.Event()

    def on_message(client, userdata, m) -> None:
        msg = protocol.decode(m.payload, run=run, allowed=protocol.COORD_TYPES)
        if msg.type == "assign" and msg.round == 2:
            captured[m.topic.rsplit("/", 1)[-1]] = (msg.seq, m.payload)
            if len(captured) == 2:
                both.set()

    eavesdropper = _publisher(mosquitto.port, "eavesdropper")
    eavesdropper.on_message = on_message
    eavesdropper.subscribe(protocol.down_topic(run, "+"), qos=1)
    coord = start_coord(config, tmp_path, "--broker", url)
    agents = start_agents(url, run, tmp_path, n=2, emulate=False)
    try:
        assert both.wait(180), logs(tmp_path)
        later = max(captured, key=lambda a: captured[a][0])
        victim = "a1" if later == "a0" else "a0"
        eavesdropper.publish(protocol.down_topic(run, victim), captured[later][1], qos=1).wait_for_publish(5)
        assert finish([coord, *agents], 180) == [0, 0, 0], logs(tmp_path)
    finally:
        _close(eavesdropper)
        _kill(coord, *agents)
    assert [sorted(m["completed"]) for m in metrics(tmp_path)[1:]] == [["a0", "a1"]] * 3
    victim_log = (tmp_path / f"agent-{victim[1]}.log").read_text()
    assert f"assign on sfl/{run}/down/{victim}: it is addressed to '{later}', not to '{victim}'; ignored" \
        in victim_log, logs(tmp_path)


def test_the_coordinator_names_only_the_agents_that_check_names(mosquitto):
    """Registered with ``addressed`` among its features, an agent is sent signed messages that
    name it; one that did not say so (an older agent, which refuses a field it does not know)
    gets them as before."""
    run = "names"
    coord = signing.Signer.generate()
    transport = MqttTransport(mosquitto.url, run, signer=coord).start()
    got: dict[str, Message] = {}
    both = threading.Event()

    def on_message(client, userdata, m) -> None:
        got[m.topic.rsplit("/", 1)[-1]] = protocol.decode(m.payload, run=run, allowed=protocol.COORD_TYPES)
        if len(got) == 2:
            both.set()

    device = _publisher(mosquitto.port, "devices")
    device.on_message = on_message
    device.subscribe(protocol.down_topic(run, "+"), qos=1)
    body = protocol.register_body(index=0, profile=load_profile(PROFILES[2]), measured={}, label_counts=[10] * 10,
                                  num_samples=100, emulate=False, resume={}, privacy={})
    try:
        for agent, features in (("newer", [signing.ADDRESSED]), ("older", [])):
            device.publish(protocol.up_topic(run, agent), Message("register", run, agent, {**body, "features": features},
                                                                  seq=protocol.next_seq()).encode(), qos=1)
            registered = transport.poll(10)
            assert registered is not None and registered.sender == agent
        transport.send_many([(a, Message("shutdown", run, COORDINATOR_ID, {"reason": "done"}, seq=protocol.next_seq()))
                             for a in ("newer", "older")])
        assert both.wait(10), got
    finally:
        _close(device)
        transport.close(finished=True)
    assert got["newer"].body["to"] == "newer" and "to" not in got["older"].body
    assert all(signing.verify(m, coord.public) for m in got.values())


# ============================================================ item 3: round deadline, busy without progress

def _slowing_profile(tmp_path: Path, name: str, compute: float) -> Path:
    """s2fl-high-high until round 2, then ``compute`` times its FLOP/s: a device slower than it
    measured at registration (emulated; the coordinator plans from the measurement)."""
    path = tmp_path / f"profile-{name}.yaml"
    path.write_text(f"name: {name}\ncompute_flops: 2e10\nlink_bytes_per_s: 5e6\nlatency_s: 0.0\n"
                    f"capacity: [{{from_round: 2, compute: {compute}, link: 1.0}}]\n")
    return path


def test_a_straggler_meets_the_round_deadline_and_a_device_busy_forever_is_dropped(mosquitto, tmp_path):
    """From round 2 on, a1 needs ~2 s a step (each step answered well within the step timeout)
    and a2 never finishes one (its heartbeats keep saying busy). The deadline (2x the predicted
    round, at least 6 s) drops a1 as late and the busy limit (3 s) drops a2; rounds 2 and 3 go
    on with a0 and record both. Today's main waited for a1 every step and for a2 forever."""
    run, url = "late", mosquitto.url
    config = write_config(tmp_path, run, rounds=3, local_iters=5, step_timeout_s=30, round_deadline=2,
                          round_deadline_min_s=6, busy_timeout_s=3)
    key = coordinator_key(tmp_path / "out")
    coord = start_coord(config, tmp_path, "--broker", url)
    profiles = [PROFILES[2], str(_slowing_profile(tmp_path, "late", 0.0007)),
                str(_slowing_profile(tmp_path, "stuck", 1e-7))]
    agents = [_agent(tmp_path, url, run, f"a{i}", "--index", str(i), "--emulate", "--coordinator-key", key,
                     "--profile", prof) for i, prof in enumerate(profiles)]
    try:
        assert coord.wait(timeout=180) == 0, logs(tmp_path)
    finally:
        _kill(coord, *agents)
    history = metrics(tmp_path)
    assert history[1]["completed"] == ["a0", "a1", "a2"], history[1]
    for m in history[2:]:
        assert m["completed"] == ["a0"], m
        assert m["stragglers"] == {"policy": "continue", "late": ["a1"], "busy": ["a2"]}, m
        assert m["wall_s"] < 25, m["wall_s"]
    text = (tmp_path / "coord.log").read_text()
    assert "dropping a1 from the round: still training at the round's deadline" in text
    assert "dropping a2 from the round: busy for 3 s without answering" in text


# ============================================================ item 4: link probes

def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_probe_flood_is_bounded_in_bytes_log_lines_and_memory(mosquitto, tmp_path):
    """50 probes of ~100 bytes asking for 4 MiB each, from one id and from 50 invented ones,
    then 2,000 malformed messages: the coordinator answers at most 16x what each probe paid
    (today: 200 MiB published), logs each kind of rejection once per sender, and its memory
    stays within 64 MiB of where it was before the flood."""
    run, url = "flood", mosquitto.url
    config = write_config(tmp_path, run, register_timeout_s=120)
    coord = start_coord(config, tmp_path, "--broker", url)
    got = {"bytes": 0, "acks": 0}
    watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watcher")

    def on_message(c, u, m) -> None:
        got["bytes"] += len(m.payload)
        got["acks"] += 1

    watcher.on_message = on_message
    watcher.connect("127.0.0.1", mosquitto.port)
    watcher.subscribe(protocol.down_topic(run, "+"), qos=1)
    watcher.loop_start()
    flooder = _publisher(mosquitto.port, "flooder")
    try:
        assert wait_log(tmp_path / "coord.log", "coordinator key", 90), logs(tmp_path)
        time.sleep(2.0)
        before = _rss_kib(coord.pid)
        for i in range(100):
            sender = "prober" if i < 50 else f"fake-{i}"
            probe = Message("probe", run, sender, {"nonce": i, "pad": b"", "reply_bytes": 4 * 2**20},
                            seq=protocol.next_seq())
            flooder.publish(protocol.up_topic(run, sender), probe.encode(), qos=1)
        for i in range(2000):
            flooder.publish(protocol.up_topic(run, "garbage"), b"\x93not msgpack" + bytes([i % 256]), qos=0)
        time.sleep(5.0)
        after = _rss_kib(coord.pid)
    finally:
        _close(flooder)
        watcher.loop_stop()
        watcher.disconnect()
        coord.send_signal(signal.SIGTERM)
        try:
            coord.wait(timeout=30)
        finally:
            _kill(coord)
    assert 0 < got["acks"] <= 100
    assert got["bytes"] <= 100 * 16 * 200, got     # at most 16x each ~100-byte probe (today: 200 MiB)
    assert after - before < 64 * 1024, (before, after)
    text = (tmp_path / "coord.log").read_text()
    assert text.count("rejected message on sfl/flood/up/garbage") == 1, text[-3000:]


# ============================================================ item 5: a coordinator that dies while agents probe it

def test_agents_outlast_a_coordinator_that_died_before_answering_their_probe(mosquitto, tmp_path):
    """A coordinator announces the run with the run's key and dies before answering any link
    probe; a second one starts 5 s later. The agents keep probing (they never exit) and train
    the run with the second. Today's main exited 1 after 30 s of silence."""
    from coordinator.api import run_info_body
    from sfl_core.config.run import load_run_config
    from sfl_core.data.builtin import load_dataset

    run, url = "probing", mosquitto.url
    config = write_config(tmp_path, run, rounds=2, local_iters=4)
    signer = signing.Signer.load_or_create(tmp_path / "out" / signing.KEY_FILE)
    dying = MqttTransport(url, run, signer=signer).start()
    dying._answer_probe = lambda msg: None                       # it dies before answering any
    dying.publish_run_info(run_info_body(load_run_config(config), load_dataset("digits")))
    agents = start_agents(url, run, tmp_path, n=3, emulate=False)
    coord = None
    try:
        for i in range(3):
            assert wait_log(tmp_path / f"agent-{i}.log", "loaded shard", 90), logs(tmp_path)
        time.sleep(5.0)
        dying.close(finished=False)                                # its description stays retained
        assert all(a.poll() is None for a in agents), logs(tmp_path)
        coord = start_coord(config, tmp_path, "--broker", url)
        assert finish([coord, *agents], 180) == [0, 0, 0, 0], logs(tmp_path)
    finally:
        _kill(*agents, *([coord] if coord else []))
    assert [m["completed"] for m in metrics(tmp_path)[1:]] == [["a0", "a1", "a2"]] * 2


def test_an_agent_joining_as_the_run_finishes_waits_for_the_next_announcement(mosquitto, tmp_path):
    """An agent probes a coordinator that does not answer; the run's description is cleared,
    first by another client (a mistaken or forged clearing: the coordinator is still there) and
    then by the coordinator as its finished run closes. Each time the agent stops probing at
    once and waits for the description again: after the first the coordinator's repeat brings
    it back, after the second the next coordinator's run trains it. Before, it kept probing the
    finished run and warned every 30 s that its coordinator "may be restarting"."""
    from coordinator.api import run_info_body
    from sfl_core.config.run import load_run_config
    from sfl_core.data.builtin import load_dataset

    run, url = "latecomer", mosquitto.url
    config = write_config(tmp_path, run, fleet=[{"profile": PROFILES[0], "count": 1}], rounds=1, local_iters=4)
    signer = signing.Signer.load_or_create(tmp_path / "out" / signing.KEY_FILE)
    ending = MqttTransport(url, run, signer=signer).start()
    ending._answer_probe = lambda msg: None                      # it finishes before answering any
    ending.publish_run_info(run_info_body(load_run_config(config), load_dataset("digits")))
    agent_log = tmp_path / "agent-0.log"
    agent = start_agents(url, run, tmp_path, n=1, emulate=False)[0]
    coord = None
    try:
        assert wait_log(agent_log, "loaded shard", 90), logs(tmp_path)
        time.sleep(1.0)                                            # probing
        clearer = _publisher(mosquitto.port, "clearer")
        clearer.publish(protocol.info_topic(run), b"", qos=1, retain=True).wait_for_publish(10)
        _close(clearer)
        assert wait_log(agent_log, "ended before this agent joined it", 5), agent_log.read_text()
        deadline = time.monotonic() + 30                           # the coordinator repeats its description
        while agent_log.read_text().count("loaded shard") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert agent_log.read_text().count("loaded shard") == 2, agent_log.read_text()
        time.sleep(1.0)                                            # probing again
        ending.close(finished=True)                                # the run is over: its description cleared
        deadline = time.monotonic() + 5
        while agent_log.read_text().count("ended before this agent joined it") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        text = agent_log.read_text()
        assert text.count("ended before this agent joined it") == 2, text
        assert text.count("waiting for the coordinator's description") == 3, text
        assert agent.poll() is None, text
        coord = start_coord(config, tmp_path, "--broker", url)
        assert finish([coord, agent], 180) == [0, 0], logs(tmp_path)
    finally:
        _kill(agent, *([coord] if coord else []))
    assert [m["completed"] for m in metrics(tmp_path)[1:]] == [["a0"]]
    assert "may be restarting" not in agent_log.read_text()


# ============================================================ item 6: an agent restarted mid-round

def test_a_restarted_agent_leaves_its_old_round_at_once(mosquitto, tmp_path):
    """a1 hangs in round 2 (SIGSTOP: its connection stays open, as after a power cut the broker
    has not noticed yet) and a new a1 process starts at once: the new process's announcement
    ends the old one's membership of the round, which goes on with a0 (today's main kept the new
    process in the round and resent it gradients three times before dropping it)."""
    run, url = "restart", mosquitto.url
    config = write_config(tmp_path, run, fleet=[{"profile": PROFILES[0], "count": 2}], rounds=5, local_iters=30,
                          step_timeout_s=60)
    coord = start_coord(config, tmp_path, "--broker", url)
    agents = start_agents(url, run, tmp_path, n=2)
    again = None
    try:
        wait_rounds(tmp_path, 1, coord, 150)
        time.sleep(1.0)                                             # inside round 2
        agents[1].send_signal(signal.SIGSTOP)                       # gone, but its socket is not closed
        again = start_agents(url, run, tmp_path, n=2, only=[1])[0]  # a1 again (agent-1.log rewritten)
        assert finish([coord, agents[0], again], 200) == [0, 0, 0], logs(tmp_path)
    finally:
        _kill(coord, *agents, *([again] if again else []))
    history = metrics(tmp_path)
    assert history[2]["completed"] == ["a0"], history[2]
    assert history[2]["wall_s"] < history[1]["wall_s"] + 20, (history[1]["wall_s"], history[2]["wall_s"])
    assert history[-1]["completed"] == ["a0", "a1"], [m["completed"] for m in history]   # back, once started
    text = (tmp_path / "coord.log").read_text()
    assert "dropping a1 from the round: restarted (process" in text, text[-3000:]
    assert "resending" not in text


# ============================================================ item 7: the smaller ones

def test_the_dashboard_refusals_name_its_own_flags(tmp_path):
    from typer.testing import CliRunner

    from cli.coord import app

    (tmp_path / "run").mkdir()
    res = CliRunner().invoke(app, ["dashboard", str(tmp_path / "run"), "--listen", "0.0.0.0:0"],
                             env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "(--token or SFL_DASHBOARD_TOKEN)" in res.output, res.output
    res = CliRunner().invoke(app, ["dashboard", str(tmp_path / "run"), "--listen", "0.0.0.0:0", "--token", "t"],
                             env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "(--tls-cert and --tls-key), or with --insecure " in res.output, res.output
    assert "--web-tls" not in res.output and "--insecure-web" not in res.output
    res = CliRunner().invoke(app, ["dashboard", str(tmp_path / "run"), "--tls-cert", "c.pem"], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "--tls-cert and --tls-key go together" in res.output, res.output


def test_an_agent_whose_weights_are_refused_has_not_completed_the_round(tmp_path):
    """docs/protocol.md's `weights`: NaN weights are refused, left out of the average, and the
    agent is not among the round's completed (the document said it was; the code never did)."""
    import torch

    from simulation.clock import VirtualClock
    from coordinator.engine import RoundEngine
    from simulation.inprocess import build_fleet
    from sfl_core.config.run import run_config_from_dict
    from sfl_core.data.builtin import load_dataset
    from sfl_core.wire import codec as wire

    cfg = run_config_from_dict({
        "run": "nan", "model": "small_cnn", "data": {"dataset": "digits"},
        "fleet": [{"profile": "s2fl-high-high", "count": 3}], "rounds": 2, "strategy": "sfl", "split": 2,
        "batch_size": 8, "local_iters": 2, "output_dir": str(tmp_path / "out")})
    data = load_dataset("digits")
    fleet = build_fleet(cfg, data)
    poll = fleet.poll

    def poisoned(timeout: float):
        msg = poll(timeout)
        if msg is not None and msg.type == "weights" and msg.sender == "sim-001" and msg.round == 1:
            state = {k: torch.full(tuple(v["shape"]), float("nan")) for k, v in msg.body["weights"].items()}
            msg.body["weights"] = wire.encode_state(state)
        return msg

    fleet.poll = poisoned
    engine = RoundEngine(cfg, fleet, VirtualClock(), (data.x_test, data.y_test), input_shape=data.input_shape,
                         num_classes=data.num_classes, out_dir=tmp_path / "out")
    history = engine.run()
    assert history[1]["completed"] == ["sim-000", "sim-002"], history[1]["completed"]
    assert history[1]["rejected"] == {"invalid": 1}, history[1]["rejected"]
    assert history[2]["completed"] == ["sim-000", "sim-001", "sim-002"]
    assert all(torch.isfinite(v).all() for v in engine.model.state_dict().values() if v.is_floating_point())
