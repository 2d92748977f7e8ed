"""The fleet session: everything between the round engine and the agents' messages.

Registration and re-registration, liveness (status, heartbeats, silence), replay protection,
resends of lost replies, the rejected-message counts, and gathering one kind of message from
every agent of a round. The round engine (:mod:`coordinator.engine`) decides what to send and
what to do with what arrives; the session makes sure what reaches it is fresh, from an agent
of the round, and answers everything else.

Liveness uses the transport's ``live_time`` (virtual in a simulation, so a silent simulated
agent is dropped without waiting real time); so does the registration deadline of a
simulation, while a deployment's is wall time.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, Optional

from coordinator.registry import Registry
from coordinator.transport import Transport
from sfl_core import liveness
from sfl_core.rate_limit import TokenBuckets
from sfl_core.config.run import RunConfig
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.assignment import Assignment
from sfl_core.wire.protocol import Message

log = logging.getLogger("sfl.coord")

FLEET_TYPES = frozenset({"register", "probe", "heartbeat", "status"})
"""What an agent sends about itself; every other type it sends answers a round's request."""
RETRY_S = 5.0
"""Seconds after which the last message to an agent that reports itself idle is sent again."""
MAX_RESENDS = 3
"""An agent that stays idle through this many resends (it rejects what we send) is dropped."""
REGISTER_AGAIN = "not registered (forgotten while silent): register again"
"""The ``reject`` reason that asks an agent to register again (docs/protocol.md)."""
CHECK_S = 0.05
"""While a step's messages stream in, how often the agents still awaited are counted again and
checked for silence (every message makes the count cheaper, not the check)."""
SEND_BURST = 100
"""Messages :meth:`FleetSession.send_many` publishes before their acknowledgements are awaited:
one broker round trip per burst instead of per message, and at most this many encoded messages
(an assignment carries the client portion) held at once."""
_BURST = 1000
"""Messages answered in a row while waiting for agents before the wait's condition is checked
again; shutdown messages published before their acknowledgements are awaited."""

Event = Callable[[str, Dict[str, Any]], None]


class DeadlinePassed(Exception):
    """The round's deadline passed with agents still training and ``stragglers: replan``: they
    were dropped, and the round is planned again without them."""


@dataclass
class RoundAgent:
    """Book-keeping for one selected agent during a round; times are on the engine's liveness clock."""

    info_id: str
    assignment: Assignment
    last_heard: float
    last_sent_at: float
    last_sent: Optional[Message] = None
    instance: str = ""
    """The agent process that holds this round (its status's ``instance``; "" in a simulation):
    another process of the same id ends its membership (:meth:`FleetSession.dispatch`)."""
    busy_limit_s: float = 0.0
    """How long it may stay busy without answering (0: ``busy_timeout_s``); the engine raises it
    for an agent whose own step is predicted to take longer (a whole model trained on a board)."""
    bytes_up: int = 0
    bytes_down: int = 0
    labels_withheld: bool = False
    compute_s: float = 0.0
    busy_s: float = 0.0
    """Sum of this agent's own response times (our message sent -> its reply in): no waiting for others."""
    server_s: float = 0.0
    messages: int = 0
    resends: int = 0
    first_s: float = 0.0
    """Its response to the assignment (client portion down, first forward, activations up)."""
    last_s: float = 0.0
    """Its response to the last gradients (last backward, client portion up); 0 training the whole model."""
    steps: list[float] = field(default_factory=list)
    """Its response time at each step after the first (gradients sent -> next activations in):
    their spread is the jitter that lock-step waits on (:func:`sfl_core.timing.lockstep_slack_s`)."""
    step_bytes_up: int = 0
    step_bytes_down: int = 0
    """Encoded bytes of its activations and of its gradients (what a window overlaps)."""
    counted_at: float = float("-inf")
    """When the last message it owed arrived: with steps in flight a reply can come before we
    send what it answers, and its response time counts only from here (never twice)."""
    unanswered: list[Message] = field(default_factory=list)
    """With a window: the gradients sent whose steps' successors have not all arrived, resent
    together when it reports itself idle (any of them may be the one lost)."""
    reconnected: bool = False
    """Its process announced itself online again mid-round: its connection dropped, and with it
    what was in flight (a loss with a cause the operator already sees)."""

    @property
    def weights_phase_s(self) -> float:
        """The seconds of its first and last responses beyond one step: its client portion's
        download and upload as they really went (0 until a round has all three)."""
        if not (self.first_s and self.last_s and self.steps):
            return 0.0
        return max(0.0, self.first_s + self.last_s - statistics.fmean(self.steps))

    @property
    def step_jitter_s(self) -> float:
        """Sample standard deviation of :attr:`steps` (0 with fewer than two). In floats: the
        ``statistics`` module's exact arithmetic costs more than the rest of pricing an agent."""
        n = len(self.steps)
        if n < 2:
            return 0.0
        mean = math.fsum(self.steps) / n
        return math.sqrt(math.fsum((s - mean) ** 2 for s in self.steps) / (n - 1))


class FleetSession:
    def __init__(self, cfg: RunConfig, transport: Transport, registry: Registry, *, virtual: bool,
                 now: Callable[[], float], on_event: Event, on_drop: Callable[[str], None],
                 follower: bool = False):
        """``transport``: the engine's (send/poll); ``virtual``: a simulation (agents never go
        stale by silence alone); ``now``: the liveness clock; ``on_drop``: called with each
        agent dropped from a round (the server trainer forgets its rows). ``follower``: a server
        worker other than the leader (:mod:`coordinator.server_workers`): it only trains its
        shard, and leaves registration and liveness to the leader."""
        self.follower = follower
        self.cfg = cfg
        self.transport = transport
        self.registry = registry
        self.virtual = virtual
        self._now = now
        self.on_event = on_event
        self.on_drop = on_drop
        self._seqs = protocol.ReplayGuard()
        self._reg_seq: dict[str, int] = {}
        self._early: dict[str, Message] = {}
        """Weights of whole-model agents that finished while the round's split agents still trained."""
        self._ahead: dict[tuple[str, int], Message] = {}
        """(agent, step) -> activations that came in before their step is gathered: an agent with a
        window keeps that many steps in flight."""
        self.rejections = protocol.Rejections(log)
        self._rejected_before: dict[str, int] = {}
        self._pruned: dict[str, None] = {}
        self._by_index: dict[int, set[str]] = {}   # index -> agent ids that registered with it (twins)
        self._shown: tuple[float, int] = (float("-inf"), 0)   # (when, online count) for the events
        """Agents pruned from the registry (oldest first, bounded)."""
        self._gone: set[str] = set()
        """Registered agents whose own process said offline (its heartbeats do not revive it)."""
        self._present: dict[str, str] = {}
        """Agents whose last status said online (registered or not yet), oldest first, bounded."""
        self._new_ids = TokenBuckets(float(max(cfg.num_agents, cfg.min_agents or 0, 10)), cfg.register_rate_per_s)
        """New agent ids taken, all together (one bucket): ``register_rate_per_s``, burst the fleet size."""
        self.deadline: Optional[float] = None
        """When the round's training must be over, on the liveness clock (None: no deadline);
        the engine sets it from the plan (``round_deadline``)."""
        self.late: list[str] = []
        """Agents dropped at this round's deadline (reset by the engine each round)."""
        self.stalled: list[str] = []
        """Agents dropped this round for staying busy without answering (``busy_timeout_s``)."""
        self.resent = 0
        """Times this round an agent that waited for a lost message was sent it again (reset by
        :meth:`begin_round`; with a window, each time every gradient it may have lost)."""
        self._unexplained = 0
        """Of those, the ones to agents whose connection stayed up."""
        self._outages = 0
        self._loss_told = False

    def begin_round(self) -> None:
        """A new round's counts: its stragglers, its resends and the link's outages so far."""
        self.late, self.stalled = [], []
        self.resent = self._unexplained = 0
        self._outages = self.transport.outages()

    def report_losses(self, r: int, agents: dict[str, RoundAgent]) -> None:
        """Say where round ``r`` sent messages again to agents whose connection, like ours, stayed
        up: something between them dropped the originals, and every resend cost its agent
        :data:`RETRY_S` idle. The transport says what (a broker's full queue); a WARNING the first
        time in the run, INFO after."""
        if not self._unexplained or self.transport.outages() != self._outages:
            return
        hint = self.transport.loss_hint(sum(ra.assignment.window for ra in agents.values()))
        if hint:
            log.log(logging.INFO if self._loss_told else logging.WARNING,
                    "round %d: agents whose connection stayed up waited %d time(s) for messages lost on the way, "
                    "each time %g s idle before they went again: %s", r, self._unexplained, RETRY_S, hint)
            self._loss_told = True

    def wait_for_agents(self) -> None:
        need = self.cfg.min_agents or self.cfg.num_agents
        self.on_event("waiting", {"registered": len(self.registry.online()), "needed": need})
        self._serve_until(lambda: len(self.registry.online()) >= need,
                          lambda: f"only {len(self.registry.online())} of {need} agents registered within "
                                  f"{self.cfg.register_timeout_s:.0f} s")

    def _serve_until(self, done: Callable[[], bool], failure: Callable[[], str]) -> None:
        """Answer registrations and liveness messages until ``done()``; TimeoutError(``failure()``)
        after ``register_timeout_s``: of the simulation's virtual clock (a fleet that cannot
        register fails at once), of wall time in a deployment (a broker that stays down does not
        hold the coordinator forever)."""
        clock = self._now if self.virtual else time.monotonic
        deadline = clock() + self.cfg.register_timeout_s
        while not done():
            if clock() > deadline:
                raise TimeoutError(failure())
            msg, burst = self._receive(0.2), 0
            while msg is not None:     # what is waiting is answered before ``done()`` counts again:
                self.dispatch(msg, None)   # counting reads every agent, so thousands registering at
                burst += 1                 # once would cost the square of the fleet
                msg = self._receive(0.0) if burst < _BURST else None

    def wait_for_any_agent(self, r: int) -> None:
        """Mid-run, every agent gone (a network outage, a power cut on site): wait for one to come
        back rather than end the run; after ``register_timeout_s`` give up with the run
        checkpointed, so ``--resume`` continues it."""
        log.warning("no agent online before round %d: waiting up to %.0f s for one to come back", r,
                    self.cfg.register_timeout_s)
        self.on_event("waiting", {"registered": 0, "needed": 1})
        self._serve_until(lambda: bool(self.online()),
                          lambda: f"no agent online for {self.cfg.register_timeout_s:.0f} s before round {r}; "
                                  f"rounds up to {r - 1} are checkpointed: restart with --resume")


    def online(self) -> list[str]:
        # a deployed agent silent past its heartbeats (sfl_core.liveness) counts as gone even before its
        # last will arrives; simulated agents never vanish and send no heartbeats
        live = self.registry.online(stale_after_s=self._stale_after_s())
        live = [a for a in live if not a.quarantined]   # until an operator readmits it
        n = self.cfg.num_agents
        if n and len(live) > n:
            # more agents online than the fleet has devices (strangers, or a flood of fakes): the
            # ones with a measured history first, then the earliest registered
            order = {a: i for i, a in enumerate(self.registry.agents)}
            live = sorted(live, key=lambda i: (-i.rounds, order[i.agent_id]))[:n]
        return sorted(a.agent_id for a in live)

    def _online_count(self) -> int:
        """Online agents, for the operator's events: counted at most once a second (a fleet of
        thousands registering would otherwise be counted once per registration)."""
        now = time.monotonic()
        if now - self._shown[0] >= 1.0:
            self._shown = (now, len(self.registry.online()))
        return self._shown[1]

    def _stale_after_s(self) -> Optional[float]:
        """Silence after which a registered agent is no longer online: idle agents beat at the
        interval the run description announces (:func:`sfl_core.liveness.idle_heartbeat_s`)."""
        if self.virtual:
            return None
        return liveness.stale_after_s(self.cfg.step_timeout_s, liveness.idle_heartbeat_s(self.cfg.num_agents))

    def shutdown_agents(self, reason: str) -> None:
        """Tell every registered agent the run is over: in bursts of :data:`_BURST`, each burst's
        acknowledgements awaited together (one broker round trip per agent would keep a fleet of
        thousands waiting for seconds)."""
        def shutdown() -> Message:
            return Message("shutdown", self.cfg.run_id, protocol.COORDINATOR_ID, {"reason": reason},
                           seq=protocol.next_seq())

        agents = list(self.registry.agents)
        for start in range(0, len(agents), _BURST):
            burst = agents[start:start + _BURST]
            try:
                self.transport.send_many([(a, shutdown()) for a in burst])
                continue
            except Exception:   # one at a time then: an agent that cannot be told must not silence the rest
                pass
            for a in burst:
                try:
                    self.transport.send(a, shutdown())
                except Exception as exc:
                    log.warning("could not tell %s to shut down: %s", a, exc)


    def send(self, ra: RoundAgent, msg: Message) -> None:
        self.send_many([(ra, msg)])

    def send_many(self, messages: list[tuple[RoundAgent, Message]]) -> None:
        """Send each (agent, message) pair; the transport may publish them as one burst. An agent's
        response time runs from the handing over, not from the broker's acknowledgements: the
        agent is already at work while they come back."""
        now = self._now()
        sizes: list[int] = []
        for start in range(0, len(messages), SEND_BURST):
            sizes += self.transport.send_many([(ra.info_id, msg) for ra, msg in messages[start:start + SEND_BURST]])
        for (ra, msg), n in zip(messages, sizes):
            ra.bytes_down += n
            ra.messages += 1
            ra.last_sent, ra.last_sent_at = msg, now
            if msg.type == "gradients":
                ra.step_bytes_down += n
                if ra.assignment.window > 1:
                    ra.unanswered = [*ra.unanswered, msg][-ra.assignment.window:]

    def collect(self, agents: dict[str, RoundAgent], kind: str, r: int, k: int,
                only: Collection[str] | None = None) -> dict[str, Message]:
        """Gather one message of ``kind`` for (r, k) from every agent still in the round (or from
        those of them in ``only``).

        Duplicates of earlier steps mean our reply was lost: resend it. An agent silent
        for ``step_timeout_s`` (heartbeats count) is dropped and the round goes on. What is
        returned comes only from agents still in the round: one that re-registered (restarted)
        after its message arrived is out, and so is its message. A round agent outside ``only``
        that finishes early (one training the whole model, while the others exchange
        activations) has its weights kept for the round's weights collection.
        """
        expected = set(agents) if only is None else set(only)
        got: dict[str, Message] = {}
        if kind == "weights":
            got = {a: m for a, m in self._early.items() if m.round == r and a in agents and a in expected}
            self._early = {}
        elif kind == "activations":   # steps in flight: what came in ahead of this step
            self._ahead = {key: m for key, m in self._ahead.items() if m.round == r and key[0] in agents}
            got = {a: self._ahead.pop((a, k)) for a in expected if (a, k) in self._ahead}

        def still_waiting() -> set[str]:
            return {a for a in agents if a in expected and a not in got}

        # Who is still awaited is read in full at most every CHECK_S (and before returning), not
        # after each message: with n agents that made a step cost n² set lookups.
        waiting, check_at = still_waiting(), self._now() + CHECK_S
        while True:
            if not waiting:
                waiting = still_waiting()      # none left by our count: make sure (drops, restarts)
                if not waiting:
                    # in the round's agent order, not arrival order: the merged batch and the
                    # aggregation sums then do not depend on which agent answered first
                    return {a: got[a] for a in agents if a in got and a in expected}
            msg = self._receive(0.1)
            if msg is not None:
                self.registry.seen(msg.sender)
                ra = agents.get(msg.sender)
                if ra is not None:
                    ra.last_heard = self._now()
                if msg.type == "weights" and kind != "weights" and msg.sender in agents \
                        and msg.sender not in expected:
                    self._early_weights(msg, agents[msg.sender], r)
                elif msg.type not in FLEET_TYPES:   # a reply the round (or an option's phase) owes
                    self._training_message(msg, agents, kind, r, k, got)
                elif msg.type == "heartbeat" and ra is not None and msg.sender in expected and msg.sender not in got:
                    self._maybe_resend(agents, ra, msg)
                else:
                    self.dispatch(msg, agents)
                if msg.sender in got or msg.sender not in agents:
                    waiting.discard(msg.sender)
            now = self._now()
            if msg is not None and now < check_at:
                continue
            waiting, check_at = still_waiting(), now + CHECK_S
            past_deadline = self.deadline is not None and now > self.deadline
            for a in sorted(waiting):
                ra = agents.get(a)
                if ra is None:
                    continue
                # silent since we last heard from it or last asked it, whichever is later: while we
                # waited for a dead peer its reply may sit unread behind the peer's timeout
                if now - max(ra.last_heard, ra.last_sent_at) > self.cfg.step_timeout_s:
                    self.drop(agents, a, f"silent for {self.cfg.step_timeout_s:g} s")
                elif past_deadline:
                    self.drop(agents, a, "still training at the round's deadline (stragglers: "
                                         f"{self.cfg.stragglers})")
                    self.late.append(a)
                elif not self.virtual and now - ra.last_sent_at > (ra.busy_limit_s or self.cfg.busy_timeout_s):
                    # its heartbeats say busy, yet nothing it owes has come since we asked
                    self.drop(agents, a, f"busy for {ra.busy_limit_s or self.cfg.busy_timeout_s:g} s without "
                                         f"answering")
                    self.stalled.append(a)
                else:
                    continue
                waiting.discard(a)
            if past_deadline and self.late and self.cfg.stragglers == "replan":
                raise DeadlinePassed(f"{', '.join(self.late)} still training at the round's deadline")

    def _receive(self, timeout: float) -> Optional[Message]:
        """The next message from the transport that is not a replay (:class:`protocol.ReplayGuard`),
        dropped before it can touch any state. Exempt: ``status`` (the broker publishes an
        agent's will with the seq of its connect); ``heartbeat`` is dropped silently (it comes
        from another thread of the agent, so it may overtake a message numbered just before it).
        """
        msg = self.transport.poll(timeout)
        if msg is None or msg.type == "status":
            return msg
        if self._seqs.is_replay(msg):
            if msg.type != "heartbeat":
                self.rejections.reject("replayed", f"{msg.type} from {msg.sender}: seq {msg.seq} is older "
                                                   f"than {self._seqs.last(msg.sender)}")
            return None
        return msg

    def _accepted(self, msg: Message) -> None:
        """``msg`` passed every check (sender registered, round, step, schema, tensors) and is used:
        only now does its seq raise the sender's replay bar. Raised on arrival, one message with
        a huge seq that fails every check would lock the agent out for good. A heartbeat never
        raises it (numbered after a message still in the agent's send path, it can arrive
        first); unknown senders never get an entry (a flood of invented ids must not grow it)."""
        self._seqs.advance(msg)

    def _maybe_resend(self, agents: dict[str, RoundAgent], ra: RoundAgent, heartbeat: Message) -> None:
        """An agent that says it is idle while we wait for it lost our last message: resend it.

        A busy agent (computing, e.g. an emulated slow device) is left alone.
        """
        self.registry.seen(ra.info_id)
        if heartbeat.body["state"] == "busy" or ra.last_sent is None:
            return
        if self._now() - ra.last_sent_at > RETRY_S:
            if ra.resends >= MAX_RESENDS:
                self.drop(agents, ra.info_id, f"idle after {MAX_RESENDS} resends of {ra.last_sent.type}")
                return
            log.info("%s is idle while we wait for it: resending %s", ra.info_id, ra.last_sent.type)
            self._send_again(ra)
            ra.resends += 1

    def _send_again(self, ra: RoundAgent) -> None:
        """What the agent may have lost: our last message, or with a window every gradient whose
        step's successors have not all come in (it applies each once, in order). Counted for
        :meth:`report_losses`."""
        self.resent += 1
        self._unexplained += not ra.reconnected
        if ra.unanswered and ra.last_sent is not None and ra.last_sent.type == "gradients":
            self.transport.send_many([(ra.info_id, m) for m in ra.unanswered])
        elif ra.last_sent is not None:
            self.transport.send(ra.info_id, ra.last_sent)
        ra.last_sent_at = self._now()

    def _activations_ahead(self, msg: Message, ra: RoundAgent) -> None:
        """Activations for a later step than the one gathered, within the agent's window: kept
        for their step (counted now: they arrived now)."""
        if (msg.sender, msg.step) in self._ahead:
            self.rejections.reject("duplicate", f"activations from {msg.sender}: round {msg.round} step "
                                                f"{msg.step} already received", level=logging.INFO)
            return
        self._count(ra, msg)
        self._accepted(msg)
        self._ahead[msg.sender, msg.step] = msg

    def _early_weights(self, msg: Message, ra: RoundAgent, r: int) -> None:
        """Weights from an agent we are not waiting on at this step: kept if they end its round."""
        if msg.round != r or msg.step != ra.assignment.tau - 1 or not ra.assignment.whole_model:
            self.rejections.reject("stale", f"weights (round {msg.round} step {msg.step}) from {msg.sender}: "
                                            f"not expected before the round's other agents finish")
            return
        if msg.sender in self._early:
            self.rejections.reject("duplicate", f"weights from {msg.sender}: round {r} already received",
                                   level=logging.INFO)
            return
        self._count(ra, msg)
        self._accepted(msg)
        self._early[msg.sender] = msg

    def _count(self, ra: RoundAgent, msg: Message) -> None:
        """A message the round waited for arrived: its bytes, its timing, the agent's compute so far."""
        ra.bytes_up += msg.wire_bytes
        ra.messages += 1
        ra.resends = 0
        now = self._now()
        dt = max(0.0, now - max(ra.last_sent_at, ra.counted_at))
        ra.counted_at = now
        ra.busy_s += dt
        if msg.type == "activations":
            ra.step_bytes_up += msg.wire_bytes
            if msg.step:
                ra.steps.append(dt)
            else:
                ra.first_s = dt
        elif msg.type == "weights" and not ra.assignment.whole_model:
            ra.last_s = dt
        ra.compute_s = float(msg.body["compute_s"])

    def _training_message(self, msg: Message, agents: dict[str, RoundAgent], kind: str, r: int, k: int,
                          got: dict[str, Message]) -> None:
        a = msg.sender
        ra = agents.get(a)
        if ra is None:
            if a in self.registry.agents:
                self.rejections.reject("not_selected", f"{msg.type} from {a}: not selected for round {r}")
            else:
                self.rejections.reject("unknown_sender", f"{msg.type} from unknown agent {a}")
            return
        if msg.type == kind and msg.round == r and msg.step == k:
            if a in got:  # duplicate of what we already hold
                self.rejections.reject("duplicate", f"{msg.type} from {a}: round {r} step {k} already received",
                                       level=logging.INFO)
                return
            self._count(ra, msg)
            self._accepted(msg)
            got[a] = msg
        elif msg.round == r and (msg.step < k or (msg.type == "activations" and kind in ("weights", "logit_grads"))):
            self.rejections.reject("duplicate", f"{msg.type} from {a}: round {r} step {msg.step} answered again",
                                   level=logging.INFO)
            # our reply to it was lost: send it again (with a window, its heartbeat's idle says
            # so: a reply to every duplicate would echo the agent's own resends back and forth)
            if ra.last_sent is not None and ra.assignment.window == 1:
                self._send_again(ra)
        elif msg.type == "activations" and kind == "activations" and msg.round == r and \
                k < msg.step < k + ra.assignment.window:
            self._activations_ahead(msg, ra)
        else:
            self.rejections.reject("stale", f"{msg.type} (round {msg.round} step {msg.step}) from {a}: "
                                            f"expected {kind} for round {r} step {k}")


    def rejected_totals(self) -> dict[str, int]:
        """Messages dropped so far, by reason: the transport's (undecodable, spoofed) and ours."""
        totals = dict(self.rejections.counts())
        refused = self.transport.rejections
        for reason, n in (refused.counts() if refused is not None else {}).items():
            totals[reason] = totals.get(reason, 0) + n
        return totals

    def rejected_since_last_round(self) -> dict[str, int]:
        now = self.rejected_totals()
        delta = {k: v - self._rejected_before.get(k, 0) for k, v in sorted(now.items())}
        self._rejected_before = now
        return {k: v for k, v in delta.items() if v}

    def _reply(self, agent: str, mtype: str, body: dict[str, Any]) -> None:
        self.transport.send(agent, Message(mtype, self.cfg.run_id, protocol.COORDINATOR_ID, body,
                                           seq=protocol.next_seq()))

    def _admit(self, agent: str) -> bool:
        """Whether a registration from an id the registry does not know may be taken.

        A flood of invented ids must neither stretch the rounds nor grow the registry and the
        checkpoint without bound: new ids are taken at ``register_rate_per_s`` (burst: the
        fleet size); a full registry (``max_registered``) first prunes silent entries that
        never trained, then refuses; and over MQTT an id must have measured its link against
        us (a link probe) first, as every agent does before it registers.
        """
        if not self._new_ids.take(""):
            self.rejections.reject("rate_limited", f"registration of {agent}: more than "
                                   f"{self.cfg.register_rate_per_s:g} new agents per second", level=logging.INFO)
            return False
        probed = self.transport.probed
        if probed is not None and agent not in probed:
            self.rejections.reject("unprobed", f"registration of {agent}: it never measured its link to us")
            self._reply(agent, "reject", {"reason": "register after measuring the link (probe), as "
                                                    "docs/protocol.md describes"})
            return False
        limit = self.cfg.registry_limit
        if len(self.registry.agents) >= limit:
            self.prune()
        if len(self.registry.agents) >= limit:
            self.rejections.reject("registry_full", f"registration of {agent}: the registry holds {limit} agents "
                                                    f"(max_registered)")
            self._reply(agent, "reject", {"reason": f"this run's registry is full ({limit} agents, "
                                                    f"max_registered)"})
            return False
        return True

    def prune(self) -> list[str]:
        """Forget agents that never trained a round and are not online (or silent past the step
        timeout): they hold no totals worth keeping, and a flood of fakes would otherwise stay
        in the registry and every checkpoint."""
        gone = [i.agent_id for i in self.registry.offline(stale_after_s=self._stale_after_s()) if i.rounds == 0]
        for a in gone:
            del self.registry.agents[a]
            self._reg_seq.pop(a, None)
            self._gone.discard(a)
            protocol.remember(self._pruned, a)   # if it comes back, it is asked to register again
        if gone:
            log.info("pruned %d silent agent(s) that never trained: %s", len(gone), ", ".join(gone[:5])
                     + (" ..." if len(gone) > 5 else ""))
        return gone

    def drop(self, agents: dict[str, RoundAgent], agent_id: str, why: str) -> None:
        ra = agents.get(agent_id)
        if self.follower and ra is not None and ra.bytes_up == 0 and ra.last_heard > ra.last_sent_at:
            # heard (its heartbeats), yet no row came: its rows come beneath its own topic, which
            # an ACL written before server workers took them there does not let it publish on,
            # and the broker drops them without a word
            why += (f"; none of its activations reached this server worker: the broker must let it publish on "
                    f"{protocol.up_topic(self.cfg.run_id, agent_id)}/+ (the ACL of sfl-coord broker-config "
                    f"has that rule; docs/brokers.md)")
        log.warning("dropping %s from the round: %s", agent_id, why)
        agents.pop(agent_id, None)
        self.on_drop(agent_id)
        self.on_event("agent_dropped", {"agent": agent_id, "reason": why})

    def dispatch(self, msg: Message, agents: Optional[dict[str, RoundAgent]]) -> None:
        """Messages outside the training exchange: registration, liveness."""
        if self.follower:
            return   # the leader answers registrations and keeps the registry; it hears them too
        if msg.type == "register":
            if self._reg_seq.get(msg.sender) == msg.seq:  # a re-sent registration: our ack was lost
                self._reply(msg.sender, "accepted", {"message": "already registered"})
                return
            if msg.sender not in self.registry.agents and not self._admit(msg.sender):
                return
            old = self.registry.agents.get(msg.sender)
            ra = agents.get(msg.sender) if agents is not None else None
            holder = ra.instance if ra is not None else (old.instance if old is not None and old.registered else "")
            same_process = bool(holder) and msg.body.get("instance") == holder
            try:
                info = self.registry.register(msg)
            except wire.WireError as exc:
                self.rejections.reject("invalid", f"registration of {msg.sender}: {exc}")
                self._reply(msg.sender, "reject", {"reason": str(exc)})
                return
            self._reg_seq[msg.sender] = msg.seq
            self._accepted(msg)
            if not self.virtual:
                # present on the broker: its retained online status (with its last will) was seen,
                # before or after this registration; an id that only sends 'register' is not
                info.online = msg.sender in self._present or (old is not None and old.online)
            holders = self._by_index.setdefault(info.index, set())
            twin = next((a for a in sorted(holders) if a != msg.sender and a in self.registry.agents
                         and self.registry.agents[a].registered and self.registry.agents[a].index == info.index),
                        None)
            holders.add(msg.sender)
            if twin is not None and not self.virtual and self.cfg.task is None:   # own data: no shards
                log.warning("agent %s registered with --index %d, which agent %s also uses: both train on the "
                            "same shard of a partitioned data set", msg.sender, info.index, twin)
            ra = agents.get(msg.sender) if agents is not None else None   # not dropped meanwhile
            if ra is not None and ra.last_sent is not None and (ra.bytes_up == 0 or same_process):
                # restarted before anything of this round reached us (e.g. selected on its status while
                # it was still starting), or the same process announcing itself again (it saw the run
                # described anew, e.g. after a resume): nothing to undo, it stays in. It may have missed
                # our last message: send it again, before 'accepted' (the agent refuses older seqs after it)
                self.transport.send(msg.sender, ra.last_sent)
                ra.last_sent_at = self._now()
            elif ra is not None and agents is not None:
                self.drop(agents, msg.sender, "re-registered mid-round (restarted)")
            # a benchmark run's shard index means something; a device training on its own data has none
            shard = f", shard {info.index} of the partition" if self.cfg.task is None else ""
            self._reply(msg.sender, "accepted", {"message": f"registered as {msg.sender}{shard}"})
            self.on_event("registered", {"agent": msg.sender, "online": self._online_count()})
        elif msg.type == "status":
            ra = agents.get(msg.sender) if agents is not None else None
            if agents is None or ra is None:
                pass
            elif ra.instance and msg.body["online"] and msg.body["instance"] != ra.instance:
                # a new process of this agent: the one that held the round is gone (or a duplicate
                # start that will exit); waiting for the old one's replies would cost the round
                # its resends and timeouts
                self.drop(agents, msg.sender, f"restarted (process {msg.body['instance']} replaced {ra.instance})")
            elif ra.instance and not msg.body["online"] and msg.body["instance"] == ra.instance:
                # the process holding the round left: a clean stop says so as it goes, a crash
                # through its last will once the broker misses it; nothing more will come from it
                self.drop(agents, msg.sender, "left (its process said it is offline)")
            elif ra.instance and msg.body["online"]:
                ra.reconnected = True   # its process announced itself again: its connection came back
            if msg.body["online"]:
                protocol.remember(self._present, msg.sender, msg.body["instance"])
                self._gone.discard(msg.sender)
            elif self._present.get(msg.sender) == msg.body["instance"]:   # not a dead predecessor's will
                del self._present[msg.sender]
                if msg.sender in self.registry.agents:
                    self._gone.add(msg.sender)
            self.registry.set_online(msg.sender, msg.body["online"], msg.body["instance"])
            if msg.body["online"] and msg.sender in self._pruned and msg.sender not in self.registry.agents:
                del self._pruned[msg.sender]
                self._reply(msg.sender, "reject", {"reason": REGISTER_AGAIN})
            self.on_event("status", {"agent": msg.sender, "online": msg.body["online"]})
        elif msg.type == "heartbeat":
            self.registry.seen(msg.sender)
            known = self.registry.agents.get(msg.sender)
            if known is not None and known.registered and not known.online and msg.sender not in self._gone:
                # alive, though its retained online status never reached us (RabbitMQ hands retained
                # messages only to exact-topic subscriptions): its heartbeats say it is present
                known.online = True
        elif msg.sender not in self.registry.agents:
            self.rejections.reject("unknown_sender", f"{msg.type} from unknown agent {msg.sender}")
        else:
            log.info("ignored %s from %s outside its round", msg.type, msg.sender)
