"""Who is in the fleet: registered agents, their profiles, measurements and label counts."""

from __future__ import annotations

import copy
import json
import operator
import time
from typing import Any, Callable, Optional

from sfl_core.config.run import ConfigError, profile_from_dict
from sfl_core.data.preprocessing import ChannelStats
from sfl_core.fleet import AgentInfo
from sfl_core.privacy import AgentPrivacy
from sfl_core.wire import codec as wire
from sfl_core.wire.protocol import Message

TOTALS = ("rounds", "bytes_up", "bytes_down", "compute_s", "client_s", "transfer_s", "wait_s")
"""An agent's running totals: kept across re-registration and restored from checkpoints."""


_SAVED_FIELDS = tuple(k for k in AgentInfo.__dataclass_fields__ if k not in ("last_seen", "instance", "privacy", "epsilon"))
_saved_values = operator.attrgetter(*_SAVED_FIELDS)
"""An agent's saved values as one tuple, read in C: the checkpoint compares them for every agent every round."""


class Registry:
    """``now`` is the liveness clock: the coordinator passes one that stands still while its
    broker is unreachable, so an outage does not make every agent look silent."""

    def __init__(self, num_classes: int, now: Callable[[], float] = time.monotonic, *,
                 channels: Optional[int] = None, architecture: Optional[str] = None):
        """``channels``: a task run's input channels (the size of the agents' ``channel_stats``);
        ``architecture``: the digest of the run's model (:mod:`sfl_core.model.fingerprint`), which an
        agent that sends its own must match."""
        self.num_classes = num_classes
        self.now = now
        self.channels = channels
        self.architecture = architecture
        self._texts: dict[str, tuple[Any, tuple[Any, ...], str]] = {}
        """Agent -> (profile, a copy of its saved values, its checkpoint entry as ``"id":{...}`` JSON text)."""
        self.agents: dict[str, AgentInfo] = {}
        self.channel_stats: dict[str, ChannelStats] = {}
        """Registered agents' input statistics (``normalize: federated``), until the constants are set."""

    def register(self, msg: Message) -> AgentInfo:
        """Validate a ``register`` body and add or refresh the agent (re-registration keeps its totals)."""
        b = msg.body
        counts = b["label_counts"]
        if len(counts) != self.num_classes or not all(isinstance(c, int) and c >= 0 for c in counts):
            raise wire.WireError(f"register.label_counts: expected {self.num_classes} non-negative ints")
        if sum(counts) != b["num_samples"] or b["num_samples"] <= 0:
            raise wire.WireError("register.num_samples must be positive and equal the sum of label_counts")
        if b["index"] < 0:
            raise wire.WireError(f"register.index must be >= 0, got {b['index']}")
        try:
            profile = profile_from_dict(b["profile"], "register.profile")
        except ConfigError as exc:
            raise wire.WireError(str(exc)) from None
        try:
            privacy = AgentPrivacy.from_description(b.get("privacy", {})).describe()
        except ValueError as exc:
            raise wire.WireError(f"register.privacy: {exc}") from None
        theirs = b.get("architecture")
        if self.architecture is not None and theirs is not None and theirs != self.architecture:
            raise wire.WireError(f"its model is not the run's (architecture {theirs}, the run's {self.architecture}): "
                                 f"install the same model code on the device")
        stats = None
        if "channel_stats" in b:
            if self.channels is None:
                raise wire.WireError("register.channel_stats: this run does not standardise from the devices' data")
            try:
                stats = ChannelStats.from_wire(b["channel_stats"], self.channels)
            except ValueError as exc:
                raise wire.WireError(str(exc)) from None
        old = self.agents.get(msg.sender)
        info = AgentInfo(agent_id=msg.sender, index=b["index"], profile=profile, measured=dict(b["measured"]),
                         label_counts=list(counts), num_samples=b["num_samples"], last_seen=self.now(),
                         privacy=privacy, instance=b.get("instance") or (old.instance if old is not None else ""))
        if old is not None:
            for total in TOTALS:
                setattr(info, total, getattr(old, total))
            info.quarantined = old.quarantined   # registering again does not readmit it: an operator does
        self.agents[msg.sender] = info
        if stats is not None:
            self.channel_stats[msg.sender] = stats
        return info

    def seen(self, agent_id: str) -> None:
        info = self.agents.get(agent_id)
        if info is not None:
            info.last_seen = self.now()

    def set_online(self, agent_id: str, online: bool, instance: str = "") -> None:
        """An agent's MQTT status. An offline status from another process than the one that last
        said online is a dead predecessor's last will, arriving late: it says nothing of the
        running process."""
        info = self.agents.get(agent_id)
        if info is not None:
            if not online and info.instance and instance != info.instance:
                return
            if online:
                info.instance = instance
            info.online = online and info.registered
            if online:
                info.last_seen = self.now()

    def online(self, stale_after_s: float | None = None) -> list[AgentInfo]:
        """Agents whose MQTT status is online and, if ``stale_after_s`` is given, that were heard
        from (any message, heartbeats included) within that many seconds."""
        live = self._live(stale_after_s)
        return [a for a in self.agents.values() if live(a)]

    def offline(self, stale_after_s: float | None = None) -> list[AgentInfo]:
        """The other agents: not :meth:`online` with the same ``stale_after_s``."""
        live = self._live(stale_after_s)
        return [a for a in self.agents.values() if not live(a)]

    def _live(self, stale_after_s: float | None) -> Callable[[AgentInfo], bool]:
        now = self.now()
        if stale_after_s is None:
            return lambda a: a.online
        return lambda a: a.online and now - a.last_seen <= stale_after_s

    def to_json_text(self) -> str:
        """The registry as the checkpoint keeps it, as JSON text. It is written every round, and
        with thousands of registered agents encoding it was most of a round's book-keeping: an
        agent's entry is encoded again only when one of its saved values (or its profile) has
        changed since the last call; the values are compared with a copy taken then, so a list
        changed in place is seen."""
        texts = {}
        for a, i in self.agents.items():
            values = _saved_values(i)
            hit = self._texts.get(a)
            if hit is None or hit[0] is not i.profile or hit[1] != values:
                entry = {**dict(zip(_SAVED_FIELDS, values)), "profile": i.profile.to_dict()}
                # the profile is replaced, never changed (compared by identity above): not copied, so
                # the next comparison finds the same object and skips its field-by-field equality
                hit = (i.profile, copy.deepcopy(values, {id(i.profile): i.profile}),
                       f"{json.dumps(a)}:{json.dumps(entry)}")
            texts[a] = hit
        self._texts = texts
        return "{" + ",".join(hit[2] for hit in texts.values()) + "}"

    def load_totals(self, data: dict[str, Any]) -> None:
        """After --resume, agents re-register; their running totals come from the checkpoint."""
        for a, d in data.items():
            fields = {k: v for k, v in d.items() if k in AgentInfo.__dataclass_fields__}
            fields["profile"] = profile_from_dict(d.get("profile"), f"checkpoint registry.{a}.profile")
            info = AgentInfo(**fields)
            info.online, info.registered = False, False
            self.agents[a] = info


