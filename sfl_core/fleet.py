"""What the coordinator knows of each agent: the record the registry keeps (:class:`AgentInfo`)
and the estimates the methods plan from (:class:`FleetEstimates`).

Methods (:mod:`sfl_core.methods`) plan rounds from these, so they live beside them in
``sfl_core``; the coordinator's registry fills the records from registration and status
messages, and every finished round (measured on a device, or by the virtual clock in a
simulation) feeds the estimates through the method's ``observe``/``record``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from sfl_core.config.run import DeviceProfile, RunConfig, load_profile


@dataclass
class AgentInfo:
    agent_id: str
    index: int
    profile: DeviceProfile
    """As registered (validated like a profile file); ``profile.at_round(r)`` applies its capacity schedule."""
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
    privacy: dict[str, Any] = field(default_factory=dict)
    """The defenses the agent declared at registration (``AgentPrivacy.describe()``), for the record."""
    epsilon: Optional[float] = None
    """DP-SGD's epsilon the agent last reported."""
    registered: bool = True
    """False for an agent known only from a checkpoint: it counts as online once it registers
    again in this session (its status message alone must not start a round it cannot join)."""
    quarantined: str = ""
    """Why the run stopped selecting it ("": it is not): flagged by a defense round after round
    (``robust.quarantine``), until an operator readmits it (``sfl-coord agents readmit``)."""


def fleet_of(cfg: RunConfig, label_counts: Sequence[Sequence[int]] | None = None) -> dict[str, AgentInfo]:
    """The run config's fleet as the coordinator will know it after registration (no
    measurements yet): what plans are predicted from before any agent has spoken.
    ``label_counts``: per agent; None = unknown (empty)."""
    profiles = cfg.agent_profiles()
    counts = label_counts if label_counts is not None else [[] for _ in profiles]
    return {f"agent-{i:03d}": AgentInfo(agent_id=f"agent-{i:03d}", index=i, profile=load_profile(name), measured={},
                                        label_counts=list(c), num_samples=int(sum(c)))
            for i, (name, c) in enumerate(zip(profiles, counts))}


def _measured(info: AgentInfo, key: str, *sub: str) -> float | None:
    """A positive number the agent measured at registration (``measured[key][sub]``), else None."""
    v: Any = info.measured if isinstance(info.measured, dict) else {}
    for k in (key, *sub):
        v = v.get(k) if isinstance(v, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def uplink_rate(info: AgentInfo) -> float:
    """The agent's measured uplink (bytes/s) when it measured one, else its profile's."""
    return _measured(info, "up_bytes_per_s") or info.profile.link_bytes_per_s


def downlink_rate(info: AgentInfo) -> float:
    """The agent's measured downlink (bytes/s) when it measured one, else its profile's."""
    return _measured(info, "down_bytes_per_s") or info.profile.downlink


def compute_s_per_sample(info: AgentInfo, split: int) -> float | None:
    """Client compute seconds per sample at ``split`` as the agent timed it at registration, if it did."""
    return _measured(info, "compute_s_per_sample", str(split))


