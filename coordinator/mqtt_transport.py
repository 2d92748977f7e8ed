"""The coordinator's side of the MQTT transport.

Runs on paho's network thread: reassembles chunks, validates every message (envelope,
schema, run id, sender == topic), answers link probes at once (an agent measures its
round-trip time against them, so they must not wait behind training work), and queues
the rest for the round engine.

It also holds the run's two identities on the broker: the liveness claim (one coordinator
per run: :meth:`MqttTransport.claim`) and the signing key (agents follow only descriptions,
assignments and shutdowns signed by it: :mod:`sfl_core.wire.signing`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from typing import Any, Optional

from sfl_core.rate_limit import TokenBuckets
from sfl_core.transport.broker_url import BrokerAddress, parse_broker_url
from sfl_core.transport.claim import Claim
from sfl_core.transport.mqtt_link import MqttLink
from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.protocol import COORDINATOR_ID, Message
from sfl_core.wire import signing
from sfl_core.wire.shared_weights import Sharing
from sfl_core.wire.signing import Signer

log = logging.getLogger("sfl.coord.mqtt")

PROBES_PER_AGENT = (32.0, 1.0)
"""Link probes answered per agent id: a burst of 32 (an agent's measurement takes 15), then one a second."""
PROBE_BYTES_TOTAL = (64 * 2**20, 16 * 2**20)
"""Answer bytes for all probes together: a burst of 64 MiB, then 16 MiB a second."""


class DuplicateCoordinatorError(RuntimeError):
    """Another coordinator of this run is alive on this broker (exit status 2)."""
INFO_REPEAT_MIN_S = 1.0
"""At most one repeat of the run description per this many seconds, however many agents appear."""


def _worker_address(url: "str | BrokerAddress", rank: int) -> BrokerAddress:
    """A server worker logs in as its own user (:func:`coordinator.server_workers.worker_user`)."""
    from coordinator.server_workers import worker_user

    address = url if isinstance(url, BrokerAddress) else parse_broker_url(url)
    if address.username:
        address = dataclasses.replace(address, username=worker_user(address.username, rank))
    return address


class MqttTransport:
    def __init__(self, url: "str | BrokerAddress", run_id: str, *, max_bytes: int = wire.MAX_MESSAGE_BYTES,
                 chunk_bytes: int = wire.CHUNK_BYTES, publish_timeout_s: float = 10.0, worker: int = 0,
                 signer: Optional[Signer] = None, claim_s: float = 3.0, where: Optional[dict[str, Any]] = None):
        """``worker``: the rank of a server worker other than the leader
        (:mod:`coordinator.server_workers`): it subscribes to nothing until :meth:`follow` names
        its agents. ``signer``: the run's key (a new one if None); ``claim_s``: how long
        :meth:`claim` waits for a coordinator that announced itself to show it is alive;
        ``where``: pid/host/out_dir, for the line a second coordinator prints."""
        self.run_id = protocol.check_id("run id", run_id)
        self.instance = uuid.uuid4().hex[:12]
        self.signer = signer or Signer.generate()
        self.claim_s = claim_s
        self._where = {"pid": 0, "host": "", "out_dir": "", **(where or {})}
        self._coord_topic = protocol.coordinator_topic(run_id)
        self._claim = Claim(self.instance, self._announce)
        self._probe_budget = TokenBuckets(*PROBES_PER_AGENT)
        self._version_answers = TokenBuckets(2.0, 1 / 60)   # an older agent: answered twice a minute at most
        self._probe_bytes = TokenBuckets(*PROBE_BYTES_TOTAL)
        self.probed: "dict[str, None]" = {}
        """Agents whose link probe we answered (a registration needs one; bounded, oldest out)."""
        self.max_bytes = max_bytes
        self.chunk_bytes = chunk_bytes
        self.publish_timeout_s = publish_timeout_s
        self._queue: "queue.Queue[Message]" = queue.Queue()
        self._reassembler = wire.Reassembler(max_bytes)
        self.rejections = protocol.Rejections(log)
        self._run_info: Optional[bytes] = None
        self._run_info_body: dict[str, Any] = {}
        self._info_repeated_at = float("-inf")
        self._info_repeat: Optional[threading.Timer] = None
        self._info_lock = threading.Lock()
        self.not_mine: frozenset[str] = frozenset()
        """Agents whose training messages another server worker handles: dropped on arrival."""
        self._following: set[str] = set()
        self._worker = worker
        self.sharing = Sharing(run_id)
        """Which agents take the round's client portion by reference, and the copies published."""
        self.addressed: dict[str, None] = {}
        """Agents whose registration said they check that a signed message names them
        (:data:`~sfl_core.wire.signing.ADDRESSED`); bounded as the sharing agents are."""
        # a worker: its agents' training messages (beneath their topics, assign.server_worker),
        # and from follow() on, their own topics (heartbeats)
        subs = [protocol.worker_wildcard(run_id, worker)] if worker else \
            [protocol.up_wildcard(run_id), protocol.status_wildcard(run_id), self._coord_topic]
        if worker:
            url = _worker_address(url, worker)
        # the instance in the client id: a second coordinator of the run must not knock the first
        # off the broker (same client id = takeover) before the claim sends it away
        client_id = f"sfl-coord-{run_id}" + (f"-w{worker}" if worker else "") + f"-{self.instance[:6]}"
        will = None if worker else (self._coord_topic, self._claim_message(False).encode(), True)
        self.link = MqttLink(url, client_id, self._on_message, subscriptions=subs, will=will)
        self.link.add_reconnect_callback(self._republish_copies)

    def start(self, timeout: float = 10.0) -> "MqttTransport":
        self.link.connect(timeout)
        return self

    # --------------------------------------------------------------- one coordinator per run
    def _claim_message(self, online: bool) -> Message:
        return Message("coordinator_status", self.run_id, COORDINATOR_ID,
                       {"online": online, "instance": self.instance, **self._where}, seq=protocol.next_seq())

    def _announce(self) -> None:
        self.link.publish(self._coord_topic, self._claim_message(True).encode(), retain=True)

    def claim(self) -> None:
        """Make sure no other coordinator of this run is alive on this broker, then hold the
        claim (:class:`~sfl_core.transport.claim.Claim` on ``sfl/R/coordinator``; docs/protocol.md
        §7.8): DuplicateCoordinatorError naming the live one, before anything of the run is
        published."""
        self._announce()
        rival = self._claim.decide(self.claim_s)
        if rival is not None:
            raise DuplicateCoordinatorError(
                f"another coordinator of run {self.run_id!r} is running on {self.link.address.url()} "
                f"(pid {rival.get('pid')} on host {rival.get('host') or '?'}, output {rival.get('out_dir') or '?'}); "
                f"stop it first (this one changed nothing)")
        if not self._claim.own_seen:
            log.info("our own coordinator status did not come back (the broker's ACL may not let us read "
                     "it): a second coordinator of this run cannot be detected on the broker")
        self.link.add_reconnect_callback(self._announce)

    def _on_claim(self, payload: bytes) -> None:
        try:
            msg = protocol.decode(payload, run=self.run_id, allowed=protocol.PEER_TYPES)
        except wire.WireError as exc:
            self.rejections.reject(exc.reason, f"message on {self._coord_topic}: {exc}")
            return
        if self._claim.observe(msg.body) is not None and msg.body["online"]:
            log.warning("another coordinator of run %s started (pid %s on %s); telling it that this one runs",
                        self.run_id, msg.body.get("pid"), msg.body.get("host") or "?")

    def publish_run_info(self, body: dict[str, Any]) -> None:
        """Retained, so an agent that starts later still learns what to train.

        Published again after every reconnect: a broker restarted without persistence has
        forgotten its retained messages, and an agent (re)started after that would wait for
        the run's description forever.
        """
        first = self._run_info is None
        self._run_info_body = dict(body)
        body = {**body, "coordinator": {"key": self.signer.public, "instance": self.instance}}
        msg = Message("run_info", self.run_id, COORDINATOR_ID, body, seq=protocol.next_seq())
        self._run_info = self.signer.sign(msg).encode()
        self.link.publish(protocol.info_topic(self.run_id), self._run_info, retain=True)
        if first:
            self.link.add_reconnect_callback(self._republish_run_info)

    def amend_run_info(self, **fields: Any) -> None:
        """Publish the description again with ``fields`` added (a task run's constants, once the
        fleet's statistics are combined): agents that join later read them first."""
        if self._run_info is not None:
            self.publish_run_info({**self._run_info_body, **fields})

    def _republish_run_info(self) -> None:
        if self._run_info is not None:  # on paho's thread: publish only enqueues
            self.link.publish(protocol.info_topic(self.run_id), self._run_info, retain=True)

    def _republish_copies(self) -> None:
        """After a reconnect: a broker restarted without persistence forgot the round's retained
        copies, and an agent subscribing now would wait for one."""
        for topic, (_, payload, _) in list(self.sharing.published.items()):
            for piece in self._pieces(payload):
                self.link.publish(topic, piece, retain=True)

    def _pieces(self, payload: bytes) -> list[bytes]:
        """``payload`` as it goes on the wire: whole, or in chunks under one new id (docs/protocol.md §5)."""
        chunk_id = uuid.uuid4().hex[:12] if len(payload) > self.chunk_bytes else ""
        return wire.split_chunks(payload, chunk_id, self.chunk_bytes)

    def close(self, finished: bool = True) -> None:
        """Disconnect. A ``finished`` run clears its retained description and copies; an interrupted one
        keeps it, so agents (re)started before ``--resume`` still find what to train."""
        with self._info_lock:
            if self._info_repeat is not None:
                self._info_repeat.cancel()
        try:
            if finished:
                self.link.publish(protocol.info_topic(self.run_id), b"", retain=True, timeout=5)
                for topic in self.sharing.published:   # the round's copies, as the description
                    self.link.publish(topic, b"", retain=True, timeout=5)
            if self._claim.held:   # a clean disconnect does not fire the will: say offline ourselves
                self.link.publish(self._coord_topic, self._claim_message(False).encode(), retain=True, timeout=5,
                                  wait_offline=False)
        finally:
            self.link.close()

    def follow(self, agents: set[str]) -> None:
        """A server worker: receive exactly these agents' own upward messages from now on (their
        heartbeats; their training messages come on this worker's topic)."""
        for a in sorted(self._following - agents):
            self.link.unsubscribe(protocol.up_topic(self.run_id, a))
        for a in sorted(agents - self._following):
            self.link.subscribe(protocol.up_topic(self.run_id, a), timeout=self.publish_timeout_s)
        self._following = set(agents)

    def live_time(self) -> float:
        """Time in which agents could reach us (stands still while the broker is down)."""
        return self.link.live_time()

    def outages(self) -> int:
        return self.link.outages

    def loss_hint(self, in_flight: int) -> str:
        """Over a connection that stayed up, QoS 1 loses nothing but what the broker drops: a
        client's queue that is full (the coordinator reads every agent's messages, so its queue
        is the one that fills)."""
        return (f"a broker drops a client's messages once its queue is full (Mosquitto past max_inflight_messages + "
                f"max_queued_messages, 20 + 1000 by default, and its log says 'Outgoing messages are being dropped "
                f"for client {self.link.client_id}'), and this round's agents kept up to {in_flight} messages in "
                f"flight toward this coordinator: raise both (sfl-coord broker-config sets 0, no limit, and 10000)")

    # --------------------------------------------------------------- Transport
    def send(self, agent_id: str, msg: Message) -> int:
        """Publish and wait for the broker's acknowledgement (``publish_timeout_s`` at most).
        While the broker is unreachable nothing waits: paho queues the message and sends it
        after the reconnect, and the round engine keeps answering whoever it can reach."""
        return self.send_many([(agent_id, msg)])[0]

    def send_many(self, messages: list[tuple[str, Message]]) -> list[int]:
        """:meth:`send` for several messages: all published, then their acknowledgements
        awaited together (``publish_timeout_s`` for the lot). Assignments to agents that take
        references name a copy of their client portion published once, first
        (:mod:`sfl_core.wire.shared_weights`)."""
        copies, messages, fallen = self.sharing.prepare(messages)
        for agent_id in fallen:
            log.info("%s was sent its assignment again: its assignments carry their client portion from now on "
                     "(if it cannot read sfl/%s/model/, let it: sfl-coord broker-config)", agent_id, self.run_id)
        pieces: list[tuple[str, bytes]] = []
        owner: list[int] = []      # pieces[i] belongs to messages[owner[i]]; -1: a copy
        for topic, payload in copies:
            for piece in self._pieces(payload):
                pieces.append((topic, piece))
                owner.append(-1)
        sizes = []
        for i, (agent_id, msg) in enumerate(messages):
            if msg.type in signing.SIGNED_TYPES:
                if agent_id in self.addressed:    # named inside the signature: not another agent's to replay
                    msg.body["to"] = agent_id
                self.signer.sign(msg)
            payload = msg.encode()
            ref = msg.body.get("shared_weights") if msg.type == "assign" and not msg.body["weights"] else None
            # its weights come to the agent in the copy it names
            sizes.append(len(payload) + (len(self.sharing.published[ref["topic"]][1]) if ref else 0))
            topic = protocol.down_topic(self.run_id, agent_id)
            for piece in self._pieces(payload):
                pieces.append((topic, piece))
                owner.append(i)
        acked = self.link.publish_many(pieces, timeout=self.publish_timeout_s, wait_offline=False,
                                       retain=[i < 0 for i in owner])
        late = sorted({owner[j] for j, ok in enumerate(acked) if not ok and owner[j] >= 0})
        for i in late:
            log.info("%s to %s queued until the broker is reachable again", messages[i][1].type, messages[i][0])
        return sizes

    def poll(self, timeout: float) -> Optional[Message]:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    # --------------------------------------------------------------- network thread
    def _on_message(self, topic: str, payload: bytes) -> None:
        agent = protocol.agent_from_topic(topic)
        if topic == self._coord_topic:
            if payload:
                self._on_claim(payload)
            return
        try:
            if not payload:
                return  # a cleared retained message
            whole = self._reassembler.feed(topic, payload)
            if whole is None:
                return
            msg = protocol.decode(whole, run=self.run_id, max_bytes=self.max_bytes, allowed=protocol.AGENT_TYPES)
        except wire.VersionError as exc:
            self.rejections.reject(exc.reason, f"message on {topic}: {exc}")
            if exc.type in ("register", "status") and 0 < exc.version < wire.PROTOCOL_VERSION \
                    and topic.startswith((f"sfl/{self.run_id}/up/", f"sfl/{self.run_id}/status/")) \
                    and self._version_answers.take(agent):
                # an older agent cannot read our run description, so it waits for one forever:
                # its announcement (status) and its registration are answered in its own version
                self._answer_other_version(agent, exc.version)
            return
        except wire.WireError as exc:
            self.rejections.reject(exc.reason, f"message on {topic}: {exc}")
            return
        if msg.sender != agent:
            self.rejections.reject("spoofed", f"{msg.type} on {topic}: sender {msg.sender!r} does not match "
                                              f"the topic's agent {agent!r}")
            return
        if topic.startswith(f"sfl/{self.run_id}/status/") != (msg.type == "status"):
            self.rejections.reject("malformed", f"{msg.type} not allowed on {topic}")
            return
        route = 0 if msg.type == "status" else protocol.worker_from_topic(topic)
        if route and (route != self._worker or msg.type not in protocol.TRAINING_TYPES):
            self.rejections.reject("malformed", f"{msg.type} not allowed on {topic}")
            return
        if msg.type == "probe":
            self._answer_probe(msg)
            return
        if msg.type in protocol.TRAINING_TYPES and msg.sender in self.not_mine:
            return
        if self._worker and msg.type in ("register", "weights"):
            return   # the leader's: it registers agents and aggregates their weights
        if msg.type == "status" and msg.body["online"]:
            self._repeat_run_info()
        if msg.type == "register":
            self.sharing.registered(agent, msg.body)
            if signing.ADDRESSED in msg.body.get("features", ()):
                protocol.remember(self.addressed, agent)
            else:
                self.addressed.pop(agent, None)
        self._queue.put(msg)

    def _repeat_run_info(self) -> None:
        """An agent came online: publish the run description again, the same bytes (same seq, so
        agents that already joined ignore it). Brokers whose retained store is per node
        (RabbitMQ 3.x in a cluster) do not hand an agent on another node the retained copy, and
        RabbitMQ hands retained messages only to exact-topic subscriptions; a live publish
        reaches every subscriber on every node. At most one repeat per ``INFO_REPEAT_MIN_S``: an
        agent that comes online sooner gets the next one, so a fleet booting at once costs one
        message a second and every agent is answered."""
        with self._info_lock:
            if self._info_repeat is not None:
                return                         # a repeat is already due, after this agent subscribed
            wait = max(0.0, self._info_repeated_at + INFO_REPEAT_MIN_S - time.monotonic())
            self._info_repeat = threading.Timer(wait, self._fire_info_repeat)
            self._info_repeat.daemon = True
            self._info_repeat.start()

    def _fire_info_repeat(self) -> None:
        with self._info_lock:
            self._info_repeat = None
            self._info_repeated_at = time.monotonic()
        self._republish_run_info()

    def _answer_other_version(self, agent: str, version: int) -> None:
        """An agent of an older protocol version announced itself or registered: answer with a
        ``reject`` in its own version's envelope (``reject`` has had the same body since version
        1), so it can say why instead of waiting for a run description it cannot read."""
        try:
            protocol.check_id("agent id", agent)
        except ValueError:
            return
        reason = (f"protocol version {version} is not supported: this coordinator speaks version "
                  f"{wire.PROTOCOL_VERSION} (docs/protocol.md; upgrade the agent)")
        payload = wire.pack({"v": version, "type": "reject", "run": self.run_id, "sender": COORDINATOR_ID,
                             "seq": protocol.next_seq(), "round": 0, "step": 0, "body": {"reason": reason}})
        self.link.publish(protocol.down_topic(self.run_id, agent), payload, wait_offline=False)

    def _answer_probe(self, msg: Message) -> None:
        """Answer a link probe at once, within limits: at most :data:`protocol.PROBE_AMPLIFICATION`
        times the probe's own bytes, :data:`PROBES_PER_AGENT` per agent id and
        :data:`PROBE_BYTES_TOTAL` for everyone (docs/protocol.md, ``probe``)."""
        asked = msg.body["reply_bytes"]
        if not 0 <= asked <= protocol.MAX_PROBE_REPLY:
            self.rejections.reject("invalid", f"probe from {msg.sender}: reply_bytes {asked} outside "
                                              f"0..{protocol.MAX_PROBE_REPLY}")
            return
        n = protocol.probe_reply_bytes(asked, msg.wire_bytes)
        if not self._probe_budget.take(msg.sender, 1.0) or not self._probe_bytes.take("", float(n + 256)):
            self.rejections.reject("rate_limited", f"probe from {msg.sender}: over the probe rate",
                                   level=logging.INFO)
            return
        protocol.remember(self.probed, msg.sender)
        ack = Message("probe_ack", self.run_id, COORDINATOR_ID, {"nonce": msg.body["nonce"], "pad": bytes(n)},
                      seq=protocol.next_seq())
        self.send(msg.sender, ack)
