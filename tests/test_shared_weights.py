"""One copy of the round's client portion for every agent that trains it
(:mod:`sfl_core.wire.shared_weights`): the coordinator's choice of what to publish, the agent's
use of a copy only by the digest its signed assignment names, and real runs over Mosquitto, one
of them on a broker whose ACL predates the copies' topic (the agents then get their weights
inline after the usual resend)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading

import pytest
import torch

from conftest import _brokers, free_port
from coordinator.broker_config import write_broker_config
from helpers import REPO, coordinator_key, finish, logs, metrics, start_agents, start_coord, write_config
from sfl_core.transport.mqtt_link import MqttLink
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol, shared_weights
from sfl_core.wire.protocol import COORDINATOR_ID, Message
from sfl_core.wire.shared_weights import Copies, Sharing

RUN = "share"
MODEL = "small_cnn:width=4"
"""Its client portion (270 KB encoded) is over MIN_BYTES: small_cnn's own (18 KB) travels inline."""


def _weights(n: int = 20_000, value: float = 0.5) -> dict:
    return wire.encode_state({"blocks.0.0.weight": torch.full((n,), value)}, 0)


def _assign(weights: dict, seq: int, split: int = 2, width: int = 0, r: int = 1) -> Message:
    body = {"model": "small_cnn", "strategy": "sfl", "split": split, "width": width, "batch_size": 8, "lr": 0.1,
            "momentum": 0.0, "tau": 2, "codec": "fp32", "zstd_level": 0, "activation_shape": [16, 28, 28],
            "weights": weights}
    return Message("assign", RUN, COORDINATOR_ID, body, round=r, seq=seq)


def _sharing(*agents: str) -> Sharing:
    s = Sharing(RUN)
    for a in agents:
        s.registered(a, {"features": [shared_weights.FEATURE]})
    return s


# ---------------------------------------------------------------- the coordinator's side

def _rounds(s: Sharing, agents: list[str], w: dict, rounds: int = 2) -> list[tuple[list, list, list]]:
    return [s.prepare([(a, _assign(w, seq=100 * r + i, r=r)) for i, a in enumerate(agents)])
            for r in range(1, rounds + 1)]


def test_one_copy_per_portion_for_the_agents_that_take_references_and_inline_for_the_others():
    s = _sharing("a0", "a1", "a2")
    s.registered("old", {})                        # an agent of an earlier release: no features
    agents = ["a0", "a1", "a2", "old"]
    w = _weights()
    (copies, first, fallen), _ = _rounds(s, agents, w)
    assert fallen == [] and len(copies) == 1
    topic, payload = copies[0]
    assert topic == protocol.model_topic(RUN, 2, 0) == "sfl/share/model/2-0"
    ref = {"topic": topic, "sha256": hashlib.sha256(payload).digest()}
    # the first assignment naming the topic still carries the weights: the agent subscribes now
    assert all(m.body["weights"] is w and m.body["shared_weights"] == ref for _, m in first[:3])
    assert "shared_weights" not in first[3][1].body and first[3][1].body["weights"] is w   # the older agent
    w2 = _weights(value=0.75)                      # the next round's portion
    msgs = [(a, _assign(w2, seq=300 + i, r=3)) for i, a in enumerate(agents)]
    copies, out, _ = s.prepare(msgs)
    assert len(copies) == 1 and copies[0][0] == topic
    for (agent, sent), (_, original) in zip(out[:3], msgs):
        assert sent.body["weights"] == {} and sent is not original
        assert sent.body["shared_weights"] == {"topic": topic, "sha256": hashlib.sha256(copies[0][1]).digest()}
        assert original.body["weights"] is w2      # a resend starts again from the engine's message
    assert out[3][1] is msgs[3][1]                 # the older agent's copy travels inline
    # the same portion again (a resend of another agent's, a late joiner): not published again
    assert s.prepare([("a0", _assign(w2, seq=400, r=3))])[0] == []


def test_a_resent_assignment_carries_the_weights_from_then_on():
    s = _sharing("a0")
    w = _weights()
    assert s.prepare([("a0", _assign(w, seq=5))])[1][0][1].body["weights"] is w
    second = _assign(w, seq=6, r=2)
    assert s.prepare([("a0", second)])[1][0][1].body["weights"] == {}
    copies, out, fallen = s.prepare([("a0", second)])   # the coordinator's resend: the agent did not fetch it
    assert fallen == ["a0"] and out[0][1] is second and copies == []
    third = s.prepare([("a0", _assign(w, seq=7, r=3))])[1][0][1]
    assert third.body["weights"] is w and "shared_weights" not in third.body


def test_an_agent_that_registers_again_gets_the_weights_with_its_next_assignment():
    s = _sharing("a0")
    w = _weights()
    _rounds(s, ["a0"], w)                          # subscribed, and sent a reference without weights
    s.registered("a0", {"features": [shared_weights.FEATURE]})   # a new process: subscribed nowhere
    sent = s.prepare([("a0", _assign(w, seq=900, r=3))])[1][0][1]
    assert sent.body["weights"] is w and "shared_weights" in sent.body


def test_small_portions_and_a_second_portion_for_one_cut_travel_inline():
    s = _sharing("a0", "a1")
    small = _weights(n=4000)                       # 16 KB, as small_cnn's portion: a copy would not pay
    _, out, _ = s.prepare([("a0", _assign(small, seq=1))])
    assert out[0][1].body["weights"] is small
    w, other = _weights(), _weights(value=0.25)    # an option that sends one agent its own portion
    copies, out, _ = s.prepare([("a0", _assign(w, seq=2)), ("a1", _assign(other, seq=3))])
    assert len(copies) == 1 and "shared_weights" in out[0][1].body
    assert out[1][1].body["weights"] is other and "shared_weights" not in out[1][1].body


# ---------------------------------------------------------------- the agent's side

def _referenced() -> tuple[Message, bytes]:
    """A second round's assignment (weights {}, a reference) and the copy it names."""
    s = _sharing("a0")
    (copies, _, _), (_, out, _) = _rounds(s, ["a0"], _weights())
    return out[0][1], copies[0][1]


def test_an_assignment_waits_for_its_copy_and_goes_on_with_it():
    assign, payload = _referenced()
    c = Copies(RUN)
    assert c.resolve(assign) is None
    ready = c.received(payload)
    assert ready is not None and ready.seq == assign.seq and "shared_weights" not in ready.body
    state = wire.decode_state(ready.body["weights"], {"blocks.0.0.weight": torch.zeros(20_000)})
    assert torch.equal(state["blocks.0.0.weight"], torch.full((20_000,), 0.5))
    assert ready.wire_bytes == assign.wire_bytes + len(payload)
    assert c.resolve(assign) is not None          # kept: a duplicate assignment goes on at once


def test_a_copy_that_is_not_the_one_named_is_not_used():
    assign, payload = _referenced()
    c = Copies(RUN)
    assert c.resolve(assign) is None
    forged = shared_weights.round_model(RUN, _weights(value=9.0))   # anyone could publish on the topic
    assert c.received(forged) is None and c.resolve(assign) is None
    with pytest.raises(wire.WireError):
        c.received(Message("round_model", RUN, "a1", {"weights": _weights()}).encode())
    assert c.received(payload) is not None


def test_a_reference_to_another_cuts_topic_or_beside_weights_is_refused():
    assign, _ = _referenced()
    for change in ({"shared_weights": {"topic": protocol.model_topic(RUN, 3, 0), "sha256": bytes(32)}},
                   {"shared_weights": {"topic": protocol.model_topic("other", 2, 0), "sha256": bytes(32)}},
                   {"shared_weights": {"topic": protocol.model_topic(RUN, 2, 0), "sha256": b"short"}},
                   {"shared_weights": {"topic": protocol.model_topic(RUN, 2, 0)}}):
        bad = Message("assign", RUN, COORDINATOR_ID, {**assign.body, **change}, round=1, seq=8)
        with pytest.raises(wire.WireError):
            Copies(RUN).resolve(bad)


def test_an_assignment_with_its_weights_and_a_reference_goes_on_at_once():
    assign, _ = _referenced()
    first = Message("assign", RUN, COORDINATOR_ID, {**assign.body, "weights": _weights()}, round=1, seq=3)
    ready = Copies(RUN).resolve(first)
    assert ready is not None and "shared_weights" not in ready.body and ready.body["weights"] == first.body["weights"]


def test_weights_sent_inline_after_all_end_the_wait():
    assign, payload = _referenced()
    c = Copies(RUN)
    assert c.resolve(assign) is None
    inline = _assign(_weights(), seq=assign.seq, r=assign.round)
    assert c.resolve(inline) is inline
    assert c.received(payload) is None             # nothing waits any more


# ---------------------------------------------------------------- over Mosquitto

class _Watch:
    """A bare subscriber that keeps the run's copies and assignments as they pass."""

    def __init__(self, url: str):
        self.copies: list[tuple[str, bytes]] = []
        self.assigns: list[Message] = []
        self._reassembler = wire.Reassembler()
        self._lock = threading.Lock()
        self.link = MqttLink(url, "test-watch", self._on, subscriptions=[protocol.model_wildcard(RUN),
                                                                         f"sfl/{RUN}/down/+"])
        self.link.connect()

    def _on(self, topic: str, payload: bytes) -> None:
        whole = self._reassembler.feed(topic, payload) if payload else None
        if whole is None:
            return
        with self._lock:
            if "/model/" in topic:
                self.copies.append((topic, whole))
            else:
                msg = protocol.decode(whole, run=RUN)
                if msg.type == "assign":
                    self.assigns.append(msg)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_over_mosquitto_sends_each_rounds_portion_once(mosquitto, tmp_path):
    watch = _Watch(mosquitto.url)
    try:
        config = write_config(tmp_path, RUN, rounds=3, local_iters=6, model=MODEL)
        coord = start_coord(config, tmp_path, "--broker", mosquitto.url)
        agents = start_agents(mosquitto.url, RUN, tmp_path)
        assert finish([coord, *agents], timeout=240) == [0, 0, 0, 0], logs(tmp_path)
    finally:
        watch.link.close()
    m = metrics(tmp_path)
    assert [r["completed"] for r in m[1:]] == [["a0", "a1", "a2"]] * 3 and all(not r["rejected"] for r in m[1:])
    assert m[-1]["accuracy"] > m[0]["accuracy"] + 0.2, m
    digests = [hashlib.sha256(p).digest() for _, p in watch.copies]
    assert len(watch.copies) == 3 and {t for t, _ in watch.copies} == {protocol.model_topic(RUN, 2, 0)}
    assert sorted(a.round for a in watch.assigns) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    for a in watch.assigns:
        assert a.body["shared_weights"]["sha256"] == digests[a.round - 1]
        if a.round == 1:   # the first names the topic and still carries the weights
            assert a.body["weights"]
        else:              # later rounds' copy came on the subscription
            assert a.body["weights"] == {} and a.wire_bytes < len(watch.copies[0][1]) / 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_agents_a_broker_keeps_from_the_copies_get_their_weights_inline(tmp_path):
    """A broker whose ACL was written before the copies' topic existed: the agents' subscription
    is refused, they wait idle, the coordinator resends their assignment with the weights."""
    binary = _brokers.find_mosquitto()
    if binary is None:
        pytest.skip("needs mosquitto")
    port = free_port()
    files = write_broker_config(tmp_path / "broker", ["a0", "a1"], port=port, bind="127.0.0.1")
    acl = files.acl.read_text()
    files.acl.write_text("\n".join(line for line in acl.splitlines() if "/model/" not in line) + "\n")
    conf = files.conf.read_text() + ("user root\n" if os.geteuid() == 0 else "")
    broker = _brokers.MosquittoBroker(binary, port=port, config=conf)
    broker.start()
    try:
        url = f"mqtt://{{user}}@127.0.0.1:{port}"
        config = write_config(tmp_path, RUN, rounds=2, local_iters=4, model=MODEL,
                              fleet=[{"profile": "s2fl-high-high", "count": 2}])
        cred = files.credentials
        coord = start_coord(config, tmp_path, "--broker", url.format(user="coordinator"),
                            "--password-file", str(cred["coordinator"]))
        agents = []
        for i, user in enumerate(["a0", "a1"]):
            log = open(tmp_path / f"agent-{i}.log", "w")
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "cli.agent", "start", "--profile", "s2fl-high-high", "--broker",
                 url.format(user=user), "--password-file", str(cred[user]), "--run", RUN, "--index", str(i),
                 "--verbose", "--coordinator-key", coordinator_key(tmp_path / "out")],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        assert finish([coord, *agents], timeout=240) == [0, 0, 0], logs(tmp_path)
    finally:
        broker.close()
    m = metrics(tmp_path)
    assert [r["completed"] for r in m[1:]] == [["a0", "a1"]] * 2, m
    text = (tmp_path / "coord.log").read_text()
    for a in ("a0", "a1"):
        assert f"{a} was sent its assignment again: its assignments carry their client portion from now on " \
               f"(if it cannot read sfl/{RUN}/model/, let it" in text, logs(tmp_path)
