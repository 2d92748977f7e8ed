"""The simulation's clock: round times from the time model, not from a watch."""

from __future__ import annotations

from typing import Iterable

from sfl_core import timing
from sfl_core.config.run import DeviceProfile


class VirtualClock:
    """Times follow the time model (docs/methods.md §3) from the agent's profile, its FLOPs and its real encoded bytes."""

    virtual = True

    def __init__(self, offset_s: float = 0.0):
        self._t = offset_s

    @property
    def elapsed(self) -> float:
        return self._t

    def restore(self, elapsed_s: float) -> None:
        self._t = elapsed_s

    def agent_time(self, *, client_flops: float, server_flops: float, bytes_up: float, bytes_down: float,
                   profile: DeviceProfile, server_flops_per_s: float, messages: int, **_: float) -> timing.AgentTime:
        return timing.agent_round_time(
            client_flops=client_flops, server_flops=server_flops, bytes_up=bytes_up, bytes_down=bytes_down,
            client_flops_per_s=profile.compute_flops, server_flops_per_s=server_flops_per_s,
            uplink_bytes_per_s=profile.link_bytes_per_s, downlink_bytes_per_s=profile.downlink,
            latency_s=profile.latency_s, messages=messages,
        )

    def end_round(self, agent_times: Iterable[float], wall_s: float) -> float:
        t = timing.round_time(agent_times)
        self._t += t
        return t
