"""What the coordinator knows of each agent: the record the registry keeps and the methods read.

Methods (:mod:`sfl_core.methods`) plan rounds from these records, so they live beside them in
``sfl_core``; the coordinator's registry fills them from registration and status messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class AgentInfo:
    agent_id: str
    index: int
    profile: dict[str, Any]
    measured: dict[str, Any]
    label_counts: list[int]
    num_samples: int
    online: bool = True
    last_seen: float = 0.0
    """On the registry's liveness clock (see :class:`Registry`)."""
    instance: str = ""
    """The agent process that last said it is online (its status messages carry it)."""
    rounds: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    compute_s: float = 0.0
    """Compute seconds as the agent reported them: the device's on a device, the host's in a simulation."""
    client_s: float = 0.0
    transfer_s: float = 0.0
    wait_s: float = 0.0
    """Client compute, transfer and waiting-for-the-slowest seconds by the run's clock: measured
    in a deployment, from the time model (the profile) in a simulation."""
    registered: bool = True
    """False for an agent known only from a checkpoint: it counts as online once it registers
    again in this session (its status message alone must not start a round it cannot join)."""


def uplink_rate(info: AgentInfo) -> float:
    """The agent's measured uplink (bytes/s) when it measured one, else its profile's."""
    measured = info.measured.get("up_bytes_per_s") if isinstance(info.measured, dict) else None
    return float(measured) if isinstance(measured, (int, float)) and measured > 0 else float(info.profile["link_bytes_per_s"])
