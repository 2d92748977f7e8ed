"""Server optimisers for the aggregated update: FedAvgM, FedAdam and FedYogi.

Plain aggregation replaces the global client portion by the round's weighted average. A server
optimiser instead treats the difference as a pseudo-gradient and steps with its own state,
which damps the round-to-round swings of label-skewed rounds. A server portion trained as one
copy on the merged batch of every selected device needs none; server layers averaged over
several copies (one per agent, S2FL's groups) step like client portions.

For each parameter ``x`` held by a client portion this round, with ``x̄`` the aggregate and
``Δ = x̄ - x``:

- **momentum** (FedAvgM; Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data
  Distribution for Federated Visual Classification", 2019):
  ``v ← β₁ v + Δ``, ``x ← x + η v``. With ``β₁ = 0, η = 1`` it is plain aggregation.
- **adam** (FedAdam; Reddi et al., "Adaptive Federated Optimization", ICLR 2021):
  ``m ← β₁ m + (1-β₁) Δ``, ``v ← β₂ v + (1-β₂) Δ²``, ``x ← x + η m / (√v + τ)``.
- **yogi** (FedYogi, same paper): as adam with ``v ← v - (1-β₂) Δ² sign(v - Δ²)``, whose
  second moment grows more slowly when updates become large.

``v`` starts at ``τ²`` for adam and yogi (as in the paper), every other state at zero. The state
lives on the coordinator and is checkpointed with the model; nothing more crosses the wire.
Buffers (BatchNorm statistics) are averaged as before: they are not gradients' integrals.

What steps (:func:`averaged_names`): every parameter of the round's client portions, and the
server layers the round averaged over several server copies (SplitFed v1's copy per agent,
S2FL's copy per group): their average drifts as the client portions' does. A single merged
server copy trained on every row is not an average, and its own optimiser already stepped it.
"""

from __future__ import annotations

from typing import Dict, Hashable, Iterable, Mapping

import torch

__all__ = ["KINDS", "ServerOptimizer", "STATE_PREFIX", "averaged_names"]

from sfl_core.options.server_opt.config import KINDS
STATE_PREFIX = "@server_opt/"
"""Checkpoint tensor names of the optimiser's state start with this: no module parameter can."""


class ServerOptimizer:
    """A server optimiser over named tensors (see the module docstring for the updates).

    Args:
        kind: ``momentum``, ``adam`` or ``yogi``.
        lr: the server learning rate η (1 for FedAvgM keeps the average's scale).
        beta1: momentum β₁ (also FedAvgM's β), in [0, 1).
        beta2: second-moment decay β₂ (adam, yogi), in [0, 1).
        tau: adaptivity τ > 0 (adam, yogi): the floor of the denominator.
    """

    def __init__(self, kind: str, lr: float, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3):
        if kind not in KINDS[2:]:
            raise ValueError(f"server optimiser: kind must be one of {', '.join(KINDS[2:])}, got {kind!r}")
        if not lr > 0:
            raise ValueError(f"server optimiser: lr must be > 0, got {lr!r}")
        for name, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0 <= b < 1:
                raise ValueError(f"server optimiser: {name} must be in [0, 1), got {b!r}")
        if not tau > 0:
            raise ValueError(f"server optimiser: tau must be > 0, got {tau!r}")
        self.kind, self.lr, self.beta1, self.beta2, self.tau = kind, float(lr), float(beta1), float(beta2), float(tau)
        self.m: Dict[str, torch.Tensor] = {}
        self.v: Dict[str, torch.Tensor] = {}

    def step(self, current: Mapping[str, torch.Tensor], aggregate: Mapping[str, torch.Tensor],
             keys: Iterable[str]) -> Dict[str, torch.Tensor]:
        """The new global state: ``aggregate`` with each of ``keys`` replaced by the optimiser's
        step from ``current`` (the global state the round started from)."""
        out = dict(aggregate)
        for k in keys:
            x = current[k].detach().to(torch.float32)
            delta = aggregate[k].detach().to(torch.float32) - x.to(aggregate[k].device)
            x = x.to(delta.device)
            if self.kind == "momentum":
                v = self.v[k] = self.beta1 * self.v.get(k, torch.zeros_like(delta)).to(delta.device) + delta
                new = x + self.lr * v
            else:
                m = self.m[k] = (self.beta1 * self.m.get(k, torch.zeros_like(delta)).to(delta.device)
                                 + (1 - self.beta1) * delta)
                v_prev = self.v.get(k, torch.full_like(delta, self.tau ** 2)).to(delta.device)
                sq = delta * delta
                if self.kind == "adam":
                    v = self.beta2 * v_prev + (1 - self.beta2) * sq
                else:   # yogi
                    v = v_prev - (1 - self.beta2) * sq * torch.sign(v_prev - sq)
                self.v[k] = v
                new = x + self.lr * m / (v.sqrt() + self.tau)
            out[k] = new.to(aggregate[k].dtype)
        return out

    def state_tensors(self) -> Dict[str, torch.Tensor]:
        """The state as checkpoint tensors (``@server_opt/m/<key>``, ``@server_opt/v/<key>``)."""
        return {**{f"{STATE_PREFIX}m/{k}": t.detach().cpu() for k, t in self.m.items()},
                **{f"{STATE_PREFIX}v/{k}": t.detach().cpu() for k, t in self.v.items()}}

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Continue from :meth:`state_tensors` (other names are ignored)."""
        for name, t in tensors.items():
            if name.startswith(STATE_PREFIX):
                which, _, key = name[len(STATE_PREFIX):].partition("/")
                if which in ("m", "v") and key:
                    (self.m if which == "m" else self.v)[key] = t.clone()


def averaged_names(client_states: Mapping[str, Mapping[str, torch.Tensor]],
                   server_states: Mapping[str, Mapping[str, torch.Tensor]],
                   copy_of: Mapping[str, Hashable], parameters: Iterable[str]) -> list[str]:
    """The ``parameters`` the round's aggregation averaged over trained copies, sorted: each one
    some agent's client portion held, and each server layer that more than one server copy
    (``copy_of``: agent -> its copy) trained for agents not holding it themselves."""
    names = set(parameters)
    held = {k for state in client_states.values() for k in state}
    copies: Dict[str, set] = {}
    for a, state in server_states.items():
        for k in state:
            if k not in client_states.get(a, {}):
                copies.setdefault(k, set()).add(copy_of.get(a, a))
    return sorted((held | {k for k, c in copies.items() if len(c) > 1}) & names)

