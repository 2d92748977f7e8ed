"""One copy of a round's client portion for every agent that trains it.

Problem: every agent of a round gets the same client portion for its cut and bottleneck width,
and each assignment used to carry its own copy. With ``n`` agents the coordinator encoded,
signed and published ``n`` copies: its uplink and its MQTT thread carried ``n`` times the
client portion per round, while no agent trained (the time between rounds).

Scheme (docs/protocol.md §2.2):

- The coordinator publishes each distinct client portion of :data:`MIN_BYTES` or more once,
  as a ``round_model`` message on ``sfl/R/model/S-W`` (cut ``S``, width ``W``), retained,
  before the round's assignments. The broker copies it to every agent subscribed there.
- An agent's assignment carries ``shared_weights``: that topic and the SHA-256 of the
  ``round_model`` payload. The first assignment that names a topic to an agent still carries
  the weights; the agent subscribes to the topic and keeps that subscription. Later ones carry
  empty ``weights``: the copy has come on the subscription before them. Why not rely on the
  retained copy for the first: a portion over one chunk (1 MiB) travels in several messages,
  and a broker retains only the last.
- The assignment is signed, so the digest is the coordinator's word: a forged or stale
  ``round_model`` does not match it and is not used. The ``round_model`` needs no signature of
  its own.
- Only agents that said they understand it (``register.features`` holds :data:`FEATURE`) are
  sent references. Older agents get their copy inline, as before.
- If the copy does not arrive (a broker's ACL written before this topic existed, a lost
  message), the agent waits idle; the coordinator resends the assignment after its usual
  retry interval, and a resent assignment carries the weights inline, for that agent for the
  rest of the run (:meth:`Sharing.inline`).

Cost: one SHA-256 over the client portion per distinct portion and round on the coordinator,
and one per copy received on the agent (hashlib hashes hundreds of MB a second on a server
core), and one more small message per agent; against ``n`` encodings, ``n`` signatures over
the whole portion and ``n`` publications of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from typing import Any, Optional

from sfl_core.wire import codec as wire
from sfl_core.wire import protocol
from sfl_core.wire.protocol import COORDINATOR_ID, Message

FEATURE = "shared_weights"
"""What an agent puts in ``register.features`` to be sent references instead of copies."""
MIN_BYTES = 64 * 1024
"""A client portion smaller than this travels inline. Below it the copy saves the coordinator
little (a few microseconds of encoding and signing per agent) against a second message to every
agent; ``bench/coordinator_load.py`` with an 18 KB portion read no gain (docs/scaling.md)."""
KEEP = 2
"""Copies an agent keeps, newest first: the round's, and one published ahead of its assignment."""


def digest(payload: bytes) -> bytes:
    """What an assignment names a ``round_model`` payload by."""
    return hashlib.sha256(payload).digest()


def reference(body: dict[str, Any], run: str) -> Optional[tuple[str, bytes]]:
    """An assignment's ``shared_weights`` as (topic, SHA-256), None without one. WireError when
    the reference is malformed or names a topic that is not this run's copy for the assignment's
    own cut and width. With weights beside it, the assignment carries them itself and the
    reference only says where the next copies come."""
    ref = body.get("shared_weights")
    if ref is None:
        return None
    if not isinstance(ref, dict) or set(ref) != {"topic", "sha256"}:
        raise wire.WireError("assign.shared_weights: expected {topic, sha256}")
    topic, sha = ref["topic"], ref["sha256"]
    if topic != protocol.model_topic(run, body["split"], body["width"]):
        raise wire.WireError(f"assign.shared_weights.topic: {topic!r} is not this run's copy for split "
                             f"{body['split']} width {body['width']}")
    if not isinstance(sha, bytes) or len(sha) != 32:
        raise wire.WireError("assign.shared_weights.sha256: expected 32 bytes")
    return topic, sha


def round_model(run: str, weights: dict[str, Any]) -> bytes:
    """The ``round_model`` payload for an encoded client portion."""
    return Message("round_model", run, COORDINATOR_ID, {"weights": weights}, seq=protocol.next_seq()).encode()


class Sharing:
    """The coordinator's side: which agents take references, and the copies published.

    Used on the transport's send path: :meth:`prepare` turns a batch of outgoing messages into
    the copies to publish first and the messages to send, references in place of weights."""

    def __init__(self, run: str):
        self.run = run
        self.agents: dict[str, None] = {}
        """Agents whose registration said they take references (:data:`FEATURE`); bounded
        (:func:`~sfl_core.wire.protocol.remember`), so a flood of invented ids costs bounded memory.
        One pushed out gets its weights inline."""
        self.published: dict[str, tuple[dict[str, Any], bytes, bytes]] = {}
        """topic -> (the encoded portion, payload, digest) of the copy last published there
        (retained on the broker)."""
        self._referenced: dict[str, tuple[int, int]] = {}   # agent -> (round, seq) of its last assignment without weights
        self._told: dict[str, str] = {}   # agent -> the copies' topic its assignments named (it subscribed there)

    def registered(self, agent: str, body: dict[str, Any]) -> None:
        """A valid registration: does the agent take references? A registering process may be a
        new one, subscribed nowhere yet: its next assignment carries the weights again."""
        self._told.pop(agent, None)
        self._referenced.pop(agent, None)
        if FEATURE in body.get("features", ()):
            protocol.remember(self.agents, agent)
        else:
            self.agents.pop(agent, None)

    def inline(self, agent: str) -> None:
        """From now on ``agent``'s assignments carry their weights."""
        self.agents.pop(agent, None)
        self._referenced.pop(agent, None)
        self._told.pop(agent, None)

    def prepare(self, messages: list[tuple[str, Message]]) -> tuple[list[tuple[str, bytes]], list[tuple[str, Message]],
                                                                    list[str]]:
        """(copies to publish first: topic and payload; the messages to send; agents that get
        their weights inline from now on because this assignment is a resend of one that named
        a copy without its weights). An assignment is sent as a new message with a reference and
        ``weights`` {}, or its weights as well where it is the first to name that topic to the
        agent; the caller's message is left as it was, so a resend starts from the weights again.

        A portion is known by identity: the engine encodes each distinct one once per round and
        hands every agent of that cut the same object, so a resend or a late agent names the
        copy already published, not a new one."""
        publish: list[tuple[str, bytes]] = []
        out, fallen = [], []
        for agent, msg in messages:
            if msg.type != "assign" or agent not in self.agents or not msg.body.get("weights"):
                out.append((agent, msg))
                continue
            if self._referenced.get(agent) == (msg.round, msg.seq):   # it did not fetch the copy: inline
                self.inline(agent)
                fallen.append(agent)
                out.append((agent, msg))
                continue
            weights = msg.body["weights"]
            topic = protocol.model_topic(self.run, msg.body["split"], msg.body["width"])
            copy = self.published.get(topic)
            if copy is None or copy[0] is not weights:
                if any(t == topic for t, _ in publish):   # another portion for the same cut in this batch
                    out.append((agent, msg))
                    continue
                payload = round_model(self.run, weights)
                if len(payload) < MIN_BYTES:
                    out.append((agent, msg))
                    continue
                copy = self.published[topic] = (weights, payload, digest(payload))
                publish.append((topic, payload))
            body = {k: v for k, v in msg.body.items() if k != "sig"}
            body["shared_weights"] = {"topic": topic, "sha256": copy[2]}
            if self._told.get(agent) == topic:
                body["weights"] = {}
                protocol.remember(self._referenced, agent, (msg.round, msg.seq))
            else:   # it subscribes there now: the copies of later rounds come before their assignments
                protocol.remember(self._told, agent, topic)
            out.append((agent, dataclasses.replace(msg, body=body)))
        return publish, out, fallen


class Copies:
    """The agent's side: the copies received, by digest, and the one assignment waiting for its copy.

    Not thread-safe by itself: the agent calls it from its network thread only."""

    def __init__(self, run: str, keep: int = KEEP):
        self.run = run
        self.keep = keep
        self._copies: "OrderedDict[bytes, tuple[dict[str, Any], int]]" = OrderedDict()   # digest -> weights, bytes
        self._waiting: Optional[tuple[Message, bytes]] = None

    def received(self, payload: bytes) -> Optional[Message]:
        """A ``round_model`` payload (whole, after reassembly): kept by its digest. Returns the
        assignment waiting for it, its weights filled in, if one was. WireError if malformed."""
        msg = protocol.decode(payload, run=self.run, allowed=frozenset({"round_model"}))
        if msg.sender != COORDINATOR_ID:
            raise wire.WireError(f"round_model from {msg.sender!r}, not the coordinator")
        sha = digest(payload)
        self._copies[sha] = (msg.body["weights"], len(payload))
        self._copies.move_to_end(sha)
        while len(self._copies) > self.keep:
            self._copies.popitem(last=False)
        if self._waiting is not None and self._waiting[1] == sha:
            assign = self._waiting[0]
            self._waiting = None
            return self._filled(assign, sha)
        return None

    def resolve(self, assign: Message) -> Optional[Message]:
        """An assignment ready to run: as it came, or with the copy it names filled in; None
        while that copy has not arrived (the assignment waits, replacing any that waited before).
        WireError for a malformed reference."""
        ref = reference(assign.body, self.run)
        if ref is None or assign.body["weights"]:
            if self._waiting is not None and self._waiting[0].round <= assign.round:
                self._waiting = None   # the coordinator sent this round's weights inline after all
            if ref is None:
                return assign
            return _without_reference(assign, assign.body["weights"])
        sha = ref[1]
        if sha in self._copies:
            return self._filled(assign, sha)
        self._waiting = (assign, sha)
        return None

    def _filled(self, assign: Message, sha: bytes) -> Message:
        weights, size = self._copies[sha]
        return _without_reference(assign, weights, extra_bytes=size)   # both parts came down


def _without_reference(assign: Message, weights: Any, extra_bytes: int = 0) -> Message:
    """``assign`` as the agent runs it: ``weights`` in place, no ``shared_weights`` left."""
    body = {k: v for k, v in assign.body.items() if k != "shared_weights"}
    body["weights"] = weights
    return dataclasses.replace(assign, body=body, wire_bytes=assign.wire_bytes + extra_bytes)
