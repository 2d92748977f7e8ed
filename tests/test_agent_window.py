"""Steps in flight on the agent (the assignment's ``window``), driven by hand on a real shard.

Pinned: how many steps go out ahead and never more (the staleness bound); that each step's
gradient is exact for the weights that step was computed with and lands on the live ones
(checked against a plain hand-written loop); gradients applied in step order whatever their
arrival order; resends after a lost message; lock-step where the agent's defenses need it;
and that window 1 puts nothing new on the wire.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.func import functional_call

from edge_agent.agent import BatchSampler
from sfl_core.data.builtin import load_dataset
from sfl_core.privacy import AgentPrivacy
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.assignment import Assignment
from sfl_core.wire.codec import WireError

from agent_harness import ACT_SHAPE, MODEL, Coordinator, client_weights, make_agent, same_weights, send


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def assign(coord: Coordinator, rnd: int, *, tau: int, window: int, batch: int = 16, lr: float = 0.05):
    """An assignment with ``window`` steps in flight (the harness's, plus the window)."""
    msg = coord.assign(rnd, tau=tau, batch=batch, lr=lr)
    if window > 1:
        msg.body["window"] = window
    return msg


def steps_of(replies) -> list[tuple[str, int]]:
    return [(m.type, m.step) for m in replies]


def test_window_one_puts_nothing_new_on_the_wire():
    a = Assignment(model=MODEL, mode="sfl", split=2, width=0, batch_size=16, lr=0.05, momentum=0.0, tau=3,
                   codec="fp32", zstd_level=1, activation_shape=ACT_SHAPE[2])
    assert "window" not in a.to_body({})
    assert Assignment.from_body(a.to_body({})).window == 1
    assert Assignment.from_body({**a.to_body({}), "window": 4}).window == 4
    for bad in (0, 17):
        with pytest.raises(WireError, match="assign.window"):
            Assignment.from_body({**a.to_body({}), "window": bad})


def test_the_leaders_agents_see_no_server_worker_on_the_wire():
    a = Assignment(model=MODEL, mode="sfl", split=2, width=0, batch_size=16, lr=0.05, momentum=0.0, tau=3,
                   codec="fp32", zstd_level=1, activation_shape=ACT_SHAPE[2])
    assert "server_worker" not in a.to_body({})
    assert Assignment.from_body(a.to_body({})).server_worker == 0
    routed = dataclasses.replace(a, server_worker=3)
    assert routed.to_body({})["server_worker"] == 3 and Assignment.from_body(routed.to_body({})) == routed
    with pytest.raises(WireError, match="assign.server_worker"):
        Assignment.from_body({**a.to_body({}), "server_worker": 1024})
    with pytest.raises(WireError):   # the schema's range check, before the assignment's own
        protocol.validate_body("assign", {**a.to_body({}), "server_worker": -1})


def test_the_agent_keeps_the_window_in_flight_and_never_more(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    replies = send(agent, assign(coord, 0, tau=6, window=3))
    assert steps_of(replies) == [("activations", 0), ("activations", 1), ("activations", 2)]
    pending = list(replies)
    seen = []
    while pending:
        act = pending.pop(0)
        out = send(agent, coord.gradients(act))
        seen.append((act.step, steps_of(out)))
        pending += [m for m in out if m.type == "activations"]
        in_flight = len(pending)
        assert in_flight <= 3
    assert seen == [(0, [("activations", 3)]), (1, [("activations", 4)]), (2, [("activations", 5)]),
                    (3, []), (4, []), (5, [("weights", 5)])]


def test_a_window_past_the_steps_sends_every_step_at_once(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    assert steps_of(send(agent, assign(coord, 0, tau=2, window=8))) == [("activations", 0), ("activations", 1)]
    assert agent.window == 2    # the steps there are: what its round line says


def test_each_gradient_is_exact_for_the_weights_its_step_was_computed_with(digits):
    """A plain loop by hand: step j is computed with the weights after step j - window's update
    (what was live when it went out) and its gradient is applied to the live weights."""
    window, tau, batch, lr = 2, 4, 16, 0.05
    agent, coord = make_agent(digits), Coordinator(digits)
    start = copy.deepcopy(coord.model.client(2))
    replies = send(agent, assign(coord, 0, tau=tau, window=window, batch=batch, lr=lr))
    acts, grads = {m.step: m for m in replies}, {}
    order = [0, 1]
    while order:
        k = order.pop(0)
        g = coord.gradients(acts[k])
        grads[k] = wire.decode_tensor(g.body["g"])
        for m in send(agent, g):
            if m.type == "activations":
                acts[m.step] = m
                order.append(m.step)
    # the same steps by hand
    data = digits.x_train[:300]
    sampler = BatchSampler(300, 0)
    xs = [data[sampler.next(batch)] for _ in range(tau)]
    live = {n: p.detach().clone() for n, p in start.named_parameters()}
    used = {}
    for j in range(tau):
        if j >= window:   # step j - window's gradient came back before step j went out
            i = j - window
            out = functional_call(start, used[i], (xs[i],))
            g_w = torch.autograd.grad(out, list(used[i].values()), grads[i])
            live = {n: w - lr * gw for (n, w), gw in zip(live.items(), g_w)}
        used[j] = {n: w.clone().requires_grad_(True) for n, w in live.items()}
        sent = wire.decode_tensor(acts[j].body["x"])
        assert torch.allclose(sent, functional_call(start, used[j], (xs[j],)), atol=1e-5), j
    for i in range(tau - window, tau):
        out = functional_call(start, used[i], (xs[i],))
        g_w = torch.autograd.grad(out, list(used[i].values()), grads[i])
        live = {n: w - lr * gw for (n, w), gw in zip(live.items(), g_w)}
    got = dict(agent._client.named_parameters())   # noqa: SLF001 (white-box check)
    assert all(torch.allclose(got[n], live[n], atol=1e-5) for n in live)


def test_gradients_arriving_out_of_order_are_applied_in_step_order(digits):
    ordered, shuffled = make_agent(digits), make_agent(digits)
    c1, c2 = Coordinator(digits), Coordinator(digits)
    r1 = send(ordered, assign(c1, 0, tau=3, window=3))
    r2 = send(shuffled, assign(c2, 0, tau=3, window=3))
    g1 = [c1.gradients(m) for m in r1]
    g2 = [c2.gradients(m) for m in r2]
    assert steps_of(send(ordered, g1[0]) + send(ordered, g1[1]) + send(ordered, g1[2])) == [("weights", 2)]
    assert send(shuffled, g2[2]) == [] and send(shuffled, g2[1]) == []
    assert send(shuffled, g2[1]) == []   # a resent copy of one it holds
    assert steps_of(send(shuffled, g2[0])) == [("weights", 2)]
    assert same_weights(client_weights(ordered), client_weights(shuffled))


def test_a_gradient_beyond_the_window_is_refused(digits):
    agent, coord = make_agent(digits), Coordinator(digits)
    replies = send(agent, assign(coord, 0, tau=6, window=2))
    g = coord.gradients(replies[1])
    g.step = 4
    with pytest.raises(WireError, match="expected 0"):
        agent.handle(g)


def test_a_duplicate_gradient_resends_every_step_in_flight(digits):
    """The coordinator resends its unanswered gradients when the agent says it is idle: an
    applied one is answered with the steps still in flight (one of them may be what was lost),
    never applied again. Each goes under a new seq, above every one sent so far: the coordinator
    may hold the later steps, and the lost one's own seq would read as a replay there."""
    agent, coord = make_agent(digits), Coordinator(digits)
    a0, a1 = send(agent, assign(coord, 0, tau=5, window=2))
    g0 = coord.gradients(a0)
    (a2,) = send(agent, g0)
    before = client_weights(agent)
    again = send(agent, g0)
    assert [m.step for m in again] == [1, 2]
    assert a2.seq < again[0].seq < again[1].seq
    assert again[0].body == a1.body and again[1].body == a2.body
    assert same_weights(before, client_weights(agent))


def test_defenses_that_need_the_step_just_sent_keep_lock_step(digits):
    agent, coord = make_agent(digits, privacy=AgentPrivacy(withhold_labels=True)), Coordinator(digits)
    assert steps_of(send(agent, assign(coord, 0, tau=4, window=4))) == [("activations", 0)]
    assert agent.window == 1    # what its round line and status file then say


def test_the_devices_round_line_and_status_name_its_window():
    """What an operator reads on the device: the window of the round just done, where over 1; a
    status file of an earlier release (no window) or edited by hand still reads, in one line."""
    from edge_agent.status import RoundSummary, describe

    done = dict(round=3, split=2, batch=16, steps=12, loss=None, bytes_up=2_000_000, bytes_down=3_000_000, seconds=4.2)
    assert RoundSummary(**done, window=4).line().startswith("round 3 done: split 2, batch 16, window 4, 12 steps,")
    assert RoundSummary(**done).line().startswith("round 3 done: split 2, batch 16, 12 steps,")
    doc = {"agent": "a0", "run": "r", "pid": 1, "state": "stopped", "rounds_done": 3, "updated": 0.0}
    assert describe({**doc, "last_round": done}, now=1.0)[2].startswith("last round 3 done: split 2, batch 16, 12 steps")
    odd = describe({**doc, "last_round": {**done, "cut": 2}}, now=1.0)
    assert odd[2] == "last round: not readable (batch, bytes_down, bytes_up, cut, loss, round, seconds, split, steps)"
