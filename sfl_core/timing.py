"""The timing model of docs/methods.md §3, shared by the profiler, the planner and the virtual clock.

Keeping it in one place is what makes simulated time-to-accuracy comparable with a real
deployment: the virtual clock charges exactly what the planner predicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

@dataclass(frozen=True)
class AgentTime:
    """One agent's share of a round: compute on the agent, transfer, compute on the server."""

    client_compute_s: float
    transfer_s: float
    server_compute_s: float

    @property
    def total_s(self) -> float:
        return self.client_compute_s + self.transfer_s + self.server_compute_s


def agent_round_time(
    *,
    client_flops: float,
    server_flops: float,
    bytes_up: float,
    bytes_down: float,
    client_flops_per_s: float,
    server_flops_per_s: float,
    uplink_bytes_per_s: float,
    downlink_bytes_per_s: float,
    latency_s: float = 0.0,
    messages: int = 0,
) -> AgentTime:
    """S2FL Eq. 1 with the transfer split by direction: ``T = bytes/R + F_c/Comp_c + F_s/Comp_s``.

    ``bytes_up``/``bytes_down`` are the real encoded bytes (weights, activations, gradients),
    so codec choices show up in the virtual clock; ``messages`` one-way latencies are added.
    """
    transfer = bytes_up / uplink_bytes_per_s + bytes_down / downlink_bytes_per_s + messages * latency_s
    return AgentTime(
        client_compute_s=client_flops / client_flops_per_s,
        transfer_s=transfer,
        server_compute_s=server_flops / server_flops_per_s if server_flops else 0.0,
    )


def round_time(times: Iterable[float]) -> float:
    """A synchronous round lasts as long as its slowest agent."""
    return max(times, default=0.0)


def waiting_time(times: Iterable[float]) -> float:
    """MergeSFL's waiting time: mean over agents of (slowest - own)."""
    ts = list(times)
    if not ts:
        return 0.0
    slowest = max(ts)
    return sum(slowest - t for t in ts) / len(ts)
