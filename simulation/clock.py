"""The simulation's clock: round times from the time model, not from a watch."""

from __future__ import annotations

import dataclasses
from typing import Iterable

from coordinator.clock import AgentWork
from sfl_core import timing


class VirtualClock:
    """Times follow the time model (docs/methods/time-model.md) from the agent's profile, its FLOPs and its real encoded bytes."""

    virtual = True

    def __init__(self, offset_s: float = 0.0):
        self._t = offset_s

    @property
    def elapsed(self) -> float:
        return self._t

    def restore(self, elapsed_s: float) -> None:
        self._t = elapsed_s

    def agent_time(self, work: AgentWork) -> timing.AgentTime:
        """The time model's round; with steps in flight, less what they overlap
        (:func:`sfl_core.timing.pipeline_overlap_s`)."""
        p = work.profile
        parts = timing.agent_round_time(
            client_flops=work.client_flops, server_flops=work.server_flops, bytes_up=work.bytes_up,
            bytes_down=work.bytes_down, client_flops_per_s=p.compute_flops, server_flops_per_s=work.server_flops_per_s,
            uplink_bytes_per_s=p.link_bytes_per_s, downlink_bytes_per_s=p.downlink, latency_s=p.latency_s,
            messages=work.messages, coordinator_s=work.coordinator_s,
        )
        if work.window <= 1:
            return parts
        return dataclasses.replace(parts, overlap_s=timing.pipeline_overlap_s(
            steps=work.steps, window=work.window, client_s=parts.client_compute_s,
            up_s=work.step_bytes_up / p.link_bytes_per_s, down_s=work.step_bytes_down / p.downlink,
            server_s=parts.server_compute_s + parts.coordinator_s, latency_s=p.latency_s, half_duplex=p.half_duplex,
            both_ways=p.both_ways))

    def end_round(self, agent_times: Iterable[float], wall_s: float) -> float:
        t = timing.round_time(agent_times)
        self._t += t
        return t
