"""Message types and topic layout of the agent <-> coordinator protocol.

The full description for third-party agent authors is ``docs/protocol.md``; this module is
its executable form. Every message is a msgpack envelope (:mod:`sfl_core.wire.codec`) whose
``body`` is checked here against a per-type schema before any field is used.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sfl_core.wire import codec as wire

_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_id(kind: str, value: str) -> str:
    """Run and agent ids become MQTT topic levels, so wildcards and slashes are forbidden."""
    # fullmatch, not match: with match, "$" also accepts a trailing newline ("agent\n")
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must be 1-64 characters of letters, digits, '-' or '_'")
    return value


TRAINING_TYPES = frozenset({"activations", "logit_grads"})
"""An agent's per-step messages: the only ones that go to a server worker's topic."""


def up_topic(run: str, agent: str, worker: int = 0) -> str:
    """Agent -> coordinator. The agent id in the topic must equal the envelope's sender.

    ``worker`` > 0: the topic of an agent's :data:`TRAINING_TYPES` when server worker
    ``worker`` trains its rows (``assign.server_worker``). It lies one level beneath the
    agent's own, which the leader's ``sfl/R/up/+`` does not match: the leader never receives
    the rows another worker trains, and that worker reads them all with one subscription
    (:func:`worker_wildcard`)."""
    return f"sfl/{run}/up/{agent}" + (f"/w{worker}" if worker else "")


def up_topic_for(run: str, agent: str, mtype: str, server_worker: int) -> str:
    """Where an agent publishes a message of type ``mtype`` under an assignment naming
    ``server_worker``: its training messages to that worker, everything else to the leader."""
    return up_topic(run, agent, server_worker if mtype in TRAINING_TYPES else 0)


def down_topic(run: str, agent: str) -> str:
    """Coordinator -> one agent."""
    return f"sfl/{run}/down/{agent}"


def status_topic(run: str, agent: str) -> str:
    """Retained online/offline flag; the offline value is the agent's MQTT last will."""
    return f"sfl/{run}/status/{agent}"


def coordinator_topic(run: str) -> str:
    """Retained liveness claim of the run's coordinator: one coordinator per run (its last will
    says offline)."""
    return f"sfl/{run}/coordinator"


def info_topic(run: str) -> str:
    """Retained description of the run (model, data set, partition) that agents read first."""
    return f"sfl/{run}/info"


def model_topic(run: str, split: int, width: int) -> str:
    """Retained: the round's client portion for agents of cut ``split`` and bottleneck ``width``,
    sent once for all of them (:mod:`sfl_core.wire.shared_weights`)."""
    return f"sfl/{run}/model/{split}-{width}"


def model_wildcard(run: str) -> str:
    """Every cut's copy (:func:`model_topic`): what an agent may read there (the broker's ACL)."""
    return f"sfl/{run}/model/+"


def up_wildcard(run: str) -> str:
    return f"sfl/{run}/up/+"


def status_wildcard(run: str) -> str:
    return f"sfl/{run}/status/+"


def worker_wildcard(run: str, worker: int) -> str:
    """Server worker ``worker``'s subscription: its agents' training messages (:func:`up_topic`)."""
    return f"sfl/{run}/up/+/w{worker}"


def agent_from_topic(topic: str) -> str:
    """The agent level of ``sfl/R/{up,status,down}/A`` (and of ``sfl/R/up/A/wK``)."""
    parts = topic.split("/")
    return parts[3] if len(parts) > 3 else parts[-1]


def worker_from_topic(topic: str) -> int:
    """The server worker an upward topic is for: 0 for ``sfl/R/up/A`` (the leader), K for
    ``sfl/R/up/A/wK``, -1 for any other shape (rejected: no agent publishes there)."""
    parts = topic.split("/")
    if len(parts) == 4:
        return 0
    tail = parts[4] if len(parts) == 5 else ""
    return int(tail[1:]) if tail[:1] == "w" and tail[1:].isdigit() and tail[1:2] != "0" else -1


# ---------------------------------------------------------------- messages

# type -> {field: python type(s)}; every listed field is required, others are rejected.
_NUM = (int, float)
_CORE_SCHEMAS: dict[str, dict[str, Any]] = {
    # agent -> coordinator
    "register": {"index": int, "profile": dict, "measured": dict, "label_counts": list,
                 "num_samples": int, "emulate": bool, "resume": dict},
    "probe": {"nonce": int, "pad": bytes, "reply_bytes": int},
    "activations": {"x": dict, "y": (dict, type(None)), "compute_s": _NUM},   # y null: labels withheld
    "logit_grads": {"g": dict, "loss": _NUM, "compute_s": _NUM},
    "weights": {"weights": dict, "num_samples": int, "compute_s": _NUM, "loss": _NUM},
    "heartbeat": {"state": str},
    "evaluation": {"loss": _NUM, "correct": int, "count": int, "compute_s": _NUM},
    "status": {"online": bool, "instance": str},   # instance: which process of that agent id
    # coordinator -> agent
    "accepted": {"message": str},
    "reject": {"reason": str},
    "probe_ack": {"nonce": int, "pad": bytes},
    "assign": {"model": str, "strategy": str, "split": int, "width": int, "batch_size": int,
               "lr": _NUM, "momentum": _NUM, "tau": int, "codec": str, "zstd_level": int,
               "activation_shape": list, "weights": dict},
    "gradients": {"g": dict},
    "logits": {"z": dict},
    "shutdown": {"reason": str},
    # federated evaluation (eval.federated_every): the global model, scored on the agent's held-out split
    "evaluate": {"model": str, "weights": dict, "bottlenecks": list},
    # the round's client portion, once for every agent that trains it (sfl/R/model/S-W, retained)
    "round_model": {"weights": dict},
    "run_info": {"model": str, "dataset": str, "input_shape": list, "num_classes": int,
                 "splits": list, "partition": dict, "num_agents": int,
                 "coordinator": dict,   # {"key": Ed25519 public key (32 bytes), "instance": str}
                 "sig": bytes},         # sfl_core.wire.signing: over the whole envelope
    "coordinator_status": {"online": bool, "instance": str},   # sfl/R/coordinator, retained + last will
}
# type -> {field: python type(s)} that may be present: what newer agents add (older ones omit it)
_CORE_OPTIONAL: dict[str, dict[str, Any]] = {
    "register": {"privacy": dict,       # the agent's defenses (sfl_core.privacy.AgentPrivacy.describe)
                 "instance": str,       # the registering process (its status messages carry the same)
                 "channel_stats": dict,  # normalize: federated (sfl_core.data.preprocessing.ChannelStats)
                 "architecture": str,   # the agent's model fingerprint (sfl_core.model.fingerprint)
                 "features": list},     # what the agent understands beyond the core: ["shared_weights"]
    "weights": {"epsilon": _NUM},       # DP-SGD's epsilon so far
    "assign": {"sig": bytes,            # required over MQTT (sfl_core.wire.signing); absent in a simulation
               "to": str,               # the agent it is for, inside the signature (signing.ADDRESSED)
               "normalize": dict,       # a task run's standardisation constants {mean, std}
               "window": int,           # steps the agent may keep in flight (absent: 1, lock-step)
               "server_worker": int,    # the server worker training its rows (absent: 0, the leader)
               # weights {} and where they are: {"topic": sfl/R/model/S-W, "sha256": of that message}
               "shared_weights": dict},
               # + each training option's own fields (sfl_core.options: ASSIGN_FIELDS)
    "shutdown": {"sig": bytes, "to": str},   # likewise
    "evaluate": {"sig": bytes, "normalize": dict, "to": str},
    "coordinator_status": {"pid": int, "host": str, "out_dir": str},   # for the operator's one line
    # a run on the devices' own data: its task contract (sfl_core.config.run.TaskConfig.to_wire), the
    # constants when already known, and the model's fingerprint (sfl_core.model.fingerprint)
    "run_info": {"task": dict, "normalize": dict, "architecture": list,
                 # + each training option's own (sfl_core.options: RUN_INFO), e.g. {"drift": {"kind": ...}}:
                 # an agent that does not know the option refuses the run
                 "heartbeat_idle_s": _NUM,   # idle agents beat this seldom (sfl_core.liveness)
                 # a user's model (sfl_core.model.user_models): a file each side installs (named, never sent),
                 # or a declarative layer list (data, validated by the agent)
                 "model_file": str, "model_function": str, "model_layers": list},
}


def in_range(lo: float, hi: float = math.inf, *, finite: bool = True) -> Callable[[Any], Optional[str]]:
    """A range check of a message field (an option's assignment field too): None if the value
    is a number in ``[lo, hi]`` (finite unless ``finite`` is False; NaN is out of every
    range), else why not."""
    def check(v: Any) -> Optional[str]:
        ok = isinstance(v, (int, float)) and not math.isnan(v) and (not finite or math.isfinite(v)) and lo <= v <= hi
        if ok:
            return None
        return f"{v} outside [{lo:g}, {hi:g}]" if math.isfinite(hi) else \
            f"{v} is not a {'finite ' if finite else ''}number >= {lo:g}"
    return check



def _loss(v: Any) -> Optional[str]:
    """A loss: finite, or NaN where there is none to report (a split agent's weights)."""
    return None if math.isfinite(v) or math.isnan(v) else f"{v} is not a finite number (or NaN: none)"


def _counts(v: list[Any]) -> Optional[str]:
    if len(v) > 100_000 or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v):
        return "expected at most 100000 counts, each an integer >= 0"
    return None


_SECONDS, _COUNT = in_range(0.0), in_range(0)
# type -> {field: check}: the value's range, once its type is right (None: acceptable, else why
# not). A device's numbers are never trusted: what it reports is bounded before anything uses it.
_CORE_RANGES: dict[str, dict[str, Callable[[Any], Optional[str]]]] = {
    "register": {"index": _COUNT, "num_samples": _COUNT, "label_counts": _counts},
    "probe": {"reply_bytes": _COUNT},
    "activations": {"compute_s": _SECONDS},
    "logit_grads": {"loss": _loss, "compute_s": _SECONDS},
    "weights": {"num_samples": _COUNT, "compute_s": _SECONDS, "loss": _loss,
                "epsilon": in_range(0.0, finite=False)},
    "evaluation": {"loss": _loss, "count": _COUNT, "correct": _COUNT, "compute_s": _SECONDS},
    "assign": {"split": in_range(1), "width": _COUNT, "batch_size": in_range(1), "tau": in_range(1),
               "lr": in_range(0.0), "momentum": in_range(0.0), "zstd_level": _COUNT, "window": in_range(1),
               "server_worker": _COUNT},
    "run_info": {"num_classes": in_range(1), "num_agents": _COUNT, "heartbeat_idle_s": in_range(0.0)},
}
_CORE_RELATIONS: dict[str, Callable[[dict[str, Any]], Optional[str]]] = {
    "evaluation": lambda b: "correct exceeds count" if b["correct"] > b["count"] else None,
}
"""type -> a check across a body's fields, once each field passed its own."""

_CORE_AGENT_TYPES = frozenset({"register", "probe", "activations", "logit_grads", "weights", "evaluation",
                               "heartbeat", "status"})
_CORE_COORD_TYPES = frozenset({"accepted", "reject", "probe_ack", "assign", "logits", "gradients", "evaluate",
                               "shutdown", "run_info", "round_model"})
PEER_TYPES = frozenset({"coordinator_status"})
"""Between coordinators of one run (the liveness claim); agents never read it."""
COORDINATOR_ID = "coordinator"


@dataclass
class Message:
    """One protocol message. ``round``/``step`` order the training exchange and make
    duplicates detectable: a receiver applies each (round, step) at most once."""

    type: str
    run: str
    sender: str
    body: dict[str, Any] = field(default_factory=dict)
    round: int = 0
    step: int = 0
    seq: int = 0
    wire_bytes: int = 0
    """Size of the payload this message arrived in (set by :func:`decode`), for byte accounting."""

    def encode(self) -> bytes:
        return wire.pack({"v": wire.PROTOCOL_VERSION, "type": self.type, "run": self.run,
                          "sender": self.sender, "seq": self.seq, "round": self.round,
                          "step": self.step, "body": self.body})


class _Schemas:
    """The core schemas with the training options' merged in (:mod:`sfl_core.option_registry`):
    their assignment fields, their message types. Read on first use, after every import."""

    def __init__(self) -> None:
        self.loaded = False

    def load(self) -> None:
        from sfl_core import option_registry   # the options import this module: read them late

        schemas = {t: dict(f) for t, f in _CORE_SCHEMAS.items()}
        optional = {t: dict(f) for t, f in _CORE_OPTIONAL.items()}
        agent, coord = set(_CORE_AGENT_TYPES), set(_CORE_COORD_TYPES)
        self.assign_checks = option_registry.assign_fields()
        optional["assign"].update({name: f.types for name, f in self.assign_checks.items()})
        optional["run_info"].update({key: dict for key in option_registry.run_info_keys()})
        for mtype, (direction, fields) in option_registry.messages().items():
            if mtype in schemas:
                raise ValueError(f"an option's message type {mtype!r} is already a protocol message")
            schemas[mtype] = dict(fields)
            if direction == "coordinator":   # signed; it may carry the run's standardisation constants
                coord.add(mtype)
                optional[mtype] = {"sig": bytes, "normalize": dict, "to": str}
            else:
                agent.add(mtype)
        self.schemas, self.optional = schemas, optional
        self.agent_types, self.coord_types = frozenset(agent), frozenset(coord)
        self.option_coord_types = self.coord_types - _CORE_COORD_TYPES
        self.loaded = True


_schemas = _Schemas()


def __getattr__(name: str) -> Any:
    """``SCHEMAS``, ``OPTIONAL``, ``AGENT_TYPES``, ``COORD_TYPES``: the core's and the options';
    ``OPTION_COORD_TYPES``: the options' requests to agents (a phase's: signed, and work)."""
    attr = {"SCHEMAS": "schemas", "OPTIONAL": "optional", "AGENT_TYPES": "agent_types",
            "COORD_TYPES": "coord_types", "OPTION_COORD_TYPES": "option_coord_types"}.get(name)
    if attr is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _schemas.loaded:
        _schemas.load()
    value = globals()[name] = getattr(_schemas, attr)   # read once
    return value


def validate_body(mtype: str, body: dict[str, Any]) -> None:
    """Every required field there with its type, nothing unknown, every number in its range
    (a duration finite and >= 0, a count an integer >= 0, a loss finite or NaN); an option's
    assignment field range-checked by the option's own rule."""
    if not _schemas.loaded:
        _schemas.load()
    schema = _schemas.schemas.get(mtype)
    if schema is None:
        raise wire.WireError(f"unknown message type {mtype!r}")
    missing = [k for k in schema if k not in body]
    if missing:
        raise wire.WireError(f"{mtype}: missing field(s) {missing}")
    optional = _schemas.optional.get(mtype, {})
    extra = [k for k in body if k not in schema and k not in optional]
    if extra:
        raise wire.WireError(f"{mtype}: unexpected field(s) {extra}")
    for key, typ in [*schema.items(), *((k, t) for k, t in optional.items() if k in body)]:
        val = body[key]
        if isinstance(val, bool) and typ is not bool:
            raise wire.WireError(f"{mtype}.{key}: expected {typ}, got bool")
        if not isinstance(val, typ):
            raise wire.WireError(f"{mtype}.{key}: expected {getattr(typ, '__name__', typ)}, got {type(val).__name__}")
    for key, check in _CORE_RANGES.get(mtype, {}).items():
        why = check(body[key]) if key in body else None
        if why:
            raise wire.WireError(f"{mtype}.{key}: {why}")
    relation = _CORE_RELATIONS.get(mtype)
    why = relation(body) if relation is not None else None
    if why:
        raise wire.WireError(f"{mtype}: {why}")
    if mtype == "assign":
        check_option_fields(body)


def check_option_fields(body: dict[str, Any]) -> None:
    """The training options' fields of an assignment, each by its option's own rule (types and
    ranges); :class:`wire.WireError` naming the first bad one."""
    if not _schemas.loaded:
        _schemas.load()
    for key, f in _schemas.assign_checks.items():
        if key not in body:
            continue
        if isinstance(body[key], bool) and f.types is not bool or not isinstance(body[key], f.types):
            raise wire.WireError(f"assign.{key}: expected {getattr(f.types, '__name__', f.types)}, "
                                 f"got {type(body[key]).__name__}")
        why = f.check(body[key]) if f.check is not None else None
        if why:
            raise wire.WireError(f"assign.{key}: {why}")


def decode(payload: bytes, *, run: str, max_bytes: int = wire.MAX_MESSAGE_BYTES,
           allowed: frozenset[str] | None = None) -> Message:
    """Envelope + schema validation. Raises :class:`wire.WireError` with the reason."""
    env = wire.unpack(payload, max_bytes)
    if env["run"] != run:
        raise wire.WireError(f"message for run {env['run']!r}, this is run {run!r}", reason="wrong_run")
    if allowed is not None and env["type"] not in allowed:
        raise wire.WireError(f"message type {env['type']!r} not accepted here")
    if env["round"] < 0 or env["step"] < 0 or env["seq"] < 0:
        raise wire.WireError("negative round/step/seq")
    validate_body(env["type"], env["body"])
    return Message(type=env["type"], run=env["run"], sender=env["sender"], body=env["body"],
                   round=env["round"], step=env["step"], seq=env["seq"], wire_bytes=len(payload))


class Sequencer:
    """Per-sender strictly increasing sequence numbers (thread-safe).

    Each number is at least the wall clock in nanoseconds, which keeps them increasing
    across process restarts, so a peer can tell a retransmission (same seq) from a
    restarted sender. Why nanoseconds: a counter started from a microsecond clock runs
    ahead of it in a burst (Python issues several numbers per microsecond), and a sender
    restarted right after would reuse numbers; no Python loop issues one per nanosecond.
    Values stay below 2**63 until the year 2262. With an explicit ``start`` it is a plain
    counter (deterministic, for tests).
    """

    def __init__(self, start: int | None = None):
        self._clock = start is None
        self._last = (time.time_ns() if start is None else start) - 1
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.time_ns()) if self._clock else self._last + 1
            return self._last


def register_body(*, index: int, profile: Any, measured: dict, label_counts: list[int], num_samples: int,
                  emulate: bool, resume: dict, privacy: dict, instance: str = "",
                  extra: dict | None = None) -> dict[str, Any]:
    """A ``register`` body; ``privacy`` (the agent's declared defenses) only when there are some,
    ``instance`` (the process, as in its status messages) when known; ``extra``: optional
    fields of a task run (``channel_stats``, ``architecture``)."""
    body = {"index": index, "profile": profile_body(profile), "measured": measured, "label_counts": label_counts,
            "num_samples": num_samples, "emulate": emulate, "resume": resume, **(extra or {})}
    if privacy:
        body["privacy"] = privacy
    if instance:
        body["instance"] = instance
    return body


def profile_body(profile: Any) -> dict[str, Any]:
    """The device-profile fields sent in ``register`` (what the coordinator's timing model needs)."""
    body = {"name": profile.name, "compute_flops": float(profile.compute_flops),
            "link_bytes_per_s": float(profile.link_bytes_per_s),
            "downlink_bytes_per_s": float(profile.downlink_bytes_per_s), "latency_s": float(profile.latency_s)}
    if getattr(profile, "capacity", ()):
        # a schedule of capacity changes (emulation/simulation): the virtual clock applies it
        body["capacity"] = [[int(r), float(c), float(lk)] for r, c, lk in profile.capacity]
    if getattr(profile, "memory_bytes", None):
        body["memory_bytes"] = float(profile.memory_bytes)   # what a planner may place on the device
    if getattr(profile, "half_duplex", False):
        body["half_duplex"] = True   # uploads and downloads take turns: how steps in flight are priced
    for key in ("bidir_link_bytes_per_s", "bidir_downlink_bytes_per_s"):
        if getattr(profile, key, None):
            body[key] = float(getattr(profile, key))   # each way while both carry data: steps in flight too
    return body


_PROCESS_SEQUENCER = Sequencer()


def next_seq() -> int:
    """The process-wide sequence: every message a process sends is numbered from one counter,
    so ``seq`` is strictly increasing per sender even when several components send."""
    return _PROCESS_SEQUENCER.next()


class Rejections:
    """Counts of dropped messages by reason (thread-safe), logged as they happen.

    Why counted and not only logged: an operator should see at a glance, per round, whether
    anything on the network is replaying, spoofing or sending garbage (``metrics.jsonl``'s
    ``rejected``), without grepping logs. Reasons are short stable keys: ``malformed``
    (envelope or schema), ``wrong_run``, ``spoofed`` (sender ≠ topic), ``replayed`` (older
    seq), ``duplicate``, ``stale`` (wrong round/step), ``unknown_sender``, ``not_selected``,
    ``invalid`` (tensor shape/dtype/values), ``too_large``, ``version`` (another protocol
    version), ``unsigned`` / ``untrusted`` (agent: not signed by the trusted coordinator),
    ``rate_limited`` / ``unprobed`` / ``registry_full`` (coordinator: registrations refused).
    """

    LOG_EVERY_S = 60.0
    """Each (reason, sender) is logged at most once in this many seconds, with how many more
    were dropped since: a flood must not fill the disk with log lines."""

    def __init__(self, logger: Any) -> None:
        self._log = logger
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._quiet: dict[tuple[str, str], list[float]] = {}   # (reason, who) -> [logged at, unlogged count]

    def reject(self, reason: str, detail: str, *, level: int = logging.WARNING) -> None:
        """Count one message under ``reason`` and log ``detail`` (WARNING unless ``level`` says),
        at most once a minute per reason and sender (``detail`` up to its first colon names the
        sender: ``message on TOPIC``, ``probe from A``, ...)."""
        who = detail.split(":", 1)[0]
        now = time.monotonic()
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            seen = self._quiet.get((reason, who))
            if seen is not None and now - seen[0] < self.LOG_EVERY_S:
                seen[1] += 1
                return
            more = int(seen[1]) if seen is not None else 0
            remember(self._quiet, (reason, who), [now, 0], limit=10_000)   # type: ignore[arg-type]
        self._log.log(level, "rejected %s%s", detail,
                      f" (and {more} more {reason} from the same sender in the last minute)" if more else "")

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


PROBE_AMPLIFICATION = 16
"""A link probe's answer is at most this many times the probe's own bytes (or
:data:`PROBE_FREE_BYTES`): a coordinator must not turn a few bytes from anyone into megabytes
on the broker. An agent timing its downlink pads its probe accordingly."""
PROBE_FREE_BYTES = 256
"""Answer bytes any probe may ask for, whatever it paid."""
MAX_PROBE_REPLY = 4 * 2**20


def probe_reply_bytes(asked: int, paid: int) -> int:
    """How many bytes a probe of ``paid`` wire bytes that asks for ``asked`` is answered with."""
    return max(0, min(asked, MAX_PROBE_REPLY, max(PROBE_FREE_BYTES, PROBE_AMPLIFICATION * paid)))


MAX_REMEMBERED = 100_000
"""Entries a receiver keeps about senders it cannot vouch for (ids seen online, probed, pruned)."""


def remember(table: dict[str, Any], key: str, value: Any = None, limit: int = MAX_REMEMBERED) -> None:
    """Put ``key`` into an insertion-ordered ``table`` that never grows past ``limit`` (the
    oldest entry goes first): a flood of invented ids costs bounded memory."""
    table.pop(key, None)
    table[key] = value
    if len(table) > limit:
        del table[next(iter(table))]


class ReplayGuard:
    """The highest ``seq`` seen per sender, which is what makes a replay recognisable.

    Every process numbers what it sends from one increasing counter (:func:`next_seq`, across
    restarts too), so a ``seq`` below the highest seen from that sender is a replay; an equal
    one is a retransmission, for the exchange to answer idempotently. Which message types
    are exempt, or may not raise the bar, is the receiver's policy, not this class's.
    """

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def last(self, sender: str) -> int:
        return self._last.get(sender, -1)

    def is_replay(self, msg: Message) -> bool:
        return msg.seq < self.last(msg.sender)

    def advance(self, msg: Message) -> None:
        self._last[msg.sender] = max(msg.seq, self.last(msg.sender))
