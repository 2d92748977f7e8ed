"""What the round engine needs from a clock (:class:`Clock`), and the deployment's own.

The clock is the only thing, besides the transport, that differs between a deployment
(``sfl-coord serve``: :class:`WallClock`, round times as the coordinator measures them) and a
simulation (``sfl-coord simulate``: :class:`simulation.clock.VirtualClock`, which charges the
time model instead). Both price one agent's round from the same :class:`AgentWork`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Protocol

from sfl_core import timing
from sfl_core.config.run import DeviceProfile


@dataclass(frozen=True)
class AgentWork:
    """One agent's round as the engine saw it: what a clock prices."""

    measured_s: float
    """Wall seconds from its assignment to its weights, the server steps for its rows included."""
    compute_s: float
    """Compute seconds the agent reported."""
    server_s: float
    """Wall seconds of the server steps its rows were in."""
    client_flops: float
    server_flops: float
    bytes_up: int
    bytes_down: int
    """The real encoded bytes both ways."""
    messages: int
    profile: DeviceProfile
    """Its device profile in this round (capacity schedule applied)."""
    server_flops_per_s: float
    coordinator_s: float = 0.0
    """What the time model charges for the coordinator's handling of the round's step messages
    (:func:`sfl_core.timing.step_overhead_s`); a wall clock measures it instead."""
    steps: int = 0
    window: int = 1
    """Its steps, and the most it had in flight (1: lock-step)."""
    step_bytes_up: int = 0
    step_bytes_down: int = 0
    """The activations' and gradients' encoded bytes (the part of the transfer a window overlaps)."""


class Clock(Protocol):
    virtual: bool
    """True where times follow the time model rather than a watch."""

    @property
    def elapsed(self) -> float:
        """Seconds since the run started, by this clock."""

    def restore(self, elapsed_s: float) -> None:
        """Continue from a checkpoint's elapsed time."""

    def agent_time(self, work: AgentWork) -> timing.AgentTime:
        """One agent's round, split into client compute, transfer and server compute."""

    def end_round(self, agent_times: Iterable[float], wall_s: float) -> float:
        """The round's duration from its agents' times (the slowest) or the wall; advance."""


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

    def agent_time(self, work: AgentWork) -> timing.AgentTime:
        """Measured: the agent's reported compute, the rest of its response time as transfer."""
        busy = max(work.measured_s - work.server_s, 0.0)
        return timing.AgentTime(client_compute_s=min(work.compute_s, busy),
                                transfer_s=max(busy - work.compute_s, 0.0), server_compute_s=work.measured_s - busy)

    def end_round(self, agent_times: Iterable[float], wall_s: float) -> float:
        return wall_s
