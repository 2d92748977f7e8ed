"""Fuzzing every input the coordinator and the agent read off the network.

Three levels:
1. bytes -> the coordinator's and the agent's MQTT message handlers (random bytes, chunk-like
   headers, schema-valid envelopes with random field values, bit-flipped / truncated real
   messages) on every topic each side subscribes to: never an exception, every message
   either accepted in a validated form or rejected under a reason, bounded memory;
2. schema-valid but hostile messages -> the agent's state machine mid-round: a rejected
   message leaves the client model untouched;
3. a whole simulated run with hostile traffic interleaved (replays of real agents'
   earlier messages, messages from unknown senders): the trained model is bit-for-bit the
   one of the undisturbed run with the same seed, and every injected message is counted.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgpack
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.engine import RoundEngine
from coordinator.transport import LocalTransport
from simulation.inprocess import build_fleet
from simulation.clock import VirtualClock
from coordinator.mqtt_transport import MqttTransport
from edge_agent.agent import AgentCore, LocalData
from edge_agent.runner import AgentOptions, AgentRunner
from sfl_core.wire import protocol
from sfl_core.wire import codec as wire
from sfl_core.wire.assignment import Assignment
from sfl_core.config.run import load_profile, load_run_config
from sfl_core.data.builtin import load_dataset
from sfl_core.model.zoo import build_model
from sfl_core.wire.protocol import Message

RUN = "fuzz"
REASONS = {"version", "unsigned", "untrusted", "rate_limited", "unprobed", "registry_full", "malformed", "wrong_run", "spoofed", "replayed", "duplicate", "stale", "unknown_sender",
           "not_selected", "invalid", "too_large"}
FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

# ------------------------------------------------------------------ payload strategies

_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70).filter(lambda v: -2**63 <= v < 2**64),
                  st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=64))
_value = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def _tensor_map() -> st.SearchStrategy:
    """Tensor maps that are nearly right: real dtypes, small shapes, data of any length."""
    return st.fixed_dictionaries({
        "dtype": st.sampled_from(["float32", "float16", "int64", "int8", "bool", "complex64"]),
        "shape": st.lists(st.integers(-1, 40), max_size=4),
        "z": st.booleans(),
        "data": st.binary(max_size=256)})


def _envelope(types: frozenset[str]) -> st.SearchStrategy:
    """Schema-shaped envelopes: the right keys with random values (sometimes the right types)."""
    def body_for(mtype: str) -> st.SearchStrategy:
        fields = protocol.SCHEMAS[mtype]
        return st.fixed_dictionaries({k: st.one_of(_value, _tensor_map()) for k in fields})

    return st.sampled_from(sorted(types)).flatmap(lambda t: st.fixed_dictionaries({
        "v": st.sampled_from([wire.PROTOCOL_VERSION, 0, 99]), "type": st.just(t),
        "run": st.sampled_from([RUN, "other-run"]), "sender": st.sampled_from(["a0", "a1", "coordinator", "x/y"]),
        "seq": st.integers(-5, 2**63), "round": st.integers(-2, 5), "step": st.integers(-2, 5),
        "body": body_for(t)}).map(lambda env: msgpack.packb(env, use_bin_type=True)))


@st.composite
def _mutated(draw, seed_messages: list[bytes]) -> bytes:
    """Real encoded messages with bytes flipped, cut off or appended."""
    raw = bytearray(draw(st.sampled_from(seed_messages)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "append"]))
        if op == "flip" and raw:
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            raw = raw[:draw(st.integers(0, len(raw)))]
        else:
            raw += draw(st.binary(max_size=16))
    return bytes(raw)


def _chunks() -> st.SearchStrategy:
    """Chunk envelopes with random ids, counts and sizes (the reassembler's attack surface)."""
    return st.fixed_dictionaries({
        "chunk": st.sampled_from(["m1", "m2", "m3"]), "i": st.integers(-1, 4), "n": st.integers(0, 4),
        "total": st.integers(-1, 300), "data": st.binary(max_size=200)}).map(
            lambda c: msgpack.packb(c, use_bin_type=True))


def _agent_seed_messages() -> list[bytes]:
    t = wire.encode_tensor(torch.randn(4, 32, 4, 4), "fp32", 1)
    y = wire.encode_tensor(torch.arange(4), "fp32", 1)
    return [Message("activations", RUN, "a0", {"x": t, "y": y, "compute_s": 0.1}, 1, 0, 10).encode(),
            Message("heartbeat", RUN, "a0", {"state": "idle"}, 1, 0, 11).encode(),
            Message("status", RUN, "a0", {"online": True, "instance": "i0"}, 0, 0, 12).encode(),
            Message("weights", RUN, "a0", {"weights": {"w": t}, "num_samples": 3, "compute_s": 0.2, "loss": 1.0},
                    1, 0, 13).encode()]


def _coord_seed_messages() -> list[bytes]:
    g = wire.encode_tensor(torch.randn(4, 32, 4, 4), "fp32", 1)
    return [Message("gradients", RUN, "coordinator", {"g": g}, 1, 0, 10).encode(),
            Message("shutdown", RUN, "coordinator", {"reason": "done"}, 1, 0, 11).encode(),
            Message("run_info", RUN, "coordinator", {"model": "small_cnn", "dataset": "digits", "input_shape": [1, 8, 8],
                                                     "num_classes": 10, "splits": [1, 2], "partition": {},
                                                     "num_agents": 2}).encode()]


def payloads(types: frozenset[str], seeds: list[bytes]) -> st.SearchStrategy:
    return st.one_of(st.binary(max_size=512), _envelope(types), _mutated(seeds), _chunks(),
                     st.binary(max_size=64).map(lambda b: b"\x85\xa5chunk" + b))


# ------------------------------------------------------------------ level 1: handlers

@pytest.fixture(scope="module")
def coord_transport():
    t = MqttTransport("mqtt://127.0.0.1:1", RUN)  # never connected: the handler is driven directly
    t.send = lambda agent, msg: len(msg.encode())  # type: ignore[method-assign]  # probe acks go nowhere
    yield t
    t.link.close()


@FUZZ
@given(topic=st.sampled_from([f"sfl/{RUN}/up/a0", f"sfl/{RUN}/status/a0", f"sfl/{RUN}/up/a1", f"sfl/{RUN}/up/a0/w1",
                              f"sfl/{RUN}/status/x"]),
       payload=payloads(protocol.AGENT_TYPES, _agent_seed_messages()))
def test_coordinator_handler_fuzz(coord_transport, topic, payload):
    t = coord_transport
    rejected, queued = t.rejections.total, t._queue.qsize()
    t._on_message(topic, payload)                                   # must not raise
    new_rejections = t.rejections.total - rejected
    assert set(t.rejections.counts()) <= REASONS
    assert new_rejections + (t._queue.qsize() - queued) <= 1
    while not t._queue.empty():                                     # what got through is valid
        msg = t._queue.get_nowait()
        assert msg.run == RUN and msg.type in protocol.AGENT_TYPES and msg.sender == topic.rsplit("/", 1)[1]
        assert (msg.type == "status") == ("/status/" in topic)
        protocol.validate_body(msg.type, msg.body)
    assert t._reassembler.pending_bytes <= t._reassembler.max_pending_bytes


@pytest.fixture(scope="module")
def agent_runner():
    opts = AgentOptions(broker="mqtt://127.0.0.1:1", run_id=RUN, agent_id="a0",
                        profile=load_profile("s2fl-low-low"))
    runner = AgentRunner(opts)
    yield runner
    runner.link.close()


@FUZZ
@given(topic=st.sampled_from([f"sfl/{RUN}/down/a0", f"sfl/{RUN}/info"]),
       payload=payloads(protocol.COORD_TYPES, _coord_seed_messages()))
def test_agent_handler_fuzz(agent_runner, topic, payload):
    r = agent_runner
    rejected, queued = r.rejections.total, r._inbox.qsize() + r._probe_acks.qsize()
    r._on_message(topic, payload)                                   # must not raise
    assert set(r.rejections.counts()) <= REASONS
    got = r._inbox.qsize() + r._probe_acks.qsize() - queued
    assert (r.rejections.total - rejected) + got <= 1
    for q in (r._inbox, r._probe_acks):
        while not q.empty():
            msg = q.get_nowait()
            assert msg.sender == protocol.COORDINATOR_ID and msg.type in protocol.COORD_TYPES
            protocol.validate_body(msg.type, msg.body)
    if r._run_info is not None:
        assert topic.endswith("/info") or r._run_info.type == "run_info"


# ------------------------------------------------------------------ level 2: agent state machine

@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _assigned_agent(digits) -> tuple[AgentCore, Message]:
    torch.manual_seed(0)
    model = build_model("small_cnn", digits.input_shape, digits.num_classes)
    core = AgentCore("a0", RUN, LocalData(digits.x_train[:64], digits.y_train[:64], digits.num_classes),
                     digits.input_shape, seed=0)
    a = Assignment(model="small_cnn", mode="sfl", split=2, width=0, batch_size=8, lr=0.05, momentum=0.0,
                   tau=3, codec="fp32", zstd_level=1, activation_shape=(32, 4, 4))
    assign = Message("assign", RUN, "coordinator", a.to_body(wire.encode_state(model.client_state(2))),
                     round=1, seq=100)
    replies = core.handle(protocol.decode(assign.encode(), run=RUN))
    assert [m.type for m in replies] == ["activations"]
    return core, assign


def _snapshot(core: AgentCore) -> dict[str, torch.Tensor]:
    return {f"{key}.{k}": v.detach().clone() for key, m in core._models.items() for k, v in m.state_dict().items()}


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(kind=st.sampled_from(["gradients", "logits", "assign"]), rnd=st.integers(0, 3), step=st.integers(0, 3),
       shape=st.lists(st.integers(0, 9), min_size=1, max_size=4),
       dtype=st.sampled_from(["float32", "float16", "int64"]), special=st.sampled_from([None, "nan", "inf"]))
def test_agent_core_rejection_leaves_no_trace(digits, kind, rnd, step, shape, dtype, special):
    core, assign = _assigned_agent(digits)
    before = _snapshot(core)
    t = torch.randn(*shape).to(getattr(torch, dtype)) if dtype != "int64" else torch.randint(0, 9, shape)
    if special and t.is_floating_point() and t.numel():
        t.view(-1)[0] = float(special)
    enc = wire.encode_tensor(t, "fp32", 1) if dtype == "float32" else \
        {"dtype": dtype, "shape": list(t.shape), "z": False, "data": t.numpy().tobytes()}
    if kind == "assign":  # an older round's assignment, or this round's replayed
        body = {**assign.body, "activation_shape": list(shape)}
        msg = Message("assign", RUN, "coordinator", body, round=min(rnd, 1), seq=100)
    else:
        msg = Message(kind, RUN, "coordinator", {"g": enc} if kind == "gradients" else {"z": enc},
                      round=rnd, step=step, seq=101)
    valid_shape = tuple(shape) == (8, 32, 4, 4) and dtype in ("float32", "float16") and special is None
    try:
        core.handle(protocol.decode(msg.encode(), run=RUN))
    except (wire.WireError, ValueError):
        pass
    if not (kind == "gradients" and rnd == 1 and step == 0 and valid_shape):
        after = _snapshot(core)
        assert all(torch.equal(before[k], after[k]) for k in before), f"{kind} r{rnd} s{step} {shape} changed weights"


# ------------------------------------------------------------------ level 3: a whole run under attack

class HostileTransport(LocalTransport):
    """The in-process transport with hostile messages interleaved before real ones."""

    def __init__(self, inner, seed: int):
        self.inner = inner
        self.rng = random.Random(seed)
        self.seen: list[Message] = []
        self.held: list[Message] = []
        self.injected = {"replay": 0, "unknown_sender": 0}
        self.pending_kind: dict[int, str] = {}

    def send(self, agent_id: str, msg: Message) -> int:
        return self.inner.send(agent_id, msg)

    def poll(self, timeout: float):
        if self.held:
            msg = self.held.pop(0)
            kind = self.pending_kind.pop(id(msg), None)
            if kind is not None:
                self.injected[kind] += 1  # counted when the engine takes it
            else:
                self.seen.append(msg)     # a real message, delivered
            return msg
        msg = self.inner.poll(timeout)
        if msg is None:
            return None
        # up to three hostile messages before each real one
        self.held = ([self._hostile() for _ in range(self.rng.randrange(4))] if self.seen else []) + [msg]
        return self.poll(timeout)

    def _hostile(self) -> Message:
        latest = {}
        for m in self.seen:
            latest[m.sender] = max(latest.get(m.sender, -1), m.seq)
        older = [m for m in self.seen if m.seq < latest[m.sender]]
        if older and self.rng.random() < 0.5:
            kind, m = "replay", self.rng.choice(older)
        else:
            kind, m = "unknown_sender", self.rng.choice(self.seen)
            m = Message(m.type, m.run, f"mallory-{self.rng.randrange(5)}", m.body, m.round, m.step,
                        protocol.next_seq())
            if m.type == "register":  # a well-formed registration is admission, not an attack: break it
                m.body = {**m.body, "label_counts": [1]}
        out = protocol.decode(m.encode(), run=m.run, allowed=protocol.AGENT_TYPES)
        self.pending_kind[id(out)] = kind
        return out


def _run(tmp_path: Path, hostile: bool):
    cfg_path = tmp_path / "fuzz.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": RUN, "model": "small_cnn", "data": {"dataset": "digits", "partition": "iid", "seed": 0},
        "fleet": [{"profile": "s2fl-low-low", "count": 2}, {"profile": "s2fl-high-high", "count": 1}],
        "rounds": 3, "batch_size": 16, "lr": 0.05, "local_iters": 4, "seed": 3,
        "output_dir": str(tmp_path / ("hostile" if hostile else "clean"))}))
    cfg = load_run_config(cfg_path)
    data = load_dataset("digits")
    transport = build_fleet(cfg, data)
    if hostile:
        transport = HostileTransport(transport, seed=7)
    engine = RoundEngine(cfg, transport, VirtualClock(), (data.x_test, data.y_test), input_shape=data.input_shape,
                         num_classes=data.num_classes, out_dir=Path(cfg.output_dir))
    history = engine.run()
    return history, engine, transport


def test_hostile_traffic_does_not_change_the_trained_model(tmp_path):
    clean_hist, clean, _ = _run(tmp_path, hostile=False)
    hist, engine, hostile = _run(tmp_path, hostile=True)
    assert hostile.injected["replay"] > 15 and hostile.injected["unknown_sender"] > 15, hostile.injected
    assert [h["accuracy"] for h in hist] == [h["accuracy"] for h in clean_hist]
    a, b = clean.model.state_dict(), engine.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    rejected = engine.rejected_totals()
    assert rejected.get("replayed", 0) == hostile.injected["replay"], (rejected, hostile.injected)
    # a broken registration is 'invalid'; everything else from a stranger is 'unknown_sender'
    assert rejected.get("unknown_sender", 0) + rejected.get("invalid", 0) == hostile.injected["unknown_sender"], \
        (rejected, hostile.injected)
    assert sum(sum(h.get("rejected", {}).values()) for h in hist) <= sum(rejected.values())
