"""Federated evaluation (``eval.federated_every``): the devices score the global model on their
held-out splits, and the round's metrics keep each device's figures and their weighted mean.

Why on the devices: in a run on the devices' own data the server may hold no validation data
at all, and even where it does, the devices' held-out photos are the distribution the model
is for. Only the loss, the number correct and the count leave a device.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

from sfl_core.data.preprocessing import Normalization
from sfl_core.model.zoo import SplitModel
from sfl_core.wire import codec as wire
from sfl_core.wire.protocol import Message
from sfl_core.wire.requests import EvaluateRequest

__all__ = ["request_body", "summarise"]


def request_body(model: SplitModel, name: str, zstd_level: int, norm: Optional[Normalization]) -> dict[str, Any]:
    """An ``evaluate`` body: the whole global model, its bottlenecks and the run's constants."""
    body = EvaluateRequest(name, wire.encode_state(model.state_dict(), zstd_level),
                           tuple((int(s), int(p.width), int(p.infer_width))  # type: ignore[arg-type]
                                 for s, p in model.bottlenecks.items())).to_body()
    if norm is not None:
        body["normalize"] = norm.to_wire()
    return body


def summarise(replies: Mapping[str, Message], reject: Callable[[str], None]) -> dict[str, Any]:
    """Each device's accuracy, loss and count (devices without a held-out split left out), and
    the count-weighted means; an impossible reply is rejected (``reject(why)``) and left out."""
    per_agent: dict[str, dict[str, Any]] = {}
    for a, msg in replies.items():
        b = msg.body
        if not (0 <= b["correct"] <= b["count"]) or not math.isfinite(b["loss"]) or b["loss"] < 0:
            reject(f"evaluation from {a}: correct {b['correct']} of {b['count']}, loss {b['loss']}")
            continue
        if b["count"]:
            per_agent[a] = {"accuracy": b["correct"] / b["count"], "loss": float(b["loss"]), "count": b["count"]}
    total = sum(v["count"] for v in per_agent.values())

    def mean(key: str) -> Optional[float]:
        return sum(v[key] * v["count"] for v in per_agent.values()) / total if total else None
    return {"accuracy": mean("accuracy"), "loss": mean("loss"), "count": total, "agents": per_agent}

