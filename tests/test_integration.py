"""End-to-end runs: real coordinator and agent processes over a real MQTT broker, and the simulation.

Each multi-process test starts `sfl-coord serve` and several `sfl-agent start` processes
exactly as a user would (via `python -m`), on the offline 'digits' data set.
"""

from __future__ import annotations

import json
import signal
import time

import paho.mqtt.client as mqtt
import pytest

from sfl_core.wire import protocol
from sfl_core.wire import codec as wire
from sfl_core.wire.protocol import Message

from conftest import free_port, wait_port
from helpers import PROFILES, REPO, finish, logs, metrics, start_agents, start_coord, write_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

def test_multiprocess_mosquitto(mosquitto, tmp_path):
    """Coordinator + 3 agent processes over Mosquitto: 2 rounds, accuracy rises, bytes accounted, clean exit."""
    config = write_config(tmp_path, "mp")
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "mp", tmp_path)
    codes = finish([coord, *agents], timeout=180)
    assert codes == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    assert [r["round"] for r in m] == [0, 1, 2]
    assert m[2]["accuracy"] > m[0]["accuracy"] + 0.2, m
    for r in m[1:]:
        assert r["clock"] == "wall" and len(r["completed"]) == 3
        for a in r["agents"].values():
            assert a["bytes_up"] > 0 and a["bytes_down"] > 0 and a["compute_s"] > 0
        assert r["bytes_up"] == sum(a["bytes_up"] for a in r["agents"].values())
    # activations of 10 steps x 16 samples x (32*4*4 fp32) dominate the uplink, after zstd
    assert m[1]["bytes_up"] > 3 * 10 * 16 * 32 * 4 * 4 * 4 * 0.3
    assert (tmp_path / "out" / "checkpoint.pt").exists()
    # one engine: the same config simulated (in-process agents, virtual clock) trains the same
    # model, round by round, as the deployment did over Mosquitto with agent processes
    from simulation import run_simulation
    from sfl_core.config.run import load_run_config
    import dataclasses
    cfg = dataclasses.replace(load_run_config(config), output_dir=str(tmp_path / "sim"))
    history, _ = run_simulation(cfg, device="cpu")
    assert [h["accuracy"] for h in history] == [r["accuracy"] for r in m]


def test_embedded_broker_and_resume(tmp_path):
    """No --broker: the coordinator starts its own broker. Then --resume continues the run."""
    port = free_port()
    url = f"mqtt://127.0.0.1:{port}"
    config = write_config(tmp_path, "emb", rounds=1)
    coord = start_coord(config, tmp_path, "--listen", f"127.0.0.1:{port}")
    assert wait_port("127.0.0.1", port, 30), logs(tmp_path)
    agents = start_agents(url, "emb", tmp_path, emulate=False)
    assert finish([coord, *agents], timeout=120) == [0, 0, 0, 0], logs(tmp_path)
    first = metrics(tmp_path)
    assert [r["round"] for r in first] == [0, 1]

    coord = start_coord(config, tmp_path, "--listen", f"127.0.0.1:{port}", "--resume", "--rounds", "2",
                        name="coord-resume")
    assert wait_port("127.0.0.1", port, 30), logs(tmp_path)
    agents = start_agents(url, "emb", tmp_path, emulate=False)
    assert finish([coord, *agents], timeout=120) == [0, 0, 0, 0], logs(tmp_path)
    second = metrics(tmp_path)
    assert [r["round"] for r in second] == [0, 1, 2]
    assert second[1] == first[1]  # round 1 kept, not redone


def test_bad_input_and_vanishing_agent(mosquitto, tmp_path):
    """Garbage, oversized, wrong-version, spoofed, unknown-agent and replayed messages are rejected with a
    logged reason; an agent killed mid-run is dropped after the timeout; the run still completes."""
    config = write_config(tmp_path, "bad", rounds=3, step_timeout_s=6)
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "bad", tmp_path)

    attacker = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="attacker")
    attacker.connect("127.0.0.1", mosquitto.port)
    attacker.loop_start()
    captured: list[bytes] = []
    attacker.on_message = lambda c, u, m: captured.append(m.payload)
    attacker.subscribe(protocol.up_topic("bad", "a0"), qos=1)
    up = protocol.up_topic("bad", "a0")

    def send(topic: str, payload: bytes) -> None:
        attacker.publish(topic, payload, qos=1).wait_for_publish(5)

    deadline = time.monotonic() + 90
    while sum(b"activations" in p for p in captured) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert captured, logs(tmp_path)
    agents[2].send_signal(signal.SIGKILL)   # vanishes mid-run (before the 64 MB message below takes seconds to send)
    send(up, b"\x00\x01garbage")                                                   # not msgpack
    send(up, b"\xc5" + b"x" * 100)                                                 # truncated msgpack
    env = wire.unpack(next(p for p in captured if b"activations" in p))
    replay = Message(env["type"], env["run"], env["sender"], env["body"], round=env["round"],
                     step=env["step"], seq=env["seq"]).encode()
    send(up, replay)                                                               # replayed activations
    send(up, wire.pack({**env, "v": 99}))                                          # wrong protocol version
    bad_shape = dict(env["body"], x=wire.encode_tensor(__import__("torch").zeros(3, 3)))
    send(up, Message("activations", "bad", "a0", bad_shape, round=env["round"], step=99, seq=1).encode())
    send(protocol.up_topic("bad", "a1"), replay)                                   # sender != topic (spoofing)
    send(protocol.up_topic("bad", "intruder"),
         Message("activations", "bad", "intruder", env["body"], round=1, seq=1).encode())  # unknown agent
    send(up, b"\x80" * (wire.MAX_MESSAGE_BYTES + 10))                              # oversized
    attacker.loop_stop()
    attacker.disconnect()

    codes = finish([coord, agents[0], agents[1]], timeout=150)
    assert codes == [0, 0, 0], logs(tmp_path)
    text = (tmp_path / "coord.log").read_text()
    for reason in ("not a msgpack message", "rejected activations from a0: seq", "protocol version 99",
                   "does not match the topic's agent", "rejected activations from unknown agent intruder", "dropping a2"):
        assert reason in text, f"missing log line with {reason!r}\n{text[-4000:]}"
    m = metrics(tmp_path)
    assert m[-1]["round"] == 3 and "a2" not in m[-1]["completed"]
    assert len(m[-1]["completed"]) == 2
    rejected: dict[str, int] = {}
    for row in m[1:]:
        for reason, n in row["rejected"].items():
            rejected[reason] = rejected.get(reason, 0) + n
    # every injected message is counted under its reason (the bad-shape one is stale: step 99)
    assert rejected.get("malformed", 0) >= 2 and rejected.get("replayed", 0) >= 1, rejected
    assert rejected.get("version", 0) >= 1, rejected
    assert rejected.get("spoofed", 0) >= 1 and rejected.get("too_large", 0) >= 1, rejected
    assert rejected.get("unknown_sender", 0) >= 1, rejected


def test_simulation_virtual_clock(tmp_path):
    """`sfl-coord simulate`: the same engine in-process; virtual times follow the profiles (docs/methods/time-model.md)."""
    from simulation import run_simulation
    from sfl_core.config.run import load_run_config

    cfg_path = write_config(tmp_path, "sim", rounds=3, fleet=[{"profile": "s2fl-low-low", "count": 2},
                                                              {"profile": "s2fl-high-high", "count": 2}])
    history, engine = run_simulation(load_run_config(cfg_path), device="cpu")
    assert [r["round"] for r in history] == [0, 1, 2, 3]
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.3
    r1 = history[1]
    assert r1["clock"] == "virtual"
    times = {a: v["time_s"] for a, v in r1["agents"].items()}
    low = [t for a, t in times.items() if engine.registry.agents[a].profile.name == "s2fl-low-low"]
    high = [t for a, t in times.items() if engine.registry.agents[a].profile.name == "s2fl-high-high"]
    assert min(low) > 2 * max(high)            # 4x slower compute and 5x slower link
    assert r1["round_time_s"] == pytest.approx(max(times.values()), rel=1e-3)
    assert history[-1]["elapsed_s"] == pytest.approx(sum(r["round_time_s"] for r in history), rel=1e-3)


def test_s2fl_sliding_split_over_mosquitto(mosquitto, tmp_path):
    """S2FL over a real broker: three warm-up rounds fill the client time table with measured times,
    then agents with different emulated profiles receive different split points."""
    config = write_config(tmp_path, "s2", rounds=4, strategy="s2fl", batch_size=32, local_iters=6,
                          s2fl={"sliding": True, "balance": True, "group_size": 2, "candidates": [1, 2, 3]})
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "s2", tmp_path)
    assert finish([coord, *agents], timeout=200) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    assert [sorted({a["split"] for a in r["agents"].values()}) for r in m[1:4]] == [[1], [2], [3]]
    last = {a: v["split"] for a, v in m[4]["agents"].items()}
    assert len(set(last.values())) > 1, m[4]
    assert last["a0"] >= last["a2"], last   # the slow-link device sends the smaller activations
    state = json.loads((tmp_path / "out" / "state.json").read_text())
    entries = state["time_table"]
    for a in ("a0", "a1", "a2"):
        for s in ("1", "2", "3"):
            e = entries[a][s] if a in entries else entries["entries"][a][s]
            assert e["estimated"] is False and e["seconds"] > 0
    assert sorted(len(g) for g in m[4]["groups"]) == [1, 2]


def test_hetero_bottleneck_widths_over_mosquitto(mosquitto, tmp_path):
    """HeteroSFL over a real broker: agents measure their (emulated) links; the slow-link agent
    receives a narrower bottleneck than the fast one and sends fewer bytes."""
    config = write_config(tmp_path, "het", rounds=3, split=2, hetero={"width": 16, "groups": 2})
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "het", tmp_path)
    assert finish([coord, *agents], timeout=180) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    last = m[-1]["agents"]
    assert last["a0"]["width"] < last["a2"]["width"] == 16, last
    assert last["a0"]["bytes_up"] < last["a2"]["bytes_up"]
    assert m[-1]["accuracy"] > m[0]["accuracy"] + 0.1  # it learns (the engine tests check how well)


def test_mergesfl_regulated_batches_over_mosquitto(mosquitto, tmp_path):
    """MergeSFL batch regulation over a real broker: estimates come from measured wall-clock
    times of emulated devices; the slow device gets a smaller batch than the fast one."""
    config = write_config(tmp_path, "merge", rounds=2, split=2, mergesfl={"regulate": True, "max_batch": 32})
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "merge", tmp_path)
    assert finish([coord, *agents], timeout=180) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    last = m[-1]["agents"]
    assert last["a0"]["batch_size"] < last["a2"]["batch_size"] == 32, last
    assert last["a0"]["lr"] < last["a2"]["lr"]
    state = json.loads((tmp_path / "out" / "state.json").read_text())
    assert set(state["merge_states"]["agents"]) == {"a0", "a1", "a2"}
    assert all(mu > 0 and beta > 0 and fixed > 0 for mu, beta, fixed in state["merge_states"]["agents"].values())


def test_labels_withheld_over_mosquitto(mosquitto, tmp_path):
    """MergeSFL's labels-withheld mode over a real broker: one agent never sends labels; the
    coordinator returns its rows' logits, the agent scores them, the run learns."""
    config = write_config(tmp_path, "wh", rounds=2, split=2)
    coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
    agents = start_agents(mosquitto.url, "wh", tmp_path, emulate=False, extra={1: ["--withhold-labels"]})
    assert finish([coord, *agents], timeout=180) == [0, 0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    flags = {a: v["labels_withheld"] for a, v in m[-1]["agents"].items()}
    assert flags == {"a0": False, "a1": True, "a2": False}
    assert m[-1]["accuracy"] > m[0]["accuracy"] + 0.2
