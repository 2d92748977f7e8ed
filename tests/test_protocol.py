"""Protocol layer: every message type's schema, run/type filtering, ids and sequence numbers."""

from __future__ import annotations

import threading

import pytest
import torch

from sfl_core.wire import protocol
from sfl_core.wire import codec as wire
from sfl_core.wire.protocol import Message
from sfl_core.wire.codec import WireError

RUN = "run-1"

_T = wire.encode_tensor(torch.ones(2, 3))
VALID_BODIES = {
    "register": {"index": 0, "profile": {"name": "pi4", "compute_flops": 1e9}, "measured": {},
                 "label_counts": [1, 2, 3], "num_samples": 6, "emulate": False, "resume": {}},
    "probe": {"nonce": 7, "pad": b"\0" * 16, "reply_bytes": 32},
    "activations": {"x": _T, "y": wire.encode_tensor(torch.tensor([1, 0])), "compute_s": 0.5},
    "weights": {"weights": wire.encode_state({"w": torch.zeros(2)}), "num_samples": 10,
                "compute_s": 1, "loss": 2.3},
    "heartbeat": {"state": "idle"},
    "status": {"online": True, "instance": "0123abcd"},
    "accepted": {"message": "welcome"},
    "reject": {"reason": "full"},
    "probe_ack": {"nonce": 7, "pad": b"\1" * 32},
    "assign": {"model": "small_cnn", "strategy": "sfl", "split": 2, "width": 0, "batch_size": 16,
               "lr": 0.05, "momentum": 0.0, "tau": 3, "codec": "fp16", "zstd_level": 3,
               "activation_shape": [32, 4, 4], "weights": {}},
    "gradients": {"g": _T},
    "logits": {"z": _T},
    "logit_grads": {"g": _T, "loss": 2.1, "compute_s": 0.5},
    "shutdown": {"reason": "done"},
    "run_info": {"model": "small_cnn", "dataset": "digits", "input_shape": [1, 8, 8], "num_classes": 10,
                 "splits": [1, 2, 3], "partition": {"kind": "iid"}, "num_agents": 4,
                 "coordinator": {"key": b"k" * 32, "instance": "c0ffee"}, "sig": b"s" * 64},
    "coordinator_status": {"online": True, "instance": "c0ffee"},
    "evaluate": {"model": "small_cnn", "weights": {}, "bottlenecks": []},
    "evaluation": {"loss": 0.7, "correct": 8, "count": 10, "compute_s": 0.01},
    "round_model": {"weights": wire.encode_state({"w": torch.zeros(2)})},
    "norm_pass": {"model": "small_cnn", "split": 2, "width": 0, "weights": {}, "batches": 5, "batch_size": 16,
                  "codec": "fp32", "zstd_level": 1, "activation_shape": [32, 4, 4]},
    "norm_sums": {"moments": {}, "counts": {}, "x": _T, "compute_s": 0.01},
}

# for each type, one value of the wrong type per field
_WRONG = {int: "1", float: "x", str: 5, dict: [1], list: {"a": 1}, bytes: "text", bool: 1}


def test_bodies_cover_every_schema():
    assert set(VALID_BODIES) == set(protocol.SCHEMAS)
    assert protocol.AGENT_TYPES | protocol.COORD_TYPES | protocol.PEER_TYPES == set(protocol.SCHEMAS)
    assert not protocol.AGENT_TYPES & protocol.COORD_TYPES


@pytest.mark.parametrize("mtype", sorted(protocol.SCHEMAS))
def test_round_trip_every_type(mtype):
    msg = Message(type=mtype, run=RUN, sender="agent-1", body=VALID_BODIES[mtype], round=3, step=2, seq=99)
    payload = msg.encode()
    out = protocol.decode(payload, run=RUN)
    assert (out.type, out.run, out.sender, out.round, out.step, out.seq) == (mtype, RUN, "agent-1", 3, 2, 99)
    assert out.body == msg.body
    assert out.wire_bytes == len(payload)


@pytest.mark.parametrize("mtype", sorted(protocol.SCHEMAS))
def test_missing_field_named(mtype):
    for key in protocol.SCHEMAS[mtype]:
        body = {k: v for k, v in VALID_BODIES[mtype].items() if k != key}
        with pytest.raises(WireError, match=rf"{mtype}: missing field\(s\) \['{key}'\]"):
            protocol.decode(Message(mtype, RUN, "a", body).encode(), run=RUN)


@pytest.mark.parametrize("mtype", sorted(protocol.SCHEMAS))
def test_extra_field_named(mtype):
    body = {**VALID_BODIES[mtype], "sneaky": 1}
    with pytest.raises(WireError, match=rf"{mtype}: unexpected field\(s\) \['sneaky'\]"):
        protocol.decode(Message(mtype, RUN, "a", body).encode(), run=RUN)


@pytest.mark.parametrize("mtype", sorted(protocol.SCHEMAS))
def test_ill_typed_field_named(mtype):
    for key, typ in protocol.SCHEMAS[mtype].items():
        first = typ[0] if isinstance(typ, tuple) else typ
        body = {**VALID_BODIES[mtype], key: _WRONG[first]}
        with pytest.raises(WireError, match=rf"{mtype}\.{key}: expected"):
            protocol.decode(Message(mtype, RUN, "a", body).encode(), run=RUN)


def test_bool_rejected_for_numbers_and_numbers_for_bool():
    body = {**VALID_BODIES["assign"], "batch_size": True}
    with pytest.raises(WireError, match="assign.batch_size: expected .* got bool"):
        protocol.decode(Message("assign", RUN, "c", body).encode(), run=RUN)
    body = {**VALID_BODIES["assign"], "lr": False}
    with pytest.raises(WireError, match="assign.lr"):
        protocol.decode(Message("assign", RUN, "c", body).encode(), run=RUN)
    with pytest.raises(WireError, match="status.online"):
        protocol.decode(Message("status", RUN, "a", {"online": 1, "instance": "i"}).encode(), run=RUN)


def test_int_accepted_where_number_expected():
    body = {**VALID_BODIES["assign"], "lr": 1, "momentum": 0}
    assert protocol.decode(Message("assign", RUN, "c", body).encode(), run=RUN).body["lr"] == 1


def test_unknown_type_rejected():
    with pytest.raises(WireError, match="unknown message type 'hello'"):
        protocol.decode(Message("hello", RUN, "a", {}).encode(), run=RUN)


def test_wrong_run_rejected():
    payload = Message("heartbeat", "other-run", "a", {"state": "x"}).encode()
    with pytest.raises(WireError, match="for run 'other-run'"):
        protocol.decode(payload, run=RUN)


def test_allowed_filter():
    payload = Message("assign", RUN, "c", VALID_BODIES["assign"]).encode()
    assert protocol.decode(payload, run=RUN, allowed=protocol.COORD_TYPES).type == "assign"
    with pytest.raises(WireError, match="'assign' not accepted here"):
        protocol.decode(payload, run=RUN, allowed=protocol.AGENT_TYPES)


@pytest.mark.parametrize("field", ["round", "step", "seq"])
def test_negative_counters_rejected(field):
    msg = Message("heartbeat", RUN, "a", {"state": "x"})
    setattr(msg, field, -1)
    with pytest.raises(WireError, match="negative"):
        protocol.decode(msg.encode(), run=RUN)


def test_envelope_errors_surface_through_decode():
    with pytest.raises(WireError, match="msgpack"):
        protocol.decode(b"\xc1garbage", run=RUN)
    with pytest.raises(WireError, match="exceeds the limit"):
        protocol.decode(Message("heartbeat", RUN, "a", {"state": "x" * 500}).encode(), run=RUN, max_bytes=100)


# ------------------------------------------------------------------ ids and topics


@pytest.mark.parametrize("value", ["a", "agent-01", "A_b-9", "x" * 64])
def test_check_id_accepts(value):
    assert protocol.check_id("agent id", value) == value


@pytest.mark.parametrize("value", ["", "a/b", "a+", "#", "x" * 65, "a b", "agent\n", "é", None, 5])
def test_check_id_rejects(value):
    with pytest.raises(ValueError, match="agent id"):
        protocol.check_id("agent id", value)


def test_topics():
    assert protocol.up_topic("r", "a1") == "sfl/r/up/a1"
    assert protocol.down_topic("r", "a1") == "sfl/r/down/a1"
    assert protocol.status_topic("r", "a1") == "sfl/r/status/a1"
    assert protocol.info_topic("r") == "sfl/r/info"
    assert protocol.up_wildcard("r") == "sfl/r/up/+"
    assert protocol.status_wildcard("r") == "sfl/r/status/+"
    assert protocol.agent_from_topic(protocol.up_topic("r", "a1")) == "a1"


def test_an_agents_training_messages_go_beneath_its_topic_to_the_server_worker_its_assignment_names():
    assert protocol.up_topic("r", "a1", 2) == "sfl/r/up/a1/w2"
    assert protocol.worker_wildcard("r", 2) == "sfl/r/up/+/w2"
    for mtype in ("activations", "logit_grads"):
        assert protocol.up_topic_for("r", "a1", mtype, 2) == "sfl/r/up/a1/w2"
        assert protocol.up_topic_for("r", "a1", mtype, 0) == "sfl/r/up/a1"
    for mtype in ("register", "probe", "weights", "heartbeat", "evaluation", "norm_sums"):
        assert protocol.up_topic_for("r", "a1", mtype, 2) == "sfl/r/up/a1"   # the leader's
    assert protocol.agent_from_topic("sfl/r/up/a1/w2") == "a1"
    assert [protocol.worker_from_topic(t) for t in ("sfl/r/up/a1", "sfl/r/up/a1/w2", "sfl/r/up/a1/w10")] == [0, 2, 10]
    for odd in ("sfl/r/up/a1/w0", "sfl/r/up/a1/x2", "sfl/r/up/a1/w", "sfl/r/up/a1/w2/x", "sfl/r/up/a1/w-1"):
        assert protocol.worker_from_topic(odd) == -1, odd


# ------------------------------------------------------------------ sequence numbers


def test_sequencer_strictly_increasing_across_restart():
    # A burst from the first "process", then an immediate restart: the new sender's
    # numbers must still be higher, or a peer would take them for retransmissions.
    for _ in range(3):
        first = protocol.Sequencer()
        seqs = [first.next() for _ in range(20_000)]
        assert all(b > a for a, b in zip(seqs, seqs[1:]))
        second = protocol.Sequencer()
        assert second.next() > seqs[-1]


def test_sequencer_explicit_start_is_a_counter():
    s = protocol.Sequencer(start=10)
    assert [s.next() for _ in range(3)] == [10, 11, 12]


def test_sequencer_thread_safe():
    s = protocol.Sequencer()
    out: list[int] = []
    lock = threading.Lock()

    def work():
        got = [s.next() for _ in range(2000)]
        with lock:
            out.extend(got)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 8000


def test_sequence_numbers_fit_msgpack_int64():
    seq = protocol.Sequencer().next()
    assert 0 < seq < 2**63
    msg = Message("heartbeat", RUN, "a", {"state": "x"}, seq=seq)
    assert protocol.decode(msg.encode(), run=RUN).seq == seq


def test_profile_body():
    class P:
        name, compute_flops, link_bytes_per_s, downlink_bytes_per_s, latency_s = "pi", 5e9, 1e6, 2e6, 0.01

    body = protocol.profile_body(P())
    assert body == {"name": "pi", "compute_flops": 5e9, "link_bytes_per_s": 1e6,
                    "downlink_bytes_per_s": 2e6, "latency_s": 0.01}
    assert all(isinstance(v, float) for k, v in body.items() if k != "name")


def test_activations_may_withhold_labels():
    body = {**VALID_BODIES["activations"], "y": None}
    assert protocol.decode(Message("activations", RUN, "a", body).encode(), run=RUN).body["y"] is None


@pytest.mark.parametrize("mtype,key,value", [
    ("weights", "num_samples", -1), ("weights", "compute_s", float("inf")), ("weights", "loss", float("-inf")),
    ("weights", "compute_s", float("nan")), ("activations", "compute_s", -0.5), ("register", "index", -3),
    ("register", "label_counts", [1, -2, 3]), ("evaluation", "count", -1), ("probe", "reply_bytes", -1),
    ("assign", "batch_size", 0), ("assign", "lr", float("nan")), ("run_info", "num_classes", 0),
])
def test_a_number_out_of_its_range_is_refused_and_named(mtype, key, value):
    """A device's (or a forger's) numbers are bounded at decode, before anything uses them."""
    body = {**VALID_BODIES[mtype], key: value}
    with pytest.raises(WireError, match=rf"{mtype}\.{key}: "):
        protocol.decode(Message(mtype, RUN, "a", body).encode(), run=RUN)


def test_relations_between_fields_and_a_loss_that_is_not_there():
    bad = {**VALID_BODIES["evaluation"], "correct": 11, "count": 10}
    with pytest.raises(WireError, match="evaluation: correct exceeds count"):
        protocol.decode(Message("evaluation", RUN, "a", bad).encode(), run=RUN)
    # a split agent's weights carry no local loss: NaN says so, and is accepted
    none = {**VALID_BODIES["weights"], "loss": float("nan")}
    assert protocol.decode(Message("weights", RUN, "a", none).encode(), run=RUN).body["num_samples"] == 10
