"""AgentCore driven by hand, the way the coordinator drives it, on a real data shard.

A tiny in-test "coordinator" holds the global small_cnn, sends assignments with real
client-portion weights and answers each activations message with the gradient computed
by a real server portion (:class:`coordinator.server_trainer.ServerTrainer`). Every
message crosses the real wire codec in both directions.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from coordinator.server_trainer import ServerTrainer
from edge_agent.agent import AgentCore, LocalData
from sfl_core.wire import protocol
from sfl_core.wire import codec as wire
from sfl_core.data.builtin import load_dataset
from sfl_core.privacy import AgentPrivacy
from sfl_core.wire.protocol import Message
from sfl_core.wire.codec import WireError

from agent_harness import (ACT_SHAPE, AGENT, MODEL, RUN, Coordinator, make_agent, client_weights, run_round,
                           same_weights, send, through_wire)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


# ------------------------------------------------------------------ split training


def test_split_round_reply_types_and_steps(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    sent = coord.assign(0, tau=3, batch=16)
    (r,) = send(agent, sent)
    assert (r.type, r.round, r.step, r.sender, r.run) == ("activations", 0, 0, AGENT, RUN)
    x = wire.decode_tensor(r.body["x"])
    assert tuple(x.shape) == (16, *ACT_SHAPE[2])
    seqs = [r.seq]
    for k in range(3):
        (r,) = send(agent, coord.gradients(r))
        seqs.append(r.seq)
        if k < 2:
            assert (r.type, r.round, r.step) == ("activations", 0, k + 1)
    assert (r.type, r.round, r.step) == ("weights", 0, 2)
    assert r.body["num_samples"] == 300
    assert r.body["compute_s"] > 0
    assert set(r.body["weights"]) == set(coord.model.client_keys(2))
    assert all(b > a for a, b in zip(seqs, seqs[1:]))
    assert agent.rounds_done == 1
    # the uploaded weights are the trained ones, not the ones we sent
    sent_w = wire.decode_state(sent.body["weights"], coord.model.client_state(2))
    got_w = wire.decode_state(r.body["weights"], coord.model.client_state(2))
    assert not same_weights(sent_w, got_w)


def test_fp16_codec_activations(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    (r,) = send(agent, coord.assign(0, tau=2, codec="fp16"))
    assert r.body["x"]["dtype"] == "float16"
    (r,) = send(agent, coord.gradients(r))
    assert r.type == "activations" and r.step == 1


def test_duplicate_gradient_not_applied_twice(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    (a0,) = send(agent, coord.assign(0, tau=3))
    g0 = coord.gradients(a0)
    (a1,) = send(agent, g0)
    before = client_weights(agent)
    dup = send(agent, g0)
    assert [m.seq for m in dup] == [a1.seq] and dup[0].type == "activations" and dup[0].step == 1
    assert dup[0].body == a1.body  # the very same message re-sent, not a new forward pass
    assert same_weights(before, client_weights(agent))
    # finish the round, then duplicate the last gradient: weights re-sent, not retrained
    (a2,) = send(agent, coord.gradients(a1))
    g2 = coord.gradients(a2)
    (w,) = send(agent, g2)
    after = client_weights(agent)
    (w_again,) = send(agent, g2)
    assert w_again.type == "weights" and w_again.seq == w.seq
    assert same_weights(after, client_weights(agent))
    assert agent.rounds_done == 1


def test_duplicates_do_not_change_uploaded_weights(digits):
    """Black-box version: a run with every gradient delivered twice uploads bit-identical
    weights to a run without duplicates."""
    outs = []
    for duplicate in (False, True):
        agent, coord = make_agent(digits, seed=3), Coordinator(digits, seed=5)
        (r,) = send(agent, coord.assign(0, tau=4))
        while r.type == "activations":
            g = coord.gradients(r)
            (r,) = send(agent, g)
            if duplicate:
                (again,) = send(agent, g)
                assert again.seq == r.seq
        outs.append(wire.decode_state(r.body["weights"], coord.model.client_state(2)))
    assert same_weights(outs[0], outs[1])


def test_duplicate_assign_resends_last_reply(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    assign = coord.assign(0, tau=4)
    (a0,) = send(agent, assign)
    (a1,) = send(agent, coord.gradients(a0))
    before = client_weights(agent)
    dup = send(agent, assign)  # same seq: a retransmission
    assert [m.seq for m in dup] == [a1.seq] and dup[0].step == 1
    assert same_weights(before, client_weights(agent))
    # training goes on from where it was
    (a2,) = send(agent, coord.gradients(a1))
    assert (a2.type, a2.step) == ("activations", 2)


def test_stale_assign_for_older_round_resends(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    old = coord.assign(0, tau=1)
    w0 = run_round(agent, coord, 0, tau=1)  # noqa: F841
    (a,) = send(agent, coord.assign(1, tau=2))
    before = client_weights(agent)
    dup = send(agent, old)
    assert [m.seq for m in dup] == [a.seq]
    assert same_weights(before, client_weights(agent))


def test_same_round_new_seq_restarts_round(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    (a0,) = send(agent, coord.assign(0, tau=3))
    send(agent, coord.gradients(a0))
    (r,) = send(agent, coord.assign(0, tau=3))  # coordinator restarted the round
    assert (r.type, r.step) == ("activations", 0)


def test_wrong_shape_gradient_rejected_weights_unchanged(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    (a0,) = send(agent, coord.assign(0, tau=2, batch=16))
    before = client_weights(agent)
    for bad in (torch.ones(17, *ACT_SHAPE[2]), torch.ones(16, 32, 4, 5), torch.ones(16, 32 * 16)):
        msg = through_wire(Message("gradients", RUN, "coordinator", {"g": wire.encode_tensor(bad)}, round=0, step=0, seq=99))
        with pytest.raises(WireError, match="does not match"):
            agent.handle(msg)
        assert same_weights(before, client_weights(agent))
    nan = torch.full((16, *ACT_SHAPE[2]), float("nan"))
    with pytest.raises(WireError, match="NaN"):
        agent.handle(through_wire(Message("gradients", RUN, "coordinator", {"g": wire.encode_tensor(nan)}, round=0, step=0)))
    with pytest.raises(WireError, match="not allowed here"):
        agent.handle(through_wire(Message("gradients", RUN, "coordinator",
                                   {"g": wire.encode_tensor(torch.ones(16, *ACT_SHAPE[2], dtype=torch.int64))},
                                   round=0, step=0)))
    assert same_weights(before, client_weights(agent))
    # a gradient from the future is an error, not silently applied
    with pytest.raises(WireError, match="step 1"):
        agent.handle(through_wire(Message("gradients", RUN, "coordinator",
                                   {"g": wire.encode_tensor(torch.ones(16, *ACT_SHAPE[2]))}, round=0, step=1)))
    # the round is still intact: the right gradient is accepted
    (a1,) = send(agent, coord.gradients(a0))
    assert (a1.type, a1.step) == ("activations", 1)
    assert not same_weights(before, client_weights(agent))


def test_gradient_without_assignment(digits):
    agent = make_agent(digits)
    g = through_wire(Message("gradients", RUN, "coordinator", {"g": wire.encode_tensor(torch.ones(2, 2))}, round=0))
    with pytest.raises(WireError, match="without an assignment"):
        agent.handle(g)


def test_bad_assignments_rejected(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    good = coord.assign(0)
    bad_weights = dict(good.body, weights={k: v for k, v in list(good.body["weights"].items())[1:]})
    with pytest.raises(WireError, match="missing"):
        agent.handle(Message("assign", RUN, "coordinator", bad_weights, round=0, seq=50))
    with pytest.raises(WireError, match="assign.tau"):
        agent.handle(Message("assign", RUN, "coordinator", dict(good.body, tau=0), round=0, seq=51))
    with pytest.raises(WireError, match="fedavg"):
        agent.handle(Message("assign", RUN, "coordinator", dict(good.body, strategy="fedavg"), round=0, seq=52))
    assert agent.last_reply() is None and agent.rounds_done == 0


def test_other_message_types_ignored(digits):
    agent = make_agent(digits)
    assert agent.handle(Message("accepted", RUN, "coordinator", {"message": "hi"})) == []
    assert agent.last_reply() is None


# ------------------------------------------------------------------ fedavg


def test_fedavg_returns_weights_after_tau_steps_and_loss_decreases(digits):
    agent, coord = make_agent(digits, n=400), Coordinator(digits, split=4)
    losses = []
    for rnd in range(4):
        (w,) = send(agent, coord.assign(rnd, tau=8, batch=32, strategy="fedavg", lr=0.1, momentum=0.9))
        assert (w.type, w.round, w.step) == ("weights", rnd, 7)
        assert set(w.body["weights"]) == set(coord.model.state_dict())
        assert math.isfinite(w.body["loss"]) and w.body["compute_s"] > 0
        coord.take_weights(w)
        losses.append(w.body["loss"])
    assert agent.rounds_done == 4
    assert min(losses[-2:]) < losses[0] * 0.75, losses
    assert coord.accuracy(digits) > 0.4  # chance is 0.1


# ------------------------------------------------------------------ real learning


def test_split_training_with_real_server_reduces_loss(digits):
    agent, coord = make_agent(digits, n=600), Coordinator(digits, split=2, lr=0.1, momentum=0.9)
    acc0 = coord.accuracy(digits)
    for rnd in range(3):  # 3 rounds x 10 steps = 30 steps, weights returned every round
        w = run_round(agent, coord, rnd, tau=10, batch=32, lr=0.1, momentum=0.9)
        assert (w.round, w.step) == (rnd, 9)
    assert len(coord.losses) == 30
    first, last = sum(coord.losses[:5]) / 5, sum(coord.losses[-5:]) / 5
    assert last < 0.6 * first, coord.losses
    assert coord.accuracy(digits) > max(0.5, acc0 + 0.3)  # the agent's uploads are part of it


def test_withheld_labels_agent_scores_logits_and_never_sends_labels(digits):
    data = LocalData(digits.x_train[:300], digits.y_train[:300], digits.num_classes)
    agent = AgentCore(AGENT, RUN, data, digits.input_shape, seed=0, privacy=AgentPrivacy(withhold_labels=True))
    coord = Coordinator(digits)
    (act,) = agent.handle(coord.assign(1, tau=2))
    assert act.body["y"] is None
    z = torch.randn(16, digits.num_classes)
    logits = through_wire(Message("logits", RUN, protocol.COORDINATOR_ID, {"z": wire.encode_tensor(z)},
                           round=1, step=0, seq=coord.seq.next()))
    (reply,) = agent.handle(logits)
    assert reply.type == "logit_grads" and reply.step == 0
    # the gradient of the agent's mean cross-entropy on the labels it kept
    zz = z.clone().requires_grad_(True)
    loss = F.cross_entropy(zz, agent._y)
    loss.backward()
    torch.testing.assert_close(wire.decode_tensor(reply.body["g"]), zz.grad)
    assert reply.body["loss"] == pytest.approx(loss.item())
    # the same logits again (our reply was lost): the same reply, nothing recomputed
    assert agent.handle(logits) == [reply]
    # logits of the wrong shape are refused before use
    fresh = AgentCore(AGENT, RUN, data, digits.input_shape, seed=0, privacy=AgentPrivacy(withhold_labels=True))
    fresh.handle(coord.assign(2, tau=2))
    bad = through_wire(Message("logits", RUN, protocol.COORDINATOR_ID, {"z": wire.encode_tensor(torch.zeros(3, 10))},
                        round=2, step=0, seq=coord.seq.next()))
    with pytest.raises(WireError, match="shape"):
        fresh.handle(bad)
