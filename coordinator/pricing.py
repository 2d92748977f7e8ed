"""Each completed agent's round priced by the run's clock (:mod:`coordinator.clock`): measured
seconds in a deployment, the time model's in a simulation. The prices become the round's
per-agent metrics rows and the registry's running totals, and what the method learns from
(:class:`sfl_core.methods.base.AgentRound`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from coordinator.clock import AgentWork, Clock
from coordinator.round_record import agent_row
from coordinator.session import RoundAgent
from sfl_core import timing
from sfl_core.fleet import AgentInfo
from sfl_core.methods.base import AgentRound
from sfl_core.model.accounting import SplitCost
from sfl_core.wire.protocol import Message

__all__ = ["price_round", "price_phase"]


def price_round(r: int, clock: Clock, costs: Mapping[int, SplitCost], infos: Mapping[str, AgentInfo],
                agents: Mapping[str, RoundAgent], uploads: Mapping[str, Message], done: Sequence[str], *,
                server_flops: float, per_agent_step_s: float = 0.0
                ) -> tuple[dict[str, dict[str, Any]], dict[str, float], list[AgentRound]]:
    """Price round ``r`` for the agents in ``done``: their metrics rows, their seconds, and the
    observations for the method. Adds to each agent's totals in ``infos`` (the registry's).
    ``per_agent_step_s``: the run's ``agent_step_overhead_s``, what a time-model clock charges
    each split agent for the coordinator's handling of the round's split agents' steps."""
    per_agent, times, observed = {}, {}, []
    split_agents = sum(not agents[a].assignment.whole_model for a in agents)
    for a in done:
        ra, info = agents[a], infos[a]
        cost = costs[ra.assignment.split]
        samples = ra.assignment.batch_size * ra.assignment.tau
        parts = clock.agent_time(AgentWork(
            measured_s=ra.busy_s + ra.server_s, compute_s=ra.compute_s, server_s=ra.server_s,
            client_flops=cost.client_flops * samples, server_flops=cost.server_flops * samples,
            bytes_up=ra.bytes_up, bytes_down=ra.bytes_down, messages=ra.messages,
            profile=info.profile.at_round(r), server_flops_per_s=server_flops,
            coordinator_s=0.0 if ra.assignment.whole_model else timing.step_overhead_s(
                per_agent_step_s, steps=ra.assignment.tau, split_agents=split_agents),
            steps=ra.assignment.tau, window=ra.assignment.window, step_bytes_up=ra.step_bytes_up,
            step_bytes_down=ra.step_bytes_down))
        t = times[a] = parts.total_s
        act = 0 if ra.assignment.whole_model else math.prod(ra.assignment.activation_shape) * 4
        observed.append(AgentRound(
            a, info, ra.assignment.split, ra.assignment.codec, samples, compute_s=parts.client_compute_s,
            transfer_s=parts.transfer_s, profile=info.profile.at_round(r),
            weights_bytes=uploads[a].wire_bytes, messages=ra.messages, wire_bytes=ra.bytes_up + ra.bytes_down,
            fp32_bytes=2 * cost.client_param_bytes + 2 * samples * act,
            step_jitter_s=0.0 if clock.virtual else ra.step_jitter_s,
            weights_phase_s=0.0 if clock.virtual else ra.weights_phase_s,
            step_bytes=(ra.step_bytes_up, ra.step_bytes_down)))
        info.rounds += 1
        info.bytes_up += ra.bytes_up
        info.bytes_down += ra.bytes_down
        info.compute_s += ra.compute_s
        per_agent[a] = agent_row(ra, parts, t)
        if info.privacy:   # what the agent declared it applies; epsilon as it reported it
            per_agent[a]["privacy"] = info.privacy
        if "epsilon" in uploads[a].body:
            info.epsilon = per_agent[a]["epsilon"] = float(uploads[a].body["epsilon"])
    slowest = max(times.values(), default=0.0)
    for a in done:
        info, row = infos[a], per_agent[a]
        info.client_s += row["client_s"]
        info.transfer_s += row["transfer_s"]
        info.wait_s += slowest - times[a]
    return per_agent, times, observed


def price_phase(r: int, clock: Clock, costs: Mapping[int, SplitCost], infos: Mapping[str, AgentInfo],
                agents: Mapping[str, RoundAgent], *, samples: int, server_flops: float) -> dict[str, Any]:
    """Price round ``r``'s phase after aggregation (an option's: a statistics pass) for the agents that answered:
    its download and upload, ``samples`` forward passes on the agent and on the server (a third
    of a training step's FLOPs each). Returns the pass's ``times`` per agent (a phase of the
    round of its own), its agents, bytes and slowest agent's parts. Adds to each agent's totals."""
    times, bytes_up, bytes_down = {}, 0, 0
    for a, ra in agents.items():
        info, cost = infos[a], costs[ra.assignment.split]
        parts = clock.agent_time(AgentWork(
            measured_s=ra.busy_s + ra.server_s, compute_s=ra.compute_s, server_s=ra.server_s,
            client_flops=cost.client_flops * samples / 3, server_flops=cost.server_flops * samples / 3,
            bytes_up=ra.bytes_up, bytes_down=ra.bytes_down, messages=ra.messages,
            profile=info.profile.at_round(r), server_flops_per_s=server_flops))
        times[a] = parts.total_s
        bytes_up += ra.bytes_up
        bytes_down += ra.bytes_down
        info.bytes_up += ra.bytes_up
        info.bytes_down += ra.bytes_down
        info.compute_s += ra.compute_s
    return {"agents": sorted(agents), "bytes_up": bytes_up, "bytes_down": bytes_down, "times": times}

