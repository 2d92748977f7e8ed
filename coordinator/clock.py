"""The deployment's clock: round times as the coordinator measures them.

The clock is the only thing, besides the transport, that differs between a deployment
(``sfl-coord serve``, this :class:`WallClock`) and a simulation (``sfl-coord simulate``,
:class:`simulation.clock.VirtualClock`, which charges the time model instead)."""

from __future__ import annotations

import time
from typing import Iterable

from sfl_core import timing


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
