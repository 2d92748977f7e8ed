"""How often an agent says it is alive, and when the coordinator takes silence for absence.

Two signals keep the coordinator's view of the fleet current:

- **Presence** comes from the broker: each agent's retained ``status`` and its last will, which
  the broker publishes when the agent's connection dies (within 1.5 MQTT keep-alives). It costs
  the coordinator one message per agent that comes or goes, whatever the fleet's size.
- **Heartbeats** are the agent's own ``heartbeat`` messages. In a round they matter: they say
  "still computing" (busy) or "your message never arrived" (idle: the coordinator resends it),
  and silence for ``step_timeout_s`` drops the agent from the round. Between rounds they only
  back up presence, and a fleet of 10,000 beating every 2 s would send 5,000 messages a second,
  cores of coordinator CPU for nothing.

So an agent beats every ``heartbeat_s`` (2 s) while it works for the coordinator (from an
assignment until it has been quiet for one idle interval) and every :func:`idle_heartbeat_s`
otherwise: the interval the coordinator announces in its run description, sized so that the
whole idle fleet sends at most :data:`IDLE_BEATS_PER_S` messages a second. Any other message the
agent sends counts as a beat (:func:`due`), so agents busy with a round's steps send almost none.
An idle agent is taken for gone after :func:`stale_after_s` without a message (its will normally
says so first).
"""

from __future__ import annotations

import math
from typing import Any

BUSY_HEARTBEAT_S = 2.0
"""An agent's heartbeat interval while it works for the coordinator (and a small fleet's always)."""
IDLE_BEATS_PER_S = 50.0
"""Heartbeats per second the coordinator budgets for its whole idle fleet."""
MAX_IDLE_HEARTBEAT_S = 120.0
"""The longest idle interval: presence then rests on the broker's last will."""
_CORE_WORK = frozenset({"assign", "gradients", "logits", "evaluate"})


def __getattr__(name: str) -> Any:
    """``WORK_TYPES``: coordinator messages that start or continue a round's work, the core's
    and the training options' requests: after one, an agent beats every
    :data:`BUSY_HEARTBEAT_S` for an idle interval (its silence is then what drops it from the round)."""
    if name != "WORK_TYPES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from sfl_core.wire import protocol   # the options' messages are read on first use
    value = globals()[name] = _CORE_WORK | protocol.OPTION_COORD_TYPES   # read once
    return value
MISSED_BEATS = 3
"""Idle heartbeats an agent may miss before its silence counts as absence."""


def idle_heartbeat_s(fleet_size: int) -> float:
    """The idle agents' heartbeat interval for a fleet of ``fleet_size``: ``fleet_size /
    IDLE_BEATS_PER_S`` seconds, from :data:`BUSY_HEARTBEAT_S` (fleets up to 100 beat as before)
    to :data:`MAX_IDLE_HEARTBEAT_S`."""
    return min(MAX_IDLE_HEARTBEAT_S, max(BUSY_HEARTBEAT_S, fleet_size / IDLE_BEATS_PER_S))


def stale_after_s(step_timeout_s: float, idle_s: float) -> float:
    """Silence after which a registered agent no longer counts as online: the step timeout, or
    :data:`MISSED_BEATS` idle intervals where those are longer."""
    return max(step_timeout_s, MISSED_BEATS * idle_s)


def agreed_idle_s(announced: object, busy_s: float) -> float:
    """The idle interval an agent uses: the coordinator's (``run_info.heartbeat_idle_s``) when it
    is a finite number, never shorter than the agent's own ``busy_s`` nor longer than
    :data:`MAX_IDLE_HEARTBEAT_S`; ``busy_s`` when the coordinator announces none (older versions)."""
    if isinstance(announced, bool) or not isinstance(announced, (int, float)) or not math.isfinite(announced):
        return busy_s
    return min(MAX_IDLE_HEARTBEAT_S, max(busy_s, float(announced)))


def due(now: float, last_sent: float, last_work: float, busy: bool, busy_s: float, idle_s: float) -> bool:
    """Whether an agent that checks every ``busy_s`` sends a heartbeat at this check.

    The interval is ``busy_s`` while it computes or has heard from the coordinator within the
    last ``idle_s`` (a round in progress), else ``idle_s``. A beat is due once that interval,
    less half a check, has passed since ``last_sent``: the agent's last message to the
    coordinator of any kind, because every message refreshes the coordinator's *last heard*
    (an agent answering steps several times a second needs no heartbeat; MQTT's keep-alive
    skips its PINGREQ after other traffic for the same reason). A round's silence between
    messages is then at most 1.5 ``busy_s``."""
    interval = busy_s if busy or now - last_work < idle_s else idle_s
    return now - last_sent >= interval - busy_s / 2
