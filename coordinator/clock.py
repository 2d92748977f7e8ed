"""Wall and virtual clocks: the only thing, besides the transport, that differs between
a deployment (``sfl-coord serve``) and a simulation (``sfl-coord simulate``)."""

from __future__ import annotations

import time
from typing import Iterable

from sfl_core import timing
from sfl_core.config.run import DeviceProfile


class WallClock:
    """Times are what the coordinator measures: assignment sent -> weights received."""

    virtual = False

    def __init__(self, offset_s: float = 0.0):
        self._start = time.monotonic() - offset_s

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def restore(self, elapsed_s: float) -> None:
        self._start = time.monotonic() - elapsed_s

    def agent_time(self, *, measured_s: float, compute_s: float = 0.0, server_s: float = 0.0,
                   **_: float) -> timing.AgentTime:
        """Measured: the agent's reported compute, the rest of its response time as transfer."""
        busy = max(measured_s - server_s, 0.0)
        return timing.AgentTime(client_compute_s=min(compute_s, busy), transfer_s=max(busy - compute_s, 0.0),
                                server_compute_s=measured_s - busy)

    def end_round(self, agent_times: Iterable[float], wall_s: float) -> float:
        return wall_s


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
