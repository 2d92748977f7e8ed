"""Terms added to the gradients of every local step before the optimiser steps: what a training
option (drift correction, :mod:`sfl_core.options.drift`) asks of a device's client portion and of
the server's copies alike, applied by the one trainer that steps them."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

__all__ = ["StepTerms", "leading_block"]


def leading_block(t: torch.Tensor, shape: Tuple[int, ...]) -> Tuple[slice, ...]:
    """The leading block of ``t`` of ``shape`` (a HeteroSFL agent holds the first ``width`` encoder rows)."""
    return tuple(slice(0, d) for d in shape)


class StepTerms:
    """What drift correction adds to the gradients of every local step, on a device's client
    portion or on a server copy: SCAFFOLD's ``c − cᵢ`` and FedProx's ``μ (w − x)``, with ``x``
    the weights as the round began (kept as a term ``−μ x`` plus ``μ w`` at step time).

    Args:
        params: each parameter with its SCAFFOLD correction (``None``: none), in order.
        proximal: FedProx's μ (0: no proximal term).
    """

    def __init__(self, params: Sequence[Tuple[torch.nn.Parameter, Optional[torch.Tensor]]], proximal: float = 0.0):
        self.proximal = float(proximal)
        self.params = [p for p, _ in params]
        self.terms = [(p, -self.proximal * p.detach().clone()) for p in self.params] if self.proximal else []
        self.terms += [(p, c) for p, c in params if c is not None]

    @torch.no_grad()
    def apply(self) -> None:
        """Add the terms to the gradients about to be stepped (a parameter without one gets them alone)."""
        for p, extra in self.terms:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(extra)
        if self.proximal:
            for p in self.params:
                assert p.grad is not None   # given one above
                p.grad.add_(p, alpha=self.proximal)
