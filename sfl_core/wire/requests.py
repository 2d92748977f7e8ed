"""The coordinator's requests beyond the assignment, typed: what each side builds and what an
agent reads, every field range-checked before use (the schema in :mod:`.protocol` did the types)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sfl_core.wire import codec as wire

__all__ = ["EvaluateRequest", "MAX_BOTTLENECKS"]

MAX_BOTTLENECKS = 8
"""Most bottleneck pairs a model may carry (a run has one or two)."""


@dataclass(frozen=True)
class EvaluateRequest:
    """``evaluate`` (federated evaluation): the whole global model to score on the agent's
    held-out split, with its bottlenecks as ``(split, width, infer_width)``."""

    model: str
    weights: dict[str, Any]
    bottlenecks: tuple[tuple[int, int, int], ...]

    def to_body(self) -> dict[str, Any]:
        return {"model": self.model, "weights": self.weights, "bottlenecks": [list(b) for b in self.bottlenecks]}

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> "EvaluateRequest":
        pairs = body["bottlenecks"]
        if len(pairs) > MAX_BOTTLENECKS or not all(
                isinstance(p, list) and len(p) == 3 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                                            for v in p) for p in pairs):
            raise wire.WireError(f"evaluate.bottlenecks: expected up to {MAX_BOTTLENECKS} "
                                 "[split, width, infer_width] lists")
        return cls(body["model"], body["weights"], tuple((p[0], p[1], p[2]) for p in pairs))
