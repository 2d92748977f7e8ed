"""Drift correction for the client portions (and averaged server copies): FedProx's proximal
term and SCAFFOLD's control variates.

Under label skew each device's local steps pull its client portion towards its own classes,
and the average of those pulls is not the step the whole fleet's data asks for (client drift).
A server portion trained on the merged batch of every selected device needs no correction
(see "Server copies" below).

- **FedProx** (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020): each
  device minimises its loss plus ``μ/2 ‖w − x‖²``, with ``x`` the global client portion it
  received, so every local step adds ``μ (w − x)`` to the gradient. Nothing more crosses the
  wire than ``μ``.
- **SCAFFOLD** (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
  Learning", ICML 2020): every local step follows ``g + c − cᵢ``, where ``c`` estimates the
  fleet's gradient and ``cᵢ`` the device's own. After the round, with ``y`` the device's
  weights, option II of the paper gives::

      cᵢ⁺ = cᵢ − c + (x − y) / (K η)          c ← c + (1/N) Σᵢ (cᵢ⁺ − cᵢ)

  over the round's devices ``i`` and the ``N`` devices of the fleet. Here the coordinator
  holds every ``cᵢ``: all it needs is ``x`` (it sent it), ``y`` (the device's upload), ``K``
  and ``η`` (the assignment), so a device keeps no state (a restarted or replaced board
  loses nothing) and sends nothing more. It receives ``c − cᵢ`` with its assignment: one
  more client portion's worth of bytes down per round, counted with the rest.

  Devices train with momentum ``m``: a constant gradient ``g`` then moves the weights by
  ``η g Σₖ (1 − mᵏ)/(1 − m)`` over ``K`` steps (:func:`effective_steps`), which replaces ``K``
  in ``(x − y) / (K η)`` so that ``cᵢ⁺`` stays the device's mean gradient.

Only parameters are corrected; buffers (BatchNorm statistics) are not gradients' integrals.

Server copies. A server copy that trains on the merged rows of several devices (MergeSFL's
one copy, S2FL's data-balance groups) needs no correction: its batches mix their classes.
Where the round trains one copy per agent and averages them (SplitFed v1), each copy drifts
towards its agent's classes as a client portion does. The coordinator trains those copies
itself, so SCAFFOLD covers them at no cost on the wire: a copy steps with its agent's
``c − cᵢ`` for its layers, and that ``cᵢ`` is updated from the copy's ``y`` with the server's
``η``, ``K`` and ``m``. This is SCAFFOLD on the whole model, split or not. (Correcting S2FL's
groups with their members' mean correction was measured: it cost accuracy, docs/results.md.)
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch

from sfl_core.step_terms import leading_block

__all__ = ["STATE_PREFIX", "effective_steps", "ControlVariates"]

STATE_PREFIX = "@drift/"
"""Checkpoint tensor names of the control variates start with this: no module parameter can."""


def effective_steps(tau: int, momentum: float) -> float:
    """How many plain SGD steps ``tau`` steps of momentum ``m`` (buffer starting at zero) move
    the weights for a constant gradient: ``Σ_{k=1..τ} (1 − mᵏ)/(1 − m)`` (``τ`` when ``m = 0``)."""
    if momentum == 0:
        return float(tau)
    return sum((1 - momentum ** k) / (1 - momentum) for k in range(1, tau + 1))


class ControlVariates:
    """SCAFFOLD's ``c`` and every device's ``cᵢ``, held by the coordinator (module docstring).

    Tensors are keyed by the model's state-dict names; a device's may be a leading block of the
    global one (a narrower bottleneck). Missing entries are zero.
    """

    def __init__(self) -> None:
        self.c: Dict[str, torch.Tensor] = {}
        self.ci: Dict[str, Dict[str, torch.Tensor]] = {}

    def correction(self, agent: str, held: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``c − cᵢ`` for the parameters ``held`` (name -> the agent's tensor, for shapes)."""
        out = {}
        mine = self.ci.get(agent, {})
        for k, t in held.items():
            c = self.c[k][leading_block(self.c[k], tuple(t.shape))] if k in self.c else torch.zeros(t.shape)
            ci = mine.get(k)
            out[k] = (c - ci if ci is not None and ci.shape == t.shape else c).detach().float().cpu().clone()
        return out

    def update(self, start: Mapping[str, torch.Tensor], uploads: Mapping[str, Mapping[str, torch.Tensor]],
               steps: Mapping[str, Tuple[float, int, float]], fleet_size: int, full: Mapping[str, torch.Tensor],
               stepped_with: Optional[Mapping[str, Mapping[str, torch.Tensor]]] = None) -> None:
        """After a round: ``uploads[a]`` = device ``a``'s parameters ``y`` (a subset of names),
        ``start`` = the global ``x`` the round began from, ``steps[a]`` = its ``(η, K, m)``,
        ``fleet_size`` = N, ``full`` = the global tensors (for ``c``'s shapes).
        ``stepped_with[a]``: the ``c − cᵢ`` that ``y`` was trained with, where ``c`` may have
        moved since (an earlier update of the same round: agents cut deeper hold some of a
        server copy's layers on their side)."""
        total: Dict[str, torch.Tensor] = {}
        for a, y in uploads.items():
            lr, tau, m = steps[a]
            if tau <= 0:                          # never stepped: nothing learnt about its gradient
                continue
            scale = 1.0 / (lr * effective_steps(tau, m))
            sent = self.correction(a, y)          # c − cᵢ, at the agent's shapes: what it stepped with
            if stepped_with is not None and a in stepped_with:
                sent = {k: stepped_with[a][k].float().cpu() for k in sent}
            mine = self.ci.setdefault(a, {})
            for k, yk in y.items():
                yk = yk.detach().float().cpu()
                x = start[k].detach().float().cpu()[leading_block(start[k], tuple(yk.shape))]
                ci_old = mine[k] if k in mine and mine[k].shape == yk.shape else torch.zeros(yk.shape)
                ci_new = (x - yk) * scale - sent[k]   # cᵢ − c + (x − y)/(Kη)
                delta = ci_new - ci_old
                mine[k] = ci_new
                if k not in total:
                    total[k] = torch.zeros(tuple(full[k].shape))
                total[k][leading_block(total[k], tuple(delta.shape))] += delta
        for k, d in total.items():
            c = self.c.get(k, torch.zeros(tuple(full[k].shape)))
            self.c[k] = c + d / max(fleet_size, 1)

    def state_tensors(self) -> Dict[str, torch.Tensor]:
        """As checkpoint tensors: ``@drift/c/<name>`` and ``@drift/i/<agent>/<name>``."""
        out = {f"{STATE_PREFIX}c/{k}": t.clone() for k, t in self.c.items()}
        for a, d in self.ci.items():
            out.update({f"{STATE_PREFIX}i/{a}/{k}": t.clone() for k, t in d.items()})
        return out

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Continue from :meth:`state_tensors` (other names are ignored)."""
        for name, t in tensors.items():
            if not name.startswith(STATE_PREFIX):
                continue
            which, _, rest = name[len(STATE_PREFIX):].partition("/")
            if which == "c" and rest:
                self.c[rest] = t.clone()
            elif which == "i":
                agent, _, key = rest.partition("/")
                if agent and key:
                    self.ci.setdefault(agent, {})[key] = t.clone()
