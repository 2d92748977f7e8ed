"""What the coordinator asks of one agent for one round, and its validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sfl_core.wire import codec as wire
from sfl_core.wire import protocol

SPLIT_TRAINING = "sfl"
"""The agent trains its client portion step by step with the server (activations up, gradients down)."""
WHOLE_MODEL = "fedavg"
"""The agent trains the whole model locally and sends only its weights."""
MODES = (SPLIT_TRAINING, WHOLE_MODEL)
"""What an agent may be asked to do in a round: the assignment's ``strategy`` on the wire (the
field keeps that name for compatibility; it is the agent's mode, not the run's method)."""
MAX_BATCH = 4096
MAX_TAU = 10_000
MAX_WINDOW = 16
"""The most steps an assignment may keep in flight (``window``)."""
MAX_SERVER_WORKERS = 1024
"""The most server workers an assignment may name (``server_worker`` < this)."""


@dataclass(frozen=True)
class Assignment:
    """One round's instructions. ``split == num_blocks`` means the whole model runs on the
    agent (FedAvg); ``width == 0`` means no bottleneck layer."""

    model: str
    mode: str
    """:data:`SPLIT_TRAINING` or :data:`WHOLE_MODEL` (``strategy`` on the wire)."""
    split: int
    width: int
    batch_size: int
    lr: float
    momentum: float
    tau: int
    codec: str
    zstd_level: int
    activation_shape: tuple[int, ...]
    window: int = 1
    """Steps the agent may keep in flight: it sends the next step's activations before the last
    step's gradients arrive, at most ``window`` unanswered (1: lock-step). On the wire only when
    over 1, so a lock-step assignment is what it always was."""
    server_worker: int = 0
    """The server worker that trains this agent's rows (``serve --server-workers``): its
    activations go to that worker's topic (:func:`sfl_core.wire.protocol.up_topic`). On the wire
    only when over 0 (the leader), like ``window``."""

    @property
    def whole_model(self) -> bool:
        """The agent trains the whole model locally and sends only its weights (no per-step exchange)."""
        return self.mode == WHOLE_MODEL

    def to_body(self, weights: dict[str, Any]) -> dict[str, Any]:
        return {"model": self.model, "strategy": self.mode, "split": self.split, "width": self.width,
                "batch_size": self.batch_size, "lr": float(self.lr), "momentum": float(self.momentum),
                "tau": self.tau, "codec": self.codec, "zstd_level": self.zstd_level,
                "activation_shape": list(self.activation_shape), "weights": weights,
                **({"window": self.window} if self.window > 1 else {}),
                **({"server_worker": self.server_worker} if self.server_worker else {})}

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> "Assignment":
        """Range-check every field; the schema check in :mod:`sfl_core.wire.protocol` did the types."""
        def bad(field: str, why: str) -> wire.WireError:
            return wire.WireError(f"assign.{field}: {why}")
        if body["strategy"] not in MODES:
            raise bad("strategy", f"{body['strategy']!r} not one of {MODES}")
        if not wire.is_codec(body["codec"]):
            raise bad("codec", f"{body['codec']!r} not one of {wire.CODECS} or {wire.TOPK_PATTERN}")
        if not 1 <= body["batch_size"] <= MAX_BATCH:
            raise bad("batch_size", f"{body['batch_size']} outside 1..{MAX_BATCH}")
        if not 1 <= body["tau"] <= MAX_TAU:
            raise bad("tau", f"{body['tau']} outside 1..{MAX_TAU}")
        if not 0 < body["lr"] <= 10:  # also rejects NaN
            raise bad("lr", f"{body['lr']} outside (0, 10]")
        if not 0 <= body["momentum"] < 1:
            raise bad("momentum", f"{body['momentum']} outside [0, 1)")
        if body["split"] < 1:
            raise bad("split", f"{body['split']} must be >= 1 (the model checks its own upper bound)")
        if body["width"] < 0:
            raise bad("width", f"{body['width']} must be >= 0 (0 = no bottleneck)")
        if not 0 <= body["zstd_level"] <= 22:
            raise bad("zstd_level", "must be in 0..22")
        window = body.get("window", 1)
        if not 1 <= window <= MAX_WINDOW:
            raise bad("window", f"{window} outside 1..{MAX_WINDOW}")
        server_worker = body.get("server_worker", 0)
        if not 0 <= server_worker < MAX_SERVER_WORKERS:
            raise bad("server_worker", f"{server_worker} outside 0..{MAX_SERVER_WORKERS - 1}")
        protocol.check_option_fields(body)   # what the run's training options add
        shape = body["activation_shape"]
        if len(shape) > 6 or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise bad("activation_shape", f"bad shape {shape}")
        return cls(model=body["model"], mode=body["strategy"], split=body["split"], width=body["width"],
                   batch_size=body["batch_size"], lr=float(body["lr"]), momentum=float(body["momentum"]),
                   tau=body["tau"], codec=body["codec"], zstd_level=body["zstd_level"],
                   activation_shape=tuple(shape), window=window, server_worker=server_worker)
