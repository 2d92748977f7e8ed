"""A round shared among server workers (``--server-workers``): the leader's and a worker's side.

The leader plans the round as usual, shares its split agents out among the ranks
(:func:`coordinator.server_workers.shard_agents`), names each agent's rank in its assignment
(``server_worker``: the agent sends its activations to that rank's topic, so no rank receives
another's rows), hands every worker the plan and the model, and waits until each has
subscribed to its agents; each rank then runs the server steps of its
own agents, the ranks' gradients all-reduced at every step. At the end the workers send back
what they counted for their agents (bytes, messages, times), so the leader prices and records
the whole round as one, and what the run's options found on their rows (an agent whose rows
the defense left out), so the leader's aggregation hears of it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from coordinator.server_workers import ServerShards, shard_agents
from coordinator.session import RoundAgent
from coordinator.transport import Transport
from sfl_core.methods.base import RoundPlan
from sfl_core.model.zoo import SplitModel
from sfl_core.options.base import ServerTerms
from sfl_core.wire.assignment import Assignment

log = logging.getLogger("sfl.coord")

__all__ = ["lead", "follow", "counters", "report", "merge_counters"]


def lead(shards: ServerShards, transport: Transport, model: SplitModel, r: int, plan: RoundPlan,
         agents: dict[str, RoundAgent], split_agents: list[str], *, label_counts: dict, population: dict,
         lr: float, terms: ServerTerms, encode: Callable[[dict], dict]) -> list[str]:
    """The leader's start of a round: share out the split agents, broadcast the plan and the
    model, wait for every worker; returns the leader's own agents. ``terms``: what the training
    options ask of the server copies (every rank steps every copy with them; ``encode`` puts the
    corrections on the wire)."""
    if plan.sequential:
        raise RuntimeError("server workers cannot share a sequential server (server_mode: sequential): "
                           "it trains on one agent after another")
    owners = shard_agents(split_agents, shards.world)
    transport.not_mine = frozenset(a for a, rank in owners.items() if rank != 0)
    for a, rank in owners.items():   # the agent sends its rows to its worker's topic, not to ours
        agents[a].assignment = dataclasses.replace(agents[a].assignment, server_worker=rank)
    shards.broadcast({
        "round": r, "owners": owners, "lr": lr,
        "assignments": {a: agents[a].assignment.to_body({}) for a in split_agents},
        "groups": plan.groups, "splits": plan.splits, "widths": plan.widths,
        "infer_widths": {k: pair.infer_width for k, pair in model.bottlenecks.items()},
        "label_counts": label_counts, "population": population,
        "corrections": {a: encode(c) for a, c in terms.corrections.items()}, "proximal": terms.proximal,
        "frozen_norms": terms.frozen_norms, "devices_own_norms": terms.devices_own_norms})
    shards.broadcast_model(model)
    shards.barrier()
    log.info("round %d: server workers' agents: %s", r, "; ".join(
        f"{rank}: {', '.join(a for a, o in owners.items() if o == rank) or '-'}" for rank in range(shards.world)))
    return [a for a in split_agents if owners[a] == 0]


def follow(shards: ServerShards, transport: Transport, model: SplitModel, doc: dict[str, Any],
           now: Callable[[], float]) -> tuple[RoundPlan, dict[str, RoundAgent]]:
    """A worker's start of a round from the leader's broadcast ``doc``: take the leader's model
    and widths, subscribe to this rank's agents; returns the plan and those agents."""
    shards.broadcast_model(model)
    plan = RoundPlan(splits={a: int(s) for a, s in doc["splits"].items()}, groups=doc["groups"],
                     widths={a: int(w) for a, w in doc["widths"].items()})
    for key, width in doc["infer_widths"].items():   # the leader's, resumed or widened
        model.bottlenecks[key].infer_width = int(width)  # type: ignore[assignment]  # a Bottleneck
    mine = [a for a, rank in doc["owners"].items() if rank == shards.rank]
    transport.follow(set(mine))
    shards.barrier()
    t = now()
    return plan, {a: RoundAgent(a, Assignment.from_body(doc["assignments"][a]), last_heard=t, last_sent_at=t)
                  for a in mine}


def counters(ra: RoundAgent) -> dict[str, Any]:
    """What a server worker counted for one of its agents this round (sent to the leader)."""
    return {"bytes_up": ra.bytes_up, "bytes_down": ra.bytes_down, "messages": ra.messages, "busy_s": ra.busy_s,
            "server_s": ra.server_s, "labels_withheld": ra.labels_withheld}


def report(agents: dict[str, RoundAgent], findings: dict[str, Any]) -> dict[str, Any]:
    """A server worker's end of a round, sent to the leader: what it counted for its agents, and
    what the run's options found on their rows (:meth:`RoundOption.worker_findings`, by option key)."""
    return {"agents": {a: counters(ra) for a, ra in agents.items()}, "options": findings}


def merge_counters(shards: ServerShards, transport: Transport, agents: dict[str, RoundAgent],
                   mine: list[str]) -> list[dict[str, Any]]:
    """The leader's end of a round: add what the other workers counted for their agents to what
    the leader counted itself (the assignment and the weights); returns what the options found on
    each other worker's rows (:func:`report`), for the leader's options to merge."""
    transport.not_mine = frozenset()
    found: list[dict[str, Any]] = []
    for doc in shards.gather(report({a: agents[a] for a in mine if a in agents}, {}))[1:]:
        found.append(doc.get("options") or {})
        for a, c in (doc.get("agents") or {}).items():
            ra = agents.get(a)
            if ra is None:
                continue
            ra.bytes_up += c["bytes_up"]
            ra.bytes_down += c["bytes_down"]
            ra.messages += c["messages"]
            ra.server_s += c["server_s"]
            # the leader timed only the weights upload, from the assignment on: the steps are the worker's
            ra.busy_s = c["busy_s"]
            if c["labels_withheld"]:
                ra.labels_withheld = True
    return found
