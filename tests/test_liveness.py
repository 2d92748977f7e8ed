"""Liveness that scales with the fleet (sfl_core.liveness): idle agents beat at an interval the
run description announces, agents in a round every 2 s, and the coordinator's notion of
"online" waits for the missed idle beats, not for the step timeout."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from coordinator.api import run_info_body
from coordinator.registry import Registry
from coordinator.session import FleetSession
from coordinator.transport import LocalTransport
from edge_agent.outbox import Outbox
from edge_agent.runner import AgentOptions, AgentRunner
from sfl_core import liveness
from sfl_core.config.run import load_profile, run_config_from_dict
from sfl_core.data.builtin import load_dataset
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.protocol import Message


def test_the_idle_interval_grows_with_the_fleet_within_bounds():
    assert liveness.idle_heartbeat_s(4) == liveness.BUSY_HEARTBEAT_S == 2.0       # small fleets: as before
    assert liveness.idle_heartbeat_s(100) == 2.0
    assert liveness.idle_heartbeat_s(2_000) == pytest.approx(40.0)               # 2,000 / 50 beats/s
    assert liveness.idle_heartbeat_s(10_000) == liveness.MAX_IDLE_HEARTBEAT_S == 120.0
    # the whole idle fleet sends the budget of 50 beats a second, 83 at 10,000 (the interval's cap)
    assert 2_000 / liveness.idle_heartbeat_s(2_000) == pytest.approx(liveness.IDLE_BEATS_PER_S)
    assert 10_000 / liveness.idle_heartbeat_s(10_000) == pytest.approx(83.3, abs=0.1)
    assert liveness.stale_after_s(60.0, 2.0) == 60.0          # the step timeout where beats are frequent
    assert liveness.stale_after_s(60.0, 120.0) == 360.0       # three missed idle beats otherwise


@pytest.mark.parametrize("announced, expected", [(40, 40.0), (40.5, 40.5), (0.5, 2.0), (1e9, 120.0),
                                                 (None, 2.0), ("40", 2.0), (True, 2.0), (float("nan"), 2.0),
                                                 (float("inf"), 2.0)])
def test_an_agent_takes_the_announced_interval_only_when_it_is_a_sane_number(announced, expected):
    assert liveness.agreed_idle_s(announced, 2.0) == expected


def test_beats_are_due_every_tick_in_a_round_and_once_an_idle_interval_otherwise():
    due = liveness.due
    # computing, or heard from the coordinator within the idle interval: every check
    assert due(now=100.0, last_sent=99.0, last_work=-1e9, busy=True, busy_s=2.0, idle_s=40.0)
    assert due(now=100.0, last_sent=99.0, last_work=70.0, busy=False, busy_s=2.0, idle_s=40.0)
    # idle: not before the interval (less half a tick) has passed since the last beat
    assert not due(now=100.0, last_sent=70.0, last_work=10.0, busy=False, busy_s=2.0, idle_s=40.0)
    assert due(now=109.0, last_sent=70.0, last_work=10.0, busy=False, busy_s=2.0, idle_s=40.0)


def test_any_message_to_the_coordinator_stands_for_a_beat():
    """An agent that sent activations within half a tick skips the beat (the coordinator heard
    from it anyway); at the next tick, 1.5 ticks at most after its message, it beats again."""
    due = liveness.due
    assert not due(now=100.0, last_sent=99.5, last_work=99.0, busy=True, busy_s=2.0, idle_s=40.0)
    assert not due(now=100.0, last_sent=99.5, last_work=99.0, busy=False, busy_s=2.0, idle_s=40.0)
    assert due(now=100.0, last_sent=99.0, last_work=99.0, busy=False, busy_s=2.0, idle_s=40.0)
    assert due(now=102.0, last_sent=99.5, last_work=99.0, busy=False, busy_s=2.0, idle_s=40.0)
    # between rounds a recent message postpones the idle beat by as much
    assert not due(now=130.0, last_sent=100.0, last_work=10.0, busy=False, busy_s=2.0, idle_s=40.0)


def test_the_run_description_announces_the_interval_and_passes_validation(tmp_path):
    cfg = run_config_from_dict({"run": "lv", "model": "small_cnn", "data": {"dataset": "digits"},
                                "fleet": [{"profile": "s2fl-low-low", "count": 2_000}], "per_round": 10,
                                "output_dir": str(tmp_path / "out")})
    body = run_info_body(cfg, load_dataset("digits"))
    assert body["heartbeat_idle_s"] == pytest.approx(40.0)
    small = run_config_from_dict({"run": "lv", "model": "small_cnn", "data": {"dataset": "digits"},
                                  "fleet": [{"profile": "s2fl-low-low", "count": 100}],
                                  "output_dir": str(tmp_path / "out")})
    assert "heartbeat_idle_s" not in run_info_body(small, load_dataset("digits"))   # as earlier releases read it
    body["coordinator"], body["sig"] = {"key": bytes(32), "instance": "x"}, b"s"
    msg = Message("run_info", "lv", protocol.COORDINATOR_ID, body, seq=1)
    assert protocol.decode(msg.encode(), run="lv").body["heartbeat_idle_s"] == pytest.approx(40.0)
    bad = Message("run_info", "lv", protocol.COORDINATOR_ID, {**body, "heartbeat_idle_s": "soon"}, seq=2)
    with pytest.raises(Exception, match="heartbeat_idle_s"):
        protocol.decode(bad.encode(), run="lv")


def _session(tmp_path: Path, fleet: int, clock: list[float]) -> tuple[FleetSession, Registry]:
    cfg = run_config_from_dict({"run": "lv", "model": "small_cnn", "data": {"dataset": "digits"},
                                "fleet": [{"profile": "s2fl-low-low", "count": fleet}], "step_timeout_s": 60,
                                "output_dir": str(tmp_path / "out")})

    class Quiet(LocalTransport):
        def send(self, a, m):
            return 0
    reg = Registry(10, now=lambda: clock[0])
    session = FleetSession(cfg, Quiet(), reg, virtual=False, now=lambda: clock[0], on_event=lambda *a: None,
                           on_drop=lambda a: None)
    for i, agent in enumerate(("pi-1", "pi-2")):
        session.dispatch(Message("status", "lv", agent, {"online": True, "instance": f"i{i}"},
                                 seq=protocol.next_seq()), None)
        body = protocol.register_body(index=i, profile=load_profile("s2fl-low-low"), measured={},
                                      label_counts=[1] * 10, num_samples=10, emulate=False, resume={}, privacy={})
        session.dispatch(Message("register", "lv", agent, body, seq=protocol.next_seq()), None)
    return session, reg


def test_an_idle_agent_of_a_big_fleet_stays_online_between_its_beats(tmp_path):
    clock = [0.0]
    session, reg = _session(tmp_path, 10_000, clock)
    assert session.online() == ["pi-1", "pi-2"]
    clock[0] = 300.0                       # 2.5 idle intervals of 120 s without a word: still there
    assert session.online() == ["pi-1", "pi-2"]
    reg.seen("pi-1")                       # pi-1 beats; pi-2 stays silent past three intervals
    clock[0] = 361.0
    assert session.online() == ["pi-1"]


def test_a_small_fleet_still_takes_silence_past_the_step_timeout_for_absence(tmp_path):
    clock = [0.0]
    session, _ = _session(tmp_path, 10, clock)
    clock[0] = 59.0
    assert session.online() == ["pi-1", "pi-2"]
    clock[0] = 61.0
    assert session.online() == []


class _Link:
    """Records when each heartbeat was published (and counts the other messages)."""

    def __init__(self):
        self.beats: list[float] = []
        self.others = 0

    def publish(self, topic, payload, **kw):
        if wire.unpack(payload)["type"] == "heartbeat":
            self.beats.append(time.monotonic())
        else:
            self.others += 1
        return True


def _runner(heartbeat_s: float, idle_s: float) -> AgentRunner:
    """The agent's own heartbeat loop and publishing (edge_agent.runner), on a recording link."""
    runner = AgentRunner.__new__(AgentRunner)
    runner.o = AgentOptions(broker="mqtt://127.0.0.1:1", run_id="lv", agent_id="pi-1",
                            profile=load_profile("s2fl-low-low"), heartbeat_s=heartbeat_s)
    runner._stop, runner._busy, runner.core, runner.link = threading.Event(), False, None, _Link()
    runner._last_work, runner._last_sent = float("-inf"), time.monotonic()
    runner.bytes_up, runner.emulator = 0, None
    runner.outbox = Outbox(runner._send_up, sent=runner._mark_sent)   # the agent's sending thread
    runner._run_info = Message("run_info", "lv", protocol.COORDINATOR_ID, {"heartbeat_idle_s": idle_s}, seq=1)
    return runner


def test_the_agent_beats_at_the_announced_interval_when_idle_and_every_tick_in_a_round():
    """The run description announces an idle interval of 0.5 s; the tick is 0.05 s."""
    runner = _runner(heartbeat_s=0.05, idle_s=0.5)
    beating = threading.Thread(target=runner._heartbeat, daemon=True)
    beating.start()
    try:
        time.sleep(1.6)
        idle = len(runner.link.beats)
        runner._last_work = time.monotonic()          # an assignment arrived: a round is in progress
        time.sleep(0.4)
        working = len(runner.link.beats) - idle
    finally:
        runner._stop.set()
        beating.join(5)
    assert 2 <= idle <= 4, runner.link.beats         # ~3 beats in 1.6 s at 0.5 s (31 at the tick)
    assert working >= 5, runner.link.beats           # ~8 in 0.4 s at the 0.05 s tick


def test_an_agent_answering_steps_sends_no_heartbeats_until_it_falls_silent():
    """In a round (tick 0.2 s), the agent publishes a message every 10 ms for 1 s: no beat goes
    out meanwhile; once it stops, beats resume within 1.5 ticks and then come every tick."""
    runner = _runner(heartbeat_s=0.2, idle_s=2.0)
    runner._last_work = time.monotonic() + 60          # a round in progress throughout
    beating = threading.Thread(target=runner._heartbeat, daemon=True)
    beating.start()
    try:
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            runner._publish(Message("activations", "lv", "pi-1", {}, seq=protocol.next_seq()))
            time.sleep(0.01)
        stopped = time.monotonic()
        while_sending = len(runner.link.beats)
        time.sleep(1.0)
    finally:
        runner._stop.set()
        beating.join(5)
    assert runner.link.others >= 20
    assert while_sending == 0, runner.link.beats
    after = runner.link.beats
    assert 4 <= len(after) <= 6, after                # ~5 in 1 s at the tick
    assert after[0] - stopped <= 0.3 + 0.1, after[0] - stopped   # 1.5 ticks, and scheduling slack


class _Inbox(LocalTransport):
    """Messages waiting to be taken, and what the session sent (one entry per send_many call)."""

    def __init__(self, messages: list[Message], fail_bursts: bool = False):
        self.inbox, self.fail_bursts = list(reversed(messages)), fail_bursts
        self.bursts: list[list[str]] = []
        self.sent: list[tuple[str, str]] = []

    def send(self, agent_id: str, msg: Message) -> int:
        self.sent.append((agent_id, msg.type))
        return 0

    def send_many(self, messages: list[tuple[str, Message]]) -> list[int]:
        if self.fail_bursts and len(messages) > 1:
            raise RuntimeError("the burst failed")
        self.bursts.append([a for a, _ in messages])
        return super().send_many(messages)

    def poll(self, timeout: float):
        return self.inbox.pop() if self.inbox else None


def _big_fleet(tmp_path: Path, n: int, messages: list[Message], fail_bursts: bool = False
               ) -> tuple[FleetSession, Registry, _Inbox]:
    cfg = run_config_from_dict({"run": "lv", "model": "small_cnn", "data": {"dataset": "digits"},
                                "fleet": [{"profile": "s2fl-low-low", "count": n}],
                                "output_dir": str(tmp_path / "out")})

    class Counting(Registry):
        counts = 0

        def online(self, stale_after_s=None):
            Counting.counts += 1
            return super().online(stale_after_s)

    reg, transport = Counting(10), _Inbox(messages, fail_bursts)
    return FleetSession(cfg, transport, reg, virtual=False, now=time.monotonic, on_event=lambda *a: None,
                        on_drop=lambda a: None), reg, transport


def _arrivals(n: int) -> list[Message]:
    """Each agent's online status and registration, as a fleet starting at once sends them."""
    out = []
    for i in range(n):
        body = protocol.register_body(index=i, profile=load_profile("s2fl-low-low"), measured={},
                                      label_counts=[1] * 10, num_samples=10, emulate=False, resume={}, privacy={})
        out += [Message("status", "lv", f"pi-{i}", {"online": True, "instance": f"i{i}"}, seq=protocol.next_seq()),
                Message("register", "lv", f"pi-{i}", body, seq=protocol.next_seq())]
    return out


def test_a_fleet_registering_at_once_is_counted_once_per_burst_not_once_per_message(tmp_path):
    """Counting who is online reads every agent: counted after each of 2 × 3,000 messages, the
    wait cost the square of the fleet (most of a 10,000-device start-up's CPU)."""
    session, reg, transport = _big_fleet(tmp_path, 3000, _arrivals(3000))
    session.wait_for_agents()
    assert len(reg.online()) == 3000 and not transport.inbox
    assert type(reg).counts <= 12, type(reg).counts        # was over 6,000
    assert transport.sent.count(("pi-2999", "accepted")) == 1


@pytest.mark.parametrize("fail_bursts", [False, True])
def test_every_agent_of_a_big_fleet_is_told_to_shut_down_once(tmp_path, fail_bursts):
    """In bursts whose acknowledgements are awaited together; where a burst cannot be sent, one
    message at a time, so no agent misses it."""
    session, reg, transport = _big_fleet(tmp_path, 2500, _arrivals(2500), fail_bursts)
    session.wait_for_agents()
    transport.sent.clear()
    session.shutdown_agents("run finished")
    told = [a for a, kind in transport.sent if kind == "shutdown"]
    assert sorted(told) == sorted(reg.agents) and len(told) == 2500
    if not fail_bursts:
        assert [len(b) for b in transport.bursts] == [1000, 1000, 500]


def test_a_loss_to_an_agent_whose_connection_came_back_is_not_blamed_on_the_broker(tmp_path, caplog):
    """An agent of the round whose own process announces itself online again mid-round (it
    reconnected) lost what was in flight with its connection: its resends are counted, but only
    the agent whose connection stayed up is named in the warning about lost messages."""
    from coordinator.session import RoundAgent
    from sfl_core.wire.assignment import Assignment

    class Broker(_Inbox):
        def loss_hint(self, in_flight: int) -> str:
            return f"the broker's queue ({in_flight} in flight)"

    session, reg, transport = _big_fleet(tmp_path, 2, _arrivals(2))
    session.wait_for_agents()
    session.transport = Broker([])
    a = Assignment(model="small_cnn", mode="sfl", split=2, width=0, batch_size=8, lr=0.1, momentum=0.0, tau=3,
                   codec="fp32", zstd_level=1, activation_shape=(32, 4, 4), window=2)
    gradients = Message("gradients", "lv", protocol.COORDINATOR_ID, {}, round=1, seq=protocol.next_seq())
    agents = {f"pi-{i}": RoundAgent(f"pi-{i}", a, last_heard=0.0, last_sent_at=0.0, instance=f"i{i}",
                                    last_sent=gradients) for i in range(2)}
    session.begin_round()
    session.dispatch(Message("status", "lv", "pi-0", {"online": True, "instance": "i0"}, seq=protocol.next_seq()),
                     agents)
    assert agents["pi-0"].reconnected and not agents["pi-1"].reconnected
    with caplog.at_level("INFO", logger="sfl.coord"):
        for ra in agents.values():
            session._send_again(ra)
        session.report_losses(1, agents)
    assert session.resent == 2
    assert [r.getMessage() for r in caplog.records if "lost on the way" in r.getMessage()] == [
        "round 1: agents whose connection stayed up waited 1 time(s) for messages lost on the way, each time 5 s "
        "idle before they went again: the broker's queue (4 in flight)"]
