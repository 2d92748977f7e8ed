"""A finished round as ``metrics.jsonl`` records it: one JSON object per round.

The keys are the run's public record (``docs/commands.md`` lists them; ``sfl-coord status``,
the live page and the benchmarks read them), so they are built in one place.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from coordinator.session import RoundAgent
from sfl_core import timing
from sfl_core.methods.base import RoundPlan
from sfl_core.privacy import privacy_summary


def agent_row(ra: RoundAgent, parts: timing.AgentTime, time_s: float) -> dict[str, Any]:
    """One agent's entry in the round's ``agents``. ``compute_s``: as the agent reported it
    (host time in a simulation); ``client_s`` and ``transfer_s``: by the run's clock (the time
    model in a simulation); ``coordinator_s`` where the time model charged the coordinator's
    step overhead (``agent_step_overhead_s``)."""
    row = {"compute_s": round(ra.compute_s, 4), "time_s": round(time_s, 4),
           "client_s": round(parts.client_compute_s, 4), "transfer_s": round(parts.transfer_s, 4),
           "server_s": round(ra.server_s, 4), "bytes_up": ra.bytes_up,
           "bytes_down": ra.bytes_down, "split": ra.assignment.split,
           "whole_model": ra.assignment.whole_model,
           "width": ra.assignment.width, "codec": ra.assignment.codec,
           "batch_size": ra.assignment.batch_size, "lr": ra.assignment.lr,
           "labels_withheld": ra.labels_withheld}
    if parts.coordinator_s:
        row["coordinator_s"] = round(parts.coordinator_s, 4)
    if ra.assignment.window > 1:   # steps it kept in flight, and the seconds they overlapped (a time-model clock's)
        row["window"] = ra.assignment.window
        if parts.overlap_s:
            row["overlap_s"] = round(parts.overlap_s, 4)
    return row


def round_record(r: int, *, accuracy: Optional[float], test_loss: Optional[float], train_loss: Optional[float],
                 round_s: float, elapsed_s: float, virtual: bool, wall_s: float, eval_s: float,
                 times: Mapping[str, float],
                 per_agent: dict[str, dict[str, Any]], plan: RoundPlan, done: list[str],
                 rejected: dict[str, int], federated: Optional[dict[str, Any]],
                 method_metrics: dict[str, Any], phases: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, Any]:
    """Round ``r``'s record: accuracy and losses, times by the run's clock, bytes, who was selected
    and who completed, per agent what it did, what was rejected, and what the method adds.
    ``phases``: the round's phases after aggregation by the option that ran them (a statistics
    pass under ``norm_stats``), their bytes in the totals."""
    record = {
        "round": r, "accuracy": accuracy, "test_loss": test_loss, "train_loss": train_loss,
        "round_time_s": round(round_s, 4), "elapsed_s": round(elapsed_s, 4),
        "clock": "virtual" if virtual else "wall", "wall_s": round(wall_s, 4), "eval_s": round(eval_s, 4),
        "waiting_s": round(timing.waiting_time(times.values()), 4),
        "bytes_up": sum(p["bytes_up"] for p in per_agent.values()),
        "bytes_down": sum(p["bytes_down"] for p in per_agent.values()),
        # selected: who was assigned the round (an agent dropped mid-round stays listed); completed: who counted
        "selected": sorted(plan.splits), "completed": sorted(done), "groups": plan.groups, "phase": plan.phase,
        "agents": per_agent, "rejected": rejected,
    }
    if federated is not None:
        record["federated"] = federated
    for key, phase in (phases or {}).items():
        record[key] = phase
        record["bytes_up"] += phase["bytes_up"]
        record["bytes_down"] += phase["bytes_down"]
    record.update(method_metrics)
    record.update(privacy_summary(per_agent))
    return record
