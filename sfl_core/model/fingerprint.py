"""Architecture fingerprints: do the coordinator and a device build the same model?

A user's model is built on each side from code installed there (a file, a plugin package),
so the two can drift: an edited file on one device, an older package. Weights would then
be decoded into the wrong tensors, or fail deep inside a round. So each side describes its
model as one line per tensor (state-dict name, shape, dtype, and the type of the layer that
owns it); the run description carries the coordinator's lines, an agent compares them
with its own before registering and names the first difference, and the registration
carries a digest the coordinator checks too (for agents written by others).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from torch import nn

__all__ = ["MAX_LINES", "architecture", "digest", "fingerprinted", "first_difference"]

MAX_LINES = 4096
"""Most lines a received description may have (a run description is bounded)."""


def architecture(model: nn.Module) -> list[str]:
    """``"<name> <shape> <dtype> <layer type>"`` for every parameter and buffer, in order."""
    owners = {name: type(module).__name__ for name, module in model.named_modules()}
    lines = []
    for name, tensor in model.state_dict().items():
        owner = owners.get(name.rpartition(".")[0], type(model).__name__)
        shape = "x".join(str(d) for d in tensor.shape) or "scalar"
        lines.append(f"{name} {shape} {str(tensor.dtype).replace('torch.', '')} {owner}")
    return lines


def digest(lines: Sequence[str]) -> str:
    """A short stable digest of an architecture description."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def first_difference(expected: Sequence[str], ours: Sequence[str]) -> str:
    """One line naming where ``ours`` first departs from ``expected`` ('' when they are equal)."""
    for i, (e, o) in enumerate(zip(expected, ours)):
        if e != o:
            return f"tensor {i}: the run has '{e}', this device has '{o}'"
    if len(expected) != len(ours):
        longer, who = (expected, "the run") if len(expected) > len(ours) else (ours, "this device")
        return (f"{who} has {abs(len(expected) - len(ours))} more tensor(s), from "
                f"'{longer[min(len(expected), len(ours))]}'")
    return ""


def fingerprinted(cfg: Any) -> bool:
    """Whether a run (a ``RunConfig``) checks every agent's model against its own: where each
    side builds it from code installed on its own (a user's model file or layer list), and in
    every run on the devices' own data. Runs of the built-in zoo on benchmark sets leave it
    out, so that agents of an earlier release still join them."""
    from sfl_core.model.user_models import user_model_fields
    return cfg.task is not None or bool(user_model_fields(cfg.model))
