"""Simulated devices that lie, for measuring the defenses (``bench/attacks.py``, the tests).

An attacker is an ordinary simulated agent (:class:`~edge_agent.agent.AgentCore`) with valid
credentials whose data, claims or messages are poisoned; everything it sends still goes
through the real encoder and the coordinator's validation. The attacks:

* ``label_flip``: trains on labels ``c -> C - 1 - c`` (a targeted attack on every class).
* ``backdoor``: a bright ``size x size`` square in the image's corner on a share of its
  samples, labelled ``target`` (a pixel-pattern backdoor, Gu et al., "BadNets", 2017); the
  attack succeeds where the global model sends triggered test images to ``target``.
* ``scale``: uploads its client portion's change scaled by ``factor`` (×10, ×1000).
* ``nan``: uploads NaN weights.
* ``random``: uploads random weights (normal, the scale of the model's).
* ``activations``: sends its activations scaled by ``factor`` and noised with standard
  deviation ``noise`` (poisoning the server portion through the server's step).
* ``claim``: registers ``factor`` times its samples (label counts scaled alike), to weigh more.
* ``even_mix``: registers its samples spread evenly over the classes, whatever it holds: the
  mix a selection by label mix (MergeSFL's KL selection) or a balancing planner prefers, to be
  picked round after round. It trains honestly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from edge_agent.agent import AgentCore
from sfl_core.wire.protocol import Message

__all__ = ["ATTACKS", "Attack", "MaliciousCore", "poison_data", "trigger"]

ATTACKS = ("label_flip", "backdoor", "scale", "nan", "random", "activations", "claim", "even_mix")


@dataclass(frozen=True)
class Attack:
    kind: str
    factor: float = 10.0
    """``scale``: the change's factor; ``activations``: the activations' factor; ``claim``: the
    samples' factor."""
    noise: float = 0.0
    """``activations``: the standard deviation of the noise added."""
    target: int = 0
    """``backdoor``: the label triggered images are sent to."""
    share: float = 0.5
    """``backdoor``: the share of its samples that carry the trigger."""
    size: int = 3
    """``backdoor``: the trigger square's side in pixels."""

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ValueError(f"unknown attack {self.kind!r}; expected one of {', '.join(ATTACKS)}")


def trigger(x: torch.Tensor, size: int) -> torch.Tensor:
    """Images ``x`` (N, C, H, W) with the backdoor's square at the bottom-right corner set to the
    images' maximum."""
    out = x.clone()
    out[..., -size:, -size:] = x.amax()
    return out


def poison_data(x: torch.Tensor, y: torch.Tensor, num_classes: int, attack: Attack,
                generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An attacker's training data: labels flipped, or a share carrying the trigger with the
    target label; other attacks keep the data."""
    if attack.kind == "label_flip":
        return x, (num_classes - 1 - y).to(y.dtype)
    if attack.kind == "backdoor":
        n = int(round(attack.share * len(y)))
        if not n:   # a device of a sample or none: nothing to carry the trigger
            return x, y
        idx = torch.randperm(len(y), generator=generator)[:n]
        x, y = x.clone(), y.clone()
        x[idx] = trigger(x[idx], attack.size)
        y[idx] = attack.target
        return x, y
    return x, y


class MaliciousCore(AgentCore):
    """An agent whose uploads or activations are poisoned as :class:`Attack` says."""

    def __init__(self, *args, attack: Attack, **kwargs):
        super().__init__(*args, **kwargs)
        self.attack = attack
        self._start: dict[str, torch.Tensor] = {}
        self._gen = torch.Generator().manual_seed(self._seed + 7919)

    def _stash_start(self) -> None:
        """The client portion as the assignment loaded it (the first step of a round; the round's
        upload clears it)."""
        if self.attack.kind in ("scale", "nan", "random") and not self._start and self._assign is not None:
            model = self._model(self._assign.model, self._assign.split, self._assign.width)
            self._start = {k: v.detach().clone() for k, v in model.client_state(self._assign.split).items()}

    def _forward_next(self) -> Message:
        self._stash_start()
        return super()._forward_next()

    def _train_locally(self) -> Message:
        self._stash_start()
        return super()._train_locally()

    def _protect(self, x: torch.Tensor, out: torch.Tensor):
        sent, leak = super()._protect(x, out)
        if self.attack.kind == "activations":
            sent = sent * self.attack.factor
            if self.attack.noise > 0:
                sent = sent + self.attack.noise * torch.randn(sent.shape, generator=self._gen).to(sent.device)
        return sent, leak

    def _weights_message(self, loss: float) -> Message:
        kind = self.attack.kind
        if kind in ("scale", "nan", "random") and self._assign is not None:
            model = self._model(self._assign.model, self._assign.split, self._assign.width)
            trained = model.client_state(self._assign.split)
            poisoned = {}
            for k, v in trained.items():
                if not v.is_floating_point():
                    continue
                start = self._start.get(k, v)
                if kind == "scale":
                    poisoned[k] = start + self.attack.factor * (v - start)
                elif kind == "nan":
                    poisoned[k] = torch.full_like(v, float("nan"))
                else:
                    poisoned[k] = torch.randn(v.shape, generator=self._gen).to(v) * (v.std() if v.numel() > 1 else 1.0)
            model.load_state_dict(poisoned, strict=False)
        self._start = {}
        return super()._weights_message(loss)


def claimed_counts(counts: list[int], attacks: Mapping[str, Attack], agent_id: str) -> list[int]:
    """The label counts an agent registers: scaled for a ``claim`` attacker, its samples spread
    evenly over the classes for an ``even_mix`` one."""
    a = attacks.get(agent_id)
    if a is not None and a.kind == "claim":
        return [int(c * a.factor) for c in counts]
    if a is not None and a.kind == "even_mix":
        n, k = sum(counts), len(counts)
        return [n // k + (1 if i < n % k else 0) for i in range(k)]
    return counts
