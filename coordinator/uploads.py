"""What agents send during a round, decoded and validated against their assignment before it
touches the server model: activations (and labels), and the logit gradients of agents that
withhold their labels. Each function raises :class:`sfl_core.wire.codec.WireError` with the
reason; the caller rejects the message and drops the agent from the round.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from sfl_core.wire import codec as wire
from sfl_core.wire.assignment import Assignment

__all__ = ["decode_activations", "decode_logit_gradients"]


def decode_activations(body: dict[str, Any], assignment: Assignment, num_classes: int,
                       out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One step's activations ``(batch, *activation_shape)``, float32 or float16 and finite, and
    its labels in ``0..num_classes-1`` (None: the agent withholds them and scores its own
    logits, as MergeSFL's agents may). ``out``: where to decode the activations (their place
    in the step's merged batch, :meth:`coordinator.server_trainer.ServerTrainer.place_rows`)."""
    b = assignment.batch_size
    x = wire.decode_tensor(body["x"], shape=(b, *assignment.activation_shape), dtypes=("float32", "float16"), out=out)
    y = None if body["y"] is None else wire.decode_tensor(body["y"], shape=(b,), dtypes=("int64",))
    if not wire.all_finite(x):
        raise wire.WireError("activations contain NaN or Inf")
    if y is not None and (y.min() < 0 or y.max() >= num_classes):
        raise wire.WireError(f"labels outside 0..{num_classes - 1}")
    return x, y


def decode_logit_gradients(body: dict[str, Any], shape: tuple[int, ...]) -> tuple[torch.Tensor, float]:
    """The gradient of an agent's mean loss w.r.t. the logits it was sent (same shape, finite),
    and that loss (finite)."""
    g = wire.decode_tensor(body["g"], shape=shape, dtypes=("float32", "float16"))
    loss = float(body["loss"])
    if not wire.all_finite(g) or not math.isfinite(loss):
        raise wire.WireError("logit gradients or loss not finite")
    return g, loss
