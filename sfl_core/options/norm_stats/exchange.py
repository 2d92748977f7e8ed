"""The coordinator's side of ``norm_stats: federated`` (:mod:`sfl_core.options.norm_stats.stats`): what a
statistics pass asks of a device, how its answer is checked, and the server portion's share.

A device's answer is untrusted input like any other: the layers must be exactly its client
portion's BatchNorm layers, every tensor the layer's channel count, every number finite, the
counts whole multiples of the samples asked for, and the activations the shape the assignment
fixed. An answer that fails is rejected and left out; the statistics then come from the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from sfl_core.model.zoo import SplitModel
from sfl_core.options.norm_stats import stats as norm_stats
from sfl_core.options.norm_stats.stats import Moments
from sfl_core.wire import codec as wire

__all__ = ["PassRequest", "request_body", "check_reply", "server_moments"]

MAX_ELEMENTS_PER_SAMPLE = 1 << 24
"""A layer's count per sample is its spatial size: far below this for any model that fits a device."""


@dataclass(frozen=True)
class PassRequest:
    """A ``norm_pass``: the new global client portion (encoded once per split and width) and how
    many local batches of what size to run through it; the activations go back in ``codec``."""

    model: str
    split: int
    width: int
    weights: dict[str, Any]
    batches: int
    batch_size: int
    codec: str
    zstd_level: int
    activation_shape: tuple[int, ...]

    LIMITS: ClassVar[tuple[tuple[str, int, int], ...]] = (
        ("batches", 1, 64), ("batch_size", 1, 4096), ("split", 0, 10_000), ("width", 0, 1 << 20), ("zstd_level", 0, 22))

    def to_body(self) -> dict[str, Any]:
        return {"model": self.model, "split": int(self.split), "width": int(self.width), "weights": self.weights,
                "batches": int(self.batches), "batch_size": int(self.batch_size), "codec": self.codec,
                "zstd_level": int(self.zstd_level), "activation_shape": [int(d) for d in self.activation_shape]}

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> "PassRequest":
        """Range-check every field (the protocol schema did the types)."""
        for key, lo, hi in cls.LIMITS:
            if not lo <= b[key] <= hi:
                raise wire.WireError(f"norm_pass.{key}: {b[key]} is out of range")
        wire.check_codec(b["codec"])
        shape = b["activation_shape"]
        if len(shape) > 6 or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise wire.WireError(f"norm_pass.activation_shape: bad shape {shape}")
        return cls(b["model"], b["split"], b["width"], b["weights"], b["batches"], b["batch_size"], b["codec"],
                   b["zstd_level"], tuple(shape))


def request_body(model_name: str, split: int, width: int, weights: dict[str, Any], *, batches: int,
                 batch_size: int, codec: str, zstd_level: int, activation_shape: tuple[int, ...]) -> dict[str, Any]:
    """A ``norm_pass`` body (:class:`PassRequest`)."""
    return PassRequest(model_name, split, width, weights, batches, batch_size, codec, zstd_level,
                       tuple(activation_shape)).to_body()


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
