"""The coordinator's side of ``norm_stats: federated`` (:mod:`sfl_core.options.norm_stats.stats`): what a
statistics pass asks of a device, how its answer is checked, and the server portion's share.

A device's answer is untrusted input like any other: the layers must be exactly its client
portion's BatchNorm layers, every tensor the layer's channel count, every number finite, the
counts whole multiples of the samples asked for, and the activations the shape the assignment
fixed. An answer that fails is rejected and left out; the statistics then come from the rest.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sfl_core.model.zoo import SplitModel
from sfl_core.options.norm_stats import stats as norm_stats
from sfl_core.options.norm_stats.stats import Moments
from sfl_core.wire import codec as wire

__all__ = ["request_body", "check_reply", "server_moments"]

MAX_ELEMENTS_PER_SAMPLE = 1 << 24
"""A layer's count per sample is its spatial size: far below this for any model that fits a device."""


def request_body(model_name: str, split: int, width: int, weights: dict[str, Any], *, batches: int,
                 batch_size: int, codec: str, zstd_level: int, activation_shape: tuple[int, ...]) -> dict[str, Any]:
    """A ``norm_pass`` body: the new global client portion (encoded once per split and width) and
    how many local batches to run through it."""
    return {"model": model_name, "split": int(split), "width": int(width), "weights": weights,
            "batches": int(batches), "batch_size": int(batch_size), "codec": codec, "zstd_level": int(zstd_level),
            "activation_shape": [int(d) for d in activation_shape]}


def check_reply(body: dict[str, Any], model: SplitModel, split: int, samples: int,
                activation_shape: tuple[int, ...]) -> tuple[dict[str, Moments], Optional[torch.Tensor]]:
    """The moments and activations of a ``norm_sums`` body, validated (:class:`wire.WireError` if not)."""
    layers = norm_stats.expected_layers(model, model.client(split))
    counts = body["counts"]
    if set(counts) != set(layers):
        raise wire.WireError(f"norm_sums.counts: layers {sorted(counts)[:5]} are not the client portion's "
                             f"{sorted(layers)[:5]}")
    for name, n in counts.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < samples or n % samples \
                or n > samples * MAX_ELEMENTS_PER_SAMPLE:
            raise wire.WireError(f"norm_sums.counts[{name}]: {n!r} is not a count of {samples} samples")
    reference = {f"{name}.{part}": torch.zeros(c) for name, c in layers.items() for part in ("mean", "m2")}
    tensors = wire.decode_state(body["moments"], reference)   # keys, shapes, dtypes, finite
    if any(bool((tensors[f"{name}.m2"] < 0).any()) for name in layers):
        raise wire.WireError("norm_sums.moments: a sum of squared deviations is negative")
    x = None
    whole = split == model.num_blocks
    if whole != (body["x"] is None):
        raise wire.WireError("norm_sums.x: " + ("unexpected for a whole-model agent" if whole else "missing"))
    if not whole:
        x = wire.decode_tensor(body["x"], shape=(samples, *activation_shape), dtypes=("float32", "float16"),
                               as_float32=True)
        if not wire.all_finite(x):
            raise wire.WireError("norm_sums.x contains NaN or Inf")
    return norm_stats.from_wire_state(tensors, counts), x


def server_moments(model: SplitModel, split: int, x: torch.Tensor, batch_size: int) -> dict[str, Moments]:
    """The server portion's share: ``x`` (a device's activations, in its batch order) through
    ``model.server(split)`` batch by batch, exactly as the device ran its own layers."""
    device = next(model.parameters()).device
    batches = [x[i:i + batch_size].to(device) for i in range(0, len(x), batch_size)]
    moments, _ = norm_stats.collect(model, model.server(split), batches)
    return moments
