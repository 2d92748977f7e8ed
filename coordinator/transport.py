"""What the round engine needs from the network: the :class:`Transport` protocol.

A deployment's transport is :class:`coordinator.mqtt_transport.MqttTransport`; a simulation's
are in :mod:`simulation`. Everything the engine and its fleet session use is declared here,
so a new transport (another broker protocol, a test double) knows what to provide;
:class:`LocalTransport` holds what a transport without a broker, server workers or a run
description to amend gives by default.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional, Protocol

from sfl_core.wire.protocol import Message, Rejections


class Transport(Protocol):
    not_mine: frozenset[str]
    """Agents another server worker serves: their step messages are not for this process."""

    @property
    def rejections(self) -> Optional[Rejections]:
        """Messages the transport refused before the engine saw them (undecodable, spoofed), by reason."""

    @property
    def probed(self) -> Optional[Mapping[str, None]]:
        """Agents that measured their link against us (a registration must follow a probe); None:
        the transport does not probe, every registration may be taken."""

    def send(self, agent_id: str, msg: Message) -> int:
        """Deliver ``msg`` to one agent; return the bytes it took on the wire."""

    def send_many(self, messages: list[tuple[str, Message]]) -> list[int]:
        """:meth:`send` for several (agent, message) pairs at once (a step's gradients): a
        transport may hand them all to the network before waiting for any acknowledgement."""

    def poll(self, timeout: float) -> Optional[Message]:
        """Next validated message from any agent, or None after ``timeout`` seconds."""

    def live_time(self) -> float:
        """A monotonic clock that stands still while the agents cannot be reached (MQTT: the
        broker is down): silence and resend timers are measured on it."""

    def outages(self) -> int:
        """Times the link to the agents was lost so far (MQTT: the broker connection dropped)."""

    def loss_hint(self, in_flight: int) -> str:
        """Why messages to and from agents may be lost on a link that stayed up, for the operator,
        with ``in_flight`` the most the round's agents keep in flight at once ("": no reason to give)."""

    def follow(self, agents: set[str]) -> None:
        """Server workers: receive the step messages of these agents too."""

    def amend_run_info(self, **fields: Any) -> None:
        """Add ``fields`` to the run description agents read (e.g. the fleet's standardisation)."""


class LocalTransport:
    """The defaults of a transport without a broker: no probes, no refusals of its own, one
    server process, no run description on the wire, and the host's monotonic clock."""

    not_mine: frozenset[str] = frozenset()
    rejections: Optional[Rejections] = None
    probed: Optional[Mapping[str, None]] = None

    def live_time(self) -> float:
        return time.monotonic()

    def outages(self) -> int:
        return 0

    def loss_hint(self, in_flight: int) -> str:
        return ""

    def send_many(self, messages: list[tuple[str, Message]]) -> list[int]:
        return [self.send(agent, msg) for agent, msg in messages]   # type: ignore[attr-defined]

    def follow(self, agents: set[str]) -> None:
        return None

    def amend_run_info(self, **fields: Any) -> None:
        return None
